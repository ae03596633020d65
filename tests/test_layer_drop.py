"""LayerDrop (transformers' OPT, BART, Whisper): in training, forward skips a layer when a
fresh `torch.rand([])` falls below the drop probability. Both backends: with probability 0
the draw cannot change the branch, so every call runs in ONNX Runtime with eager's numbers;
above 0 eager skips layers at random, which a graph cannot, so PyTorch runs the calls with
the reason and the user's line."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tests.helpers import class_stats, patched

TOL = {"rtol": 1e-5, "atol": 1e-5}


class LayerDrop(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.p:
                    continue
            x = torch.tanh(layer(x))
        return self.head(x)


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched([LayerDrop])


def _train_beside_eager(model: nn.Module, steps: int) -> None:
    """Train `model` (patched) and an eager twin from the same torch seed: outputs and
    gradients equal step by step."""
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    batches = torch.randn(steps, 4, 8, generator=torch.Generator().manual_seed(1))
    for step, x in enumerate(batches):
        torch.manual_seed(step)  # eager draws its skips from torch's stream: the same draws
        out = model(x)
        torch.manual_seed(step)
        expected = LayerDrop.forward(twin, x)
        torch.testing.assert_close(out, expected, **TOL, msg=lambda m, k=step: f"step {k}: {m}")
        optimizer.zero_grad()
        twin_optimizer.zero_grad()
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL)
        optimizer.step()
        twin_optimizer.step()


def test_layer_drop_at_zero_trains_in_ort_with_eagers_numbers() -> None:
    torch.manual_seed(0)
    _train_beside_eager(LayerDrop(0.0).train(), steps=4)
    stats = class_stats(LayerDrop)
    assert stats.ort_calls == 4 and not stats.eager_calls and not stats.fallbacks
    assert stats.exports == 1


def test_layer_drop_above_zero_runs_in_pytorch_with_the_reason_and_line() -> None:
    torch.manual_seed(0)
    _train_beside_eager(LayerDrop(0.5).train(), steps=4)
    stats = class_stats(LayerDrop)
    assert stats.ort_calls == 0
    assert stats.eager_calls["fallback: data-dependent control flow"] == 4
    lines, start = inspect.getsourcelines(LayerDrop)
    offset = next(k for k, line in enumerate(lines) if "if dropout_probability <" in line)
    where = f"{inspect.getsourcefile(LayerDrop)}:{start + offset}"
    (detail,) = {d for r, d in stats.fallbacks if r == "data-dependent control flow"}
    assert where in detail


def test_layer_drop_in_eval_draws_nothing_and_runs_in_ort() -> None:
    torch.manual_seed(0)
    model = LayerDrop(0.5).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), LayerDrop.forward(copy.deepcopy(model), x), **TOL)
    stats = class_stats(LayerDrop)
    assert stats.ort_calls == 1 and not stats.eager_calls
