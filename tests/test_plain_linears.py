"""`nn.Linear` as one operator of ours each way (`linears`): it applies where its translations
make what torchlib makes of ATen's composite, a trace records one node each way there (and
ATen's composite elsewhere), and the translations run in ONNX Runtime to eager's numbers at
every input rank, with and without bias, for every gradient autograd asks for."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch.engine.backends.ort import linears
from tests.plain_helpers import (
    PLAIN_READY,
    SKIP_REASON,
    asked_gradients_equal,
    trains_like_eager,
)

aten = torch.ops.aten
OURS = torch.ops.ort_autopatch
SHAPES = [(5, 8), (2, 5, 8), (2, 3, 4, 8)]


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_the_backward_equals_autograds(shape: tuple[int, ...], mask: tuple[bool, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    layer = nn.Linear(8, 6, dtype=torch.float64)
    grad = torch.randn(*shape[:-1], 6, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(layer(x), [x, layer.weight, layer.bias], grad)
    got = linears.linear_backward(grad, x.detach(), layer.weight.detach(), list(mask))
    asked_gradients_equal(got, expected, mask)


def test_the_operators_apply_to_float_matrices_of_static_sizes() -> None:
    x, w, b = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6)
    assert linears.applies(x, w, b)
    assert linears.applies(x, w, None)
    assert linears.applies(x.double(), w.double(), b.double())
    assert not linears.applies(x.bfloat16(), w.bfloat16(), b.bfloat16())  # as ATen computes
    assert not linears.applies(x, w.double(), b)
    assert not linears.applies(torch.randn(8), w, b)  # a vector: ATen's composite
    assert not linears.applies(torch.randn(0, 8), w, b)  # an empty batch: ATen's too


class _Linears(nn.Module):
    """A linear, ReLU, a second linear (bias or none): the second's input requires grad
    through the first."""

    def __init__(self, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16, dtype=dtype)
        self.second = nn.Linear(16, 6, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(nn.functional.relu(self.first(x)))


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", SHAPES)
def test_linears_train_through_one_operator_each_way_to_eagers_numbers(
    shape: tuple[int, ...], bias: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    plain = trains_like_eager(_Linears(dtype, bias), shape, dtype)
    forward = _targets(plain.captured.forward)
    backward = _targets(plain.captured.backward)
    assert forward.count(OURS.linear.default) == 2
    assert backward.count(OURS.linear_backward.default) == 2
    assert not {aten.addmm.default, aten.mm.default} & {*forward, *backward}


#: what each case freezes of `_Linears` (nothing: the input needs no gradient)
FROZEN = {
    "input": lambda m: [],
    "weight": lambda m: [m.first.weight],
    "bias": lambda m: [m.second.bias],
    "layer": lambda m: list(m.first.parameters()),
}


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("frozen", list(FROZEN))
def test_the_backward_computes_only_the_gradients_asked_for(frozen: str) -> None:
    """A frozen weight or bias (LoRA leaves the base weights frozen), a whole frozen layer
    and an input that needs no gradient: each gradient asked for equals eager's, the others
    stay None."""
    torch.manual_seed(0)
    model = _Linears(torch.float32, True)
    for p in FROZEN[frozen](model):
        p.requires_grad_(False)
    trains_like_eager(model, (2, 5, 8), torch.float32, grad_input=frozen != "input")


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize(
    "call",
    [
        lambda layer, x: layer(x[0]),  # a vector
        lambda layer, x: nn.functional.linear(x, layer.weight.t().contiguous().t(), layer.bias),
    ],
    ids=["vector", "transposed_weight"],
)
def test_other_linears_train_like_eager(call: Any) -> None:
    """A vector input keeps ATen's composite; a weight of other strides is the operator's
    (ONNX has no strides)."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return call(self.layer, x)

    trains_like_eager(Model(), (3, 8), torch.float32)
