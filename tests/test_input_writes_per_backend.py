"""Forward writing into its inputs, and outputs sharing memory with an input or a parameter,
under the default fallback policy: every call equals eager (outputs, the caller's tensors,
gradients) and runs where its backend says. The plain backend applies the writes and returns
the views in ONNX Runtime; the training build, whose graph takes inputs by value and returns
fresh tensors, refuses such a call at its export (a copy would leave a value other than
eager's in the caller's tensor, or a stale view), so it runs in PyTorch with that reason.
The suite runs once per backend.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from ort_autopatch import patcher
from ort_autopatch.engine.errors import InputWriteError, OutputAliasError
from tests.helpers import assert_tree_close, class_stats, patched, plain_backend

TOL = {"rtol": 1e-5, "atol": 1e-6}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)


class IndexFillIntoInput(_Net):
    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        x.index_fill_(1, index, 0.0)
        return self.fc(x)


class AddIntoInput(_Net):
    """Not idempotent: a trace that wrote the caller's tensor before eager runs the call
    would leave it written twice."""

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return self.fc(x)


class ScatterIntoInput(_Net):
    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        x.scatter_(1, index.view(1, 1).expand(3, 1), self.fc.bias[:1].expand(3, 1) * 2)
        return self.fc(x).sum(1)


class TransposeOfInput(_Net):
    def forward(self, x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fc(x), x.T


class ViewOfAParameter(_Net):
    def forward(self, x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fc(x), self.fc.weight.T


class InputItself(_Net):
    def forward(self, x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fc(x), x


WRITES = (IndexFillIntoInput, AddIntoInput, ScatterIntoInput)
ALIASES = (TransposeOfInput, ViewOfAParameter, InputItself)


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched((*WRITES, *ALIASES), patcher.Settings())  # the default fallback


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("cls", [*WRITES, *ALIASES], ids=lambda c: c.__name__)
def test_each_call_equals_eager_and_runs_where_its_backend_says(cls: type, grad: bool) -> None:
    calls = 3
    torch.manual_seed(0)
    model = cls()
    twin = copy.deepcopy(model)
    forward = type(model).forward
    for k in range(calls):
        g = torch.Generator().manual_seed(k)
        a = torch.randn(3, 3, generator=g)
        index = torch.tensor([k % 3])
        ours = a.clone().requires_grad_(grad)
        theirs = a.clone().requires_grad_(grad)
        model.zero_grad()
        twin.zero_grad()
        with torch.set_grad_enabled(grad):
            x, y = ours * 1.5, theirs * 1.5  # not leaves: eager lets forward write them
            version = x._version
            got = model(x, index)
            want = forward(twin, y, index)
        assert_tree_close(got, want, f"call {k} output", **TOL)
        torch.testing.assert_close(x, y, **TOL, msg=lambda m, k=k: f"call {k}, input: {m}")
        if cls in WRITES:
            assert x._version > version, f"call {k}: the write did not bump the version"
        if grad:
            sum(t.square().sum() for t in pytree.tree_leaves(got)).backward()  # type: ignore[union-attr]
            sum(t.square().sum() for t in pytree.tree_leaves(want)).backward()  # type: ignore[union-attr]
            torch.testing.assert_close(ours.grad, theirs.grad, **TOL)
            for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    stats = class_stats(cls)
    if plain_backend():
        assert stats.ort_calls == calls and not stats.eager_calls, (
            stats.ort_calls,
            stats.fallbacks,
        )
        return
    error = InputWriteError if cls in WRITES else OutputAliasError
    assert stats.ort_calls == 0
    assert sum(stats.eager_calls.values()) == calls, stats.eager_calls
    assert {reason for reason, _ in stats.fallbacks} == {error.reason}, stats.fallbacks
    cause = "writes into its input" if cls in WRITES else "shares memory with"
    assert all(cause in detail for _, detail in stats.fallbacks), stats.fallbacks
