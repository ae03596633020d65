"""The recomputing training call: nothing of ORT's forward is kept, backward runs it again.

FSDP2 with `reshard_after_forward` frees the memory of a block's full parameters after its
forward and gathers them again, into new memory, before its backward. ORT's saved state would
point at the freed memory (NaN losses were the symptom); these tests free and re-gather a
parameter's storage exactly as FSDP2 does, without torch.distributed. Activation checkpointing
(`torch.utils.checkpoint` around a call) reruns the whole call in backward: the first call
builds inside it, and a graph with dropout must not draw another mask there.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ort_autopatch.engine import ModuleEngine
from tests.helpers import plain_backend

#: the autograd node of a recomputing call (`graph_function`, every backend)
RECOMPUTING = "RecomputingGraphFunctionBackward"


class Net(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _reshard_and_gather(params: list[nn.Parameter]) -> None:
    """FSDP2's free (storage resized to 0) and all-gather (resized back, data copied in)."""
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.untyped_storage().resize_(0)
    garbage = [torch.full((4096,), float("nan")) for _ in range(16)]  # reuse the freed memory
    for p, data in zip(params, saved, strict=True):
        p.untyped_storage().resize_(data.numel() * data.element_size())
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
            p.copy_(data)
    del garbage


def test_gradients_are_right_when_parameters_move_between_forward_and_backward() -> None:
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    engine = ModuleEngine(model)

    out = engine.run((x,), {}, recompute=True)
    _reshard_and_gather(list(model.parameters()))
    out.square().sum().backward()

    expected = reference(x_ref)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert engine.builds == 1


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(32))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x) * self.w


def test_the_recomputed_forward_replays_the_dropout_mask() -> None:
    torch.manual_seed(0)
    model = Scaled()
    engine = ModuleEngine(model)
    x = torch.randn(64, 32)
    out = engine.run((x,), {}, recompute=True)
    engine.run((x,), {})  # another forward reseeds ORT's generator in between
    out.sum().backward()
    assert 0.3 < (out == 0).float().mean() < 0.7  # dropout really dropped
    # d out / d w = dropout(x) with w = 1: the forward's own output, mask and all
    torch.testing.assert_close(model.w.grad, out.detach().sum(0))


def test_nothing_of_the_forward_is_kept_but_its_inputs() -> None:
    """Between forward and backward the call holds the feeds only: ORT's execution state (its
    activations and its pointers into the parameters) is gone, and so are the activations the
    plain backend saves otherwise."""
    model = Net()
    engine = ModuleEngine(model)
    x = torch.randn(5, 8, requires_grad=True)
    out = engine.run((x,), {}, recompute=True)
    node = out.grad_fn
    assert type(node).__name__ == RECOMPUTING
    assert not hasattr(node, "run")  # TrainingCall keeps ORT's state there
    saved = node.saved_tensors
    assert any(t is x for t in saved)
    assert all(t is x or isinstance(t, nn.Parameter) for t in saved)


@pytest.mark.skipif(
    plain_backend(),
    reason="EngineOptions.torch_ops sends chosen operators to the training build's PythonOp "
    "and ATen nodes, an option the plain backend does not take; its own torch nodes refuse "
    "random operators (tests/test_plain_torch_nodes.py)",
)
def test_random_torch_calling_nodes_draw_the_same_seeds_when_recomputed() -> None:
    """Dropout routed to a torch-calling node: its seed comes from the tool's generator, and the
    recomputed forward in backward must get the forward's seed back, not the next one."""
    from ort_autopatch.engine import EngineOptions

    torch.manual_seed(0)
    model = Scaled()
    engine = ModuleEngine(model, EngineOptions(torch_ops=("aten::dropout",)))
    x = torch.randn(64, 32)
    out = engine.run((x,), {}, recompute=True)
    assert engine.records[-1].torch_nodes == {"aten::dropout": 1}
    engine.run((x,), {})  # another forward draws the generator's next seed
    out.sum().backward()
    assert 0.3 < (out == 0).float().mean() < 0.7
    torch.testing.assert_close(model.w.grad, out.detach().sum(0))


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.fc(x)))


def test_batch_norm_statistics_are_updated_once_and_gradients_equal_eager() -> None:
    torch.manual_seed(0)
    model, reference = Normed(), Normed()
    reference.load_state_dict(model.state_dict())
    engine = ModuleEngine(model)
    for step in range(3):
        x = torch.randn(6, 8)
        out = engine.run((x,), {}, recompute=True)
        _reshard_and_gather(list(model.parameters()))
        out.square().sum().backward()
        expected = reference(x)
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, msg=f"step {step}")
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: {name}")
        for (name, b), c in zip(model.named_buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(b, c, msg=f"step {step}: {name}")  # one update a step
    assert int(model.bn.num_batches_tracked) == 3


def test_a_first_call_under_activation_checkpointing_builds_and_equals_eager() -> None:
    """The call builds inside the checkpoint's saved-tensor hooks (the plain backend's trace
    and first-call check run autograd, which must not feed the checkpoint); the checkpoint's
    rerun in backward runs the graph again, and every step equals eager's."""
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    engine = ModuleEngine(model)
    for step in range(2):
        x = torch.randn(5, 8, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out = checkpoint(engine, x, use_reentrant=False)
        expected = checkpoint(reference, x_ref, use_reentrant=False)
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, msg=f"step {step}")
        torch.testing.assert_close(x.grad, x_ref.grad, msg=f"step {step}")
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: {name}")
        model.zero_grad()
        reference.zero_grad()
    assert engine.builds == 1


def test_dropout_under_activation_checkpointing_gets_the_forwards_mask_in_backward() -> None:
    """The checkpoint reruns the call in backward; the gradient must still be that of the
    mask the forward's output was made with."""
    torch.manual_seed(0)
    model = Scaled()
    engine = ModuleEngine(model)
    x = torch.randn(64, 32)
    out = checkpoint(engine, x, use_reentrant=False)
    engine.run((x,), {})  # another forward draws the tool's next seed in between
    out.sum().backward()
    assert 0.3 < (out == 0).float().mean() < 0.7
    torch.testing.assert_close(model.w.grad, out.detach().sum(0))
