"""Randomness around a patched module: torch's stream is left as eager leaves it, random
operators inside graphs follow `torch.manual_seed` without drawing from the user's stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from ort_autopatch import patcher, report
from tests.helpers import assert_close, patched


class DropoutNet(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class NoisyNet(nn.Module):
    """Random operators other than dropout: `randn_like` and `multinomial`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        noisy = h + 0.1 * torch.randn_like(h)
        picks = torch.multinomial(torch.softmax(h.detach(), -1), 1)
        return noisy, picks


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched((DropoutNet, NoisyNet))


def _ort_calls(cls: type) -> int:
    return report.stats_for(patcher.class_name(cls)).ort_calls


def test_graph_without_random_op_leaves_torch_stream_as_eager_does_at_every_step() -> None:
    """Dropout p=0 in train mode: batches sampled after each step are eager's batches."""

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(1)
        net = DropoutNet(0.0)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        states, losses = [], []
        for step in range(4):
            x = torch.randn(5 + step, 16)  # drawn from the user's stream after each step
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            states.append(torch.get_rng_state())
            losses.append(loss.detach())
        return states, losses

    patcher.unpatch(DropoutNet)
    eager_states, eager_losses = run()
    patcher.patch(DropoutNet)
    states, losses = run()
    for step, (e, o) in enumerate(zip(eager_states, states, strict=True)):
        assert torch.equal(e, o), f"torch's RNG state differs from eager's after step {step}"
    for step, (e, o) in enumerate(zip(eager_losses, losses, strict=True)):
        assert_close(o, e, f"step {step} loss")
    assert _ort_calls(DropoutNet) == 4


def _train(make: Callable[[], nn.Module], seed: int, steps: int = 3) -> list[torch.Tensor]:
    """Seeded run; asserts that no call moves torch's stream and returns every output/grad."""
    torch.manual_seed(seed)
    model = make()
    x = torch.randn(64, 16)
    seen = []
    for _ in range(steps):
        before = torch.get_rng_state()
        out = model(x)
        first = out[0] if isinstance(out, tuple) else out
        first.square().sum().backward()
        assert torch.equal(torch.get_rng_state(), before), "a call drew from torch's stream"
        seen += [t.detach().clone() for t in (out if isinstance(out, tuple) else (out,))]
        seen += [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
    return seen


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"tensor #{k} differs between two runs with one seed"


def test_dropout_is_reproducible_under_manual_seed_and_leaves_the_stream_alone() -> None:
    first = _train(lambda: DropoutNet(0.5), seed=3)
    again = _train(lambda: DropoutNet(0.5), seed=3)
    other = _train(lambda: DropoutNet(0.5), seed=4)
    _assert_same(first, again)
    assert not torch.equal(first[0], other[0])
    assert _ort_calls(DropoutNet) == 9


def test_dropout_masks_change_from_step_to_step() -> None:
    torch.manual_seed(0)
    model = DropoutNet(0.5)
    x = torch.randn(256, 16)
    grads = []
    for _ in range(3):
        x_in = x.clone().requires_grad_()
        model(x_in).sum().backward()
        grads.append(x_in.grad)
    assert not torch.equal(grads[0], grads[1]) and not torch.equal(grads[1], grads[2])
    assert _ort_calls(DropoutNet) == 3


def test_dropout_mask_follows_rate_and_scale_inside_the_graph() -> None:
    class Drop(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(x, 0.25, training=True)

    patcher.patch(Drop)
    x = torch.ones(200, 200, requires_grad=True)
    y = Drop()(x)
    kept = y != 0
    assert abs(float(kept.float().mean()) - 0.75) < 0.01
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.75))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # backward reuses the forward mask
    assert _ort_calls(Drop) == 1


def test_randn_like_and_multinomial_are_reproducible_and_leave_the_stream_alone() -> None:
    first = _train(NoisyNet, seed=5)
    again = _train(NoisyNet, seed=5)
    other = _train(NoisyNet, seed=6)
    _assert_same(first, again)
    assert not torch.equal(first[0], other[0])
    # each step draws fresh noise and fresh picks
    assert not torch.equal(first[0], first[4])
    assert _ort_calls(NoisyNet) == 9


def test_manual_seed_keeps_behaving_as_torch_s() -> None:
    _train(lambda: DropoutNet(0.5), seed=0, steps=1)  # the tool's stream is in use
    torch.manual_seed(7)
    ours = torch.rand(4)
    generator = torch.Generator().manual_seed(7)
    assert torch.equal(ours, torch.rand(4, generator=generator))
    assert torch.initial_seed() == 7


def test_gpt_with_gradient_accumulation_sampling_after_each_forward_gives_eager_losses() -> None:
    """nanoGPT's loop: the next batch is sampled between forward and backward, so any draw
    from torch's stream inside a step would change every later batch."""
    from tests.reliability.models import TinyLM

    def train() -> list[float]:
        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.randint(0, 97, (4096,))

        def batch() -> torch.Tensor:
            starts = torch.randint(0, len(data) - 17, (4,))
            return torch.stack([data[s : s + 17] for s in starts])

        ids, losses = batch(), []
        for _ in range(3):
            for _ in range(2):  # gradient accumulation
                loss = model(ids) / 2
                ids = batch()  # sampled while the step's graph is alive
                loss.backward()
                losses.append(float(loss))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses

    expected = train()
    patcher.patch(TinyLM)
    actual = train()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    assert _ort_calls(TinyLM) == 6


RECURRENT_SCRIPT = """
import hashlib, json
import torch
from torch import nn
from ort_autopatch import patcher, report


class Recurrent(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


patcher.patch(Recurrent)
digest = hashlib.sha256()
for kind in ("LSTM", "GRU"):
    torch.manual_seed(0)
    model = Recurrent(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        loss = model(torch.randn(8, 10 + step, 16)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        digest.update(loss.detach().numpy().tobytes())
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
calls = report.stats_for(patcher.class_name(Recurrent)).ort_calls
print(json.dumps({"digest": digest.hexdigest(), "ort_calls": calls}))
"""


def test_two_runs_of_lstm_and_gru_models_with_one_seed_are_bit_identical() -> None:
    import json

    from tests.proc_helpers import PY, run_side_by_side

    results = []
    runs = [[PY, "-c", RECURRENT_SCRIPT]] * 2
    for done in run_side_by_side(runs, env={"OMP_NUM_THREADS": "2"}, timeout=180):
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert results[0]["ort_calls"] == 8
    assert results[0] == results[1]


class Reparameterised(nn.Module):
    """A VAE's sampling step: noise from `randn_like` (ORT's RandomNormalLike, seeded once per
    session) scaled by a learned deviation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h + torch.exp(0.5 * h) * torch.randn_like(h)


def test_a_graph_with_session_seeded_draws_under_checkpointing_runs_in_pytorch() -> None:
    """Activation checkpointing runs forward again in backward: eager replays its draws, a
    graph whose random operators ORT seeds per session would draw other noise, so that the
    gradient belonged to another sample than the output. Refused there, the call runs in
    PyTorch; the gradient is the one of the returned sample. Outside checkpointing the graph
    serves the call in ONNX Runtime."""
    from torch.utils.checkpoint import checkpoint

    patcher.patch(Reparameterised)
    torch.manual_seed(0)
    model = Reparameterised()
    x = torch.randn(16, 8)
    model(x).sum().backward()  # builds the graph, outside checkpointing
    assert _ort_calls(Reparameterised) == 1
    for _ in range(2):
        model.zero_grad()
        y = checkpoint(model, x, use_reentrant=False)
        h = model.fc(x).detach()
        noise = (y.detach() - h) / torch.exp(0.5 * h)  # the sample the output holds
        y.square().sum().backward()
        # d/dh of (h + exp(h/2) * noise)^2, through the linear layer's bias
        expected = (2 * y.detach() * (1 + 0.5 * torch.exp(0.5 * h) * noise)).sum(0)
        torch.testing.assert_close(model.fc.bias.grad, expected, rtol=1e-4, atol=1e-4)
    stats = report.stats_for(patcher.class_name(Reparameterised))
    assert _ort_calls(Reparameterised) == 1
    assert {r for r, _ in stats.fallbacks} == {"random operators a rerun cannot repeat"}
