"""Batched matrix products as one operator of ours each way (`matmuls`): it applies to two
tensors of one batch shape, a trace records one node each way there (and ATen's composite
elsewhere), and the translations run in ONNX Runtime to eager's numbers at every rank it
takes, for every gradient autograd asks for, a transposed view among the operands."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch.engine.backends.ort import matmuls
from tests.plain_helpers import (
    PLAIN_READY,
    SKIP_REASON,
    asked_gradients_equal,
    trains_like_eager,
)

aten = torch.ops.aten
OURS = torch.ops.ort_autopatch
#: batch shapes of the operands: ranks 3, 4 and 5
BATCHES = [(3,), (2, 3), (2, 1, 3)]


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True)])
def test_the_backward_equals_autograds(batch: tuple[int, ...], mask: tuple[bool, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(*batch, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(*batch, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(*batch, 4, 6, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(torch.matmul(a, b), [a, b], grad)
    got = matmuls.matmul_backward(grad, a.detach(), b.detach(), list(mask))
    asked_gradients_equal(got, expected, mask)


def test_the_operators_apply_to_float_batches_of_one_shape() -> None:
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6)
    assert matmuls.applies(a, b)
    assert matmuls.applies(a.double(), b.double())
    assert matmuls.applies(a, b.transpose(-2, -1).contiguous().transpose(-2, -1))  # strides
    assert not matmuls.applies(a.bfloat16(), b.bfloat16())  # as ATen computes
    assert not matmuls.applies(a, b.double())
    assert not matmuls.applies(a, torch.randn(1, 3, 5, 6))  # broadcast batch: ATen's
    assert not matmuls.applies(a, torch.randn(5, 6))  # a matrix: ATen's
    assert not matmuls.applies(a[0, 0], b[0, 0])  # matrices: ATen's `mm`
    assert not matmuls.applies(torch.randn(0, 3, 4, 5), torch.randn(0, 3, 5, 6))  # empty


class _Attention(nn.Module):
    """Attention's two products over heads (`q @ k^T`, a view transposed, then `@ v`), the
    operands made by linears, so each needs its gradient; `heads` None: no head dimension
    (rank 3)."""

    def __init__(self, dtype: torch.dtype, heads: int | None) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(8, 24, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.heads is not None:
            q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)).softmax(-1)
        return torch.matmul(scores, v)


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [None, 2], ids=["rank3", "rank4"])
def test_attention_products_train_through_one_operator_each_way_to_eagers_numbers(
    heads: int | None, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    plain = trains_like_eager(_Attention(dtype, heads), (2, 5, 8), dtype)
    forward = _targets(plain.captured.forward)
    backward = _targets(plain.captured.backward)
    assert forward.count(OURS.matmul.default) == 2
    assert backward.count(OURS.matmul_backward.default) == 2
    assert not {aten.bmm.default, aten.expand.default} & {*forward, *backward}


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("batch", BATCHES, ids=["rank3", "rank4", "rank5"])
def test_products_at_every_rank_train_like_eager(batch: tuple[int, ...]) -> None:
    """A parameter on the right, and the input on both sides of one product (`x @ x^T`,
    whose two gradients autograd adds), at each rank the operator takes."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(*batch, 8, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gram = torch.matmul(x, x.transpose(-2, -1))
            return torch.matmul(gram, torch.matmul(x, self.w))

    plain = trains_like_eager(Model(), (*batch, 4, 8), torch.float32)
    assert _targets(plain.captured.forward).count(OURS.matmul.default) == 3
    assert _targets(plain.captured.backward).count(OURS.matmul_backward.default) == 3


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
def test_a_product_whose_one_side_needs_no_gradient_trains_like_eager() -> None:
    """A constant side (a buffer) gets no gradient; the other's equals eager's."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.register_buffer("mix", torch.randn(2, 8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.matmul(self.proj(x), self.mix)

    trains_like_eager(Model(), (2, 5, 8), torch.float32, grad_input=False)


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize(
    "call",
    [
        lambda x, w: torch.matmul(x, w[0]),  # a matrix on the right
        lambda x, w: torch.matmul(x.unsqueeze(1), w.unsqueeze(0)),  # batches that broadcast
        lambda x, w: torch.matmul(x[0, 0], w[0]),  # a vector by a matrix
    ],
    ids=["matrix", "broadcast", "vector"],
)
def test_other_products_keep_atens_composite_and_train_like_eager(call: Any) -> None:
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 8, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return call(x, self.w)

    plain = trains_like_eager(Model(), (2, 5, 8), torch.float32)
    assert OURS.matmul.default not in _targets(plain.captured.forward)
