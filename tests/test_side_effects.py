"""What forward changes besides its outputs happens on every call, as in eager PyTorch.

A graph reused on a cache hit does not run forward. So what forward stores (a mask cached on the
module, an auxiliary loss for the training loop to add, a running average in a buffer) must come
back from the graph, and what a graph cannot repeat (a Python counter, a list appended to) must
send the class to PyTorch, named; never a value frozen at the traced call.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tests.helpers import class_stats, patched


class CachedMask(nn.Module):
    """word_language_model's TransformerModel: a causal mask cached on the module per length."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (length, batch, 4)
        if self.mask is None or self.mask.size(0) != len(x):
            self.mask = torch.triu(torch.full((len(x), len(x)), float("-inf")), diagonal=1)
        q = self.fc(x).transpose(0, 1)
        scores = q @ x.transpose(0, 1).transpose(1, 2) + self.mask
        return scores.softmax(-1)


class AuxiliaryLoss(nn.Module):
    """A mixture-of-experts style auxiliary loss the training loop reads off the module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.aux_loss = h.pow(2).mean()
        return h.relu()


class RunningStats(nn.Module):
    """Buffers updated in place by forward: a step counter and a running mean."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.training:
            self.steps += 1
            self.mean.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y - self.mean


class KeepsKeysAndValues(nn.Module):
    """A hand-written attention that keeps its last keys and values as a tuple attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(4, 4)
        self.v = nn.Linear(4, 4)
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.k(x), self.v(x)
        self.kv = (k, v)
        return (x @ k.transpose(-1, -2)).softmax(-1) @ v


class StatefulGRU(nn.Module):
    """Keeps its hidden state between calls, detached, as truncated-BPTT scripts do."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, h = self.rnn(x, self.hidden)
        self.hidden = h.detach()
        return out


class KeepsNoise(nn.Module):
    """Draws fresh noise every call and keeps it on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.noise: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.noise = torch.randn(4)
        return self.fc(x) + self.noise


class Tracker(nn.Module):
    """Not selected: a submodule that keeps its last output and counts its calls in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.calls += 1
        self.last = y
        return y


class HoldsTrackers(nn.Module):
    """The writes happen two levels below the selected module."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Tracker(), nn.ReLU(), Tracker())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).sum(-1)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * self.calls


class History(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(3)
        return self.fc(x) * len(self.sizes)


class SetsAFlag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.ready = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ready = True  # the value it already holds
        return self.fc(x)


class Config:
    def __init__(self) -> None:
        self.problem_type: str | None = None


class SetsUpOnce(nn.Module):
    """transformers' sequence classifiers set `config.problem_type` on their first call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.config = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            self.config.problem_type = "regression"
        return self.fc(x)


class CopiesItsConfig(nn.Module):
    """transformers' `get_text_config` deep-copies the config and edits the copy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.config = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        edited = copy.deepcopy(self.config)
        del edited.problem_type
        edited.scale = 2.0
        return self.fc(x) * edited.scale


PATCHED = (
    HoldsTrackers,
    CopiesItsConfig,
    KeepsNoise,
    StatefulGRU,
    KeepsKeysAndValues,
    CachedMask,
    AuxiliaryLoss,
    RunningStats,
    Counter,
    History,
    SetsAFlag,
    SetsUpOnce,
)


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched(PATCHED)


def _twins(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    """The same module twice: one called through the tool, one through its eager forward."""
    torch.manual_seed(0)
    ort = cls()
    eager = cls()
    eager.load_state_dict(ort.state_dict())
    return ort, eager


def test_a_mask_cached_on_the_module_is_written_back_as_eager_writes_it() -> None:
    ort, eager = _twins(CachedMask)
    for length in (5, 5, 3, 5, 7, 7, 3):
        x = torch.randn(length, 2, 4)
        torch.testing.assert_close(ort(x), type(eager).forward(eager, x), rtol=1e-5, atol=1e-5)
        assert ort.mask is not None and eager.mask is not None
        assert torch.equal(ort.mask, eager.mask)
    assert class_stats(CachedMask).ort_calls == 7


def test_an_auxiliary_loss_stored_by_forward_carries_its_gradient() -> None:
    ort, eager = _twins(AuxiliaryLoss)
    for batch in (3, 5, 3):
        x = torch.randn(batch, 4)
        losses = []
        for model, call in ((ort, ort), (eager, lambda x: type(eager).forward(eager, x))):
            model.zero_grad()
            out = call(x)
            loss = out.sum() + 0.5 * model.aux_loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        for a, b in zip(ort.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    stats = class_stats(AuxiliaryLoss)
    assert stats.ort_calls == 3
    assert stats.ignored_writes == 0  # forward's writes, assigned again, are not the user's


def test_a_tuple_of_tensors_assigned_by_forward_is_assigned_again_each_call() -> None:
    ort, eager = _twins(KeepsKeysAndValues)
    for length in (3, 5):
        x = torch.randn(2, length, 4)
        torch.testing.assert_close(ort(x), type(eager).forward(eager, x), rtol=1e-5, atol=1e-6)
        assert ort.kv is not None and eager.kv is not None
        for a, b in zip(ort.kv, eager.kv, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert class_stats(KeepsKeysAndValues).ort_calls == 2


def test_a_detached_hidden_state_kept_by_forward_is_detached_and_carried_over() -> None:
    ort, eager = _twins(StatefulGRU)
    for _ in range(3):
        x = torch.randn(2, 5, 3)
        for model in (ort, eager):
            model.zero_grad()
        ort(x).sum().backward()
        type(eager).forward(eager, x).sum().backward()
        assert ort.hidden is not None and eager.hidden is not None
        assert not ort.hidden.requires_grad
        torch.testing.assert_close(ort.hidden, eager.hidden, rtol=1e-5, atol=1e-6)
        for a, b in zip(ort.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert class_stats(StatefulGRU).ort_calls == 3


def test_noise_drawn_and_kept_by_forward_is_drawn_anew_each_call() -> None:
    model, _ = _twins(KeepsNoise)
    x = torch.zeros(2, 4)
    kept = []
    for _ in range(3):
        out = model(x)
        assert model.noise is not None
        torch.testing.assert_close(out, model.fc(x) + model.noise)  # the noise it returned
        kept.append(model.noise)
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[1], kept[2])
    assert class_stats(KeepsNoise).ort_calls == 3


def test_buffers_updated_in_place_by_forward_are_updated_by_every_call() -> None:
    ort, eager = _twins(RunningStats)
    for step in range(4):
        x = torch.randn(2 + step, 3)
        torch.testing.assert_close(ort(x), type(eager).forward(eager, x), rtol=1e-5, atol=1e-6)
        assert ort.steps.item() == eager.steps.item() == step + 1
        torch.testing.assert_close(ort.mean, eager.mean, rtol=1e-5, atol=1e-6)
    ort.eval()
    eager.eval()
    x = torch.randn(2, 3)
    torch.testing.assert_close(ort(x), type(eager).forward(eager, x), rtol=1e-5, atol=1e-6)
    assert ort.steps.item() == 4
    assert class_stats(RunningStats).ort_calls == 5


def test_a_python_counter_written_by_forward_runs_in_pytorch_named() -> None:
    ort, eager = _twins(Counter)
    x = torch.randn(3, 2)
    for _ in range(3):
        torch.testing.assert_close(ort(x), type(eager).forward(eager, x))
        assert ort.calls == eager.calls  # the refused trace's write was undone: one per call
    stats = class_stats(Counter)
    assert stats.ort_calls == 0
    ((reason, detail),) = stats.fallbacks
    assert reason == "forward changes state a graph cannot replay"
    assert "forward writes Counter.calls (int)" in detail
    assert "test_side_effects.py:" in detail


def test_a_class_that_changes_state_every_call_is_traced_twice_at_most() -> None:
    ort, _ = _twins(Counter)
    for _ in range(5):
        ort(torch.randn(3, 2))
    stats = class_stats(Counter)
    assert stats.eager_calls["forward changed state: traced again next call"] == 1
    assert sum(stats.fallbacks.values()) == 4  # the second trace's refusal, then no traces


def test_state_written_once_runs_that_call_in_pytorch_and_the_rest_in_ort() -> None:
    ort, eager = _twins(SetsUpOnce)
    for _ in range(4):
        x = torch.randn(3, 2)
        torch.testing.assert_close(ort(x), type(eager).forward(eager, x))
    assert ort.config.problem_type == "regression"
    stats = class_stats(SetsUpOnce)
    assert stats.ort_calls == 3 and not stats.fallbacks
    assert dict(stats.eager_calls) == {"forward changed state: traced again next call": 1}


def test_a_list_appended_to_by_forward_runs_in_pytorch_named() -> None:
    ort, eager = _twins(History)
    x = torch.randn(3, 2)
    for _ in range(3):
        torch.testing.assert_close(ort(x), type(eager).forward(eager, x))
    assert ort.sizes == eager.sizes == [3, 3, 3]
    ((_, detail),) = class_stats(History).fallbacks
    assert "forward changes History.sizes in place" in detail


def test_a_write_that_keeps_the_value_keeps_the_graph() -> None:
    ort, _ = _twins(SetsAFlag)
    for _ in range(3):
        ort(torch.randn(3, 2))
    stats = class_stats(SetsAFlag)
    assert stats.ort_calls == 3 and stats.exports == 1


def test_a_copy_forward_makes_and_edits_is_not_the_modules_state() -> None:
    ort, eager = _twins(CopiesItsConfig)
    for _ in range(3):
        x = torch.randn(3, 2)
        torch.testing.assert_close(ort(x), type(eager).forward(eager, x))
    assert ort.config.problem_type is None
    stats = class_stats(CopiesItsConfig)
    assert stats.ort_calls == 3 and not stats.eager_calls


def test_writes_in_submodules_are_replayed_on_the_submodules() -> None:
    ort, eager = _twins(HoldsTrackers)
    for batch in (2, 5, 3):
        x = torch.randn(batch, 3)
        for model in (ort, eager):
            model.zero_grad()
        ort(x).sum().backward()
        type(eager).forward(eager, x).sum().backward()
        for mine, theirs in zip(ort.blocks[::2], eager.blocks[::2], strict=True):
            assert mine.calls.item() == theirs.calls.item()
            torch.testing.assert_close(mine.last, theirs.last, rtol=1e-5, atol=1e-6)
        for a, b in zip(ort.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert ort.blocks[0].calls.item() == 3
    assert class_stats(HoldsTrackers).ort_calls == 3
