"""A convolution's backward as one operator of ours (`convolutions`): it applies where its
translation makes what the decomposition would, a trace records one node there (and the
decomposition elsewhere), and its ONNX translation runs in ONNX Runtime to eager's numbers at
one to three spatial dimensions, plain and transposed, at every stride, padding, dilation and
gradient mask it takes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch.engine.backends.ort import convolutions
from tests.plain_helpers import (
    PLAIN_READY,
    SKIP_REASON,
    PlainCall,
    ran_in_plain_ort,
    steps_like_eager,
)

aten = torch.ops.aten
OURS = torch.ops.ort_autopatch

#: the sides of an input at one to three spatial dimensions (16 positions or more: the one-hot
#: patches serve larger outputs alone)
SIDES = {1: (40,), 2: (9, 8), 3: (6, 5, 6)}


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _layer(dims: int, transposed: bool, *args: Any, **kwargs: Any) -> nn.Module:
    kinds = (
        (nn.Conv1d, nn.Conv2d, nn.Conv3d)
        if not transposed
        else (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
    )
    return kinds[dims - 1](*args, **kwargs)


def _translatable(layer: nn.Module, x: torch.Tensor, mask: list[bool]) -> bool:
    """`convolutions.translatable` for `layer` over `x`, as the trace asks it."""
    with torch.no_grad():
        y = layer(x)
    transposed = isinstance(layer, nn.modules.conv._ConvTransposeNd)
    return convolutions.translatable(
        y,
        x,
        layer.weight,
        list(layer.stride),
        list(layer.padding),
        list(layer.dilation),
        transposed,
        layer.groups,
        mask,
    )


def test_the_operator_applies_where_its_translation_makes_the_decompositions_nodes() -> None:
    x = torch.randn(2, 16, 7, 6)
    all_three = [True, True, True]
    assert _translatable(nn.Conv2d(16, 8, 1), x, all_three)  # the source itself
    assert _translatable(nn.Conv2d(16, 8, 3, padding=1), x, all_three)  # one-hot patches
    assert _translatable(nn.ConvTranspose2d(16, 8, 3, stride=2), x, all_three)
    # float64's patches are slices (ORT's CPU provider has no float64 Conv at all); so are
    # the patches of outputs under 16 positions
    assert not _translatable(nn.Conv2d(16, 8, 3).double(), x.double(), all_three)
    assert _translatable(nn.Conv2d(16, 8, 1).double(), x.double(), all_three)
    assert not _translatable(nn.Conv2d(16, 8, 3, stride=3), x, all_three)
    # several groups' weight gradients are the decomposition's; their inputs' are ours
    grouped = nn.Conv2d(16, 8, 3, groups=2)
    assert not _translatable(grouped, x, all_three)
    assert _translatable(grouped, x, [True, False, True])
    # an empty batch, and half precision (which computes as ATen does): the decomposition
    assert not _translatable(nn.Conv2d(16, 8, 1), x[:0], all_three)
    assert not _translatable(nn.Conv2d(16, 8, 1).bfloat16(), x.bfloat16(), all_three)


class _Convolved(nn.Module):
    """A linear map over the channels, then the convolution: the convolution's input
    requires grad (its gradient is the input's way back)."""

    def __init__(self, layer: nn.Module, channels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.eye(channels, dtype=dtype) + 0.1)
        self.layer = layer.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.einsum("nc...,cd->nd...", x, self.mix))


def _trains_like_eager(model: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> PlainCall:
    """`steps_like_eager` through a capture of `model`'s call at `shape`; the call, for
    its graphs."""
    eager = copy.deepcopy(model)
    plain = PlainCall(model, torch.randn(shape, dtype=dtype, requires_grad=True))
    assert plain.captured.backward is not None
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    steps_like_eager(model, eager, plain, lambda: torch.randn(shape, dtype=dtype), **tolerance)
    return plain


#: (transposed, kernel, stride, padding, dilation, output_padding): each translatable in
#: float32 with 16 input channels at every rank of `SIDES`
TRANSLATED = [
    (False, 1, 1, 0, 1, 0),  # pointwise: the source itself
    (False, 3, 1, 1, 1, 0),  # one-hot patches
    (False, 3, 2, 1, 1, 0),  # strided: positions no window reads (output_padding)
    (False, 2, 1, 2, 2, 0),  # dilated, wider than it is padded
    (True, 1, 1, 0, 1, 0),  # transposed pointwise
    (True, 3, 2, 1, 1, 1),  # transposed, strided, output padding
]


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("case", TRANSLATED, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_a_convolution_trains_through_one_backward_operator_to_eagers_numbers(
    dims: int, case: tuple, bias: bool
) -> None:
    transposed, kernel, stride, padding, dilation, output_padding = case
    extra = {"output_padding": output_padding} if transposed else {}
    torch.manual_seed(0)
    layer = _layer(
        dims, transposed, 16, 8, kernel, stride, padding, dilation=dilation, bias=bias, **extra
    )
    shape = (2, 16, *SIDES[dims])
    plain = _trains_like_eager(_Convolved(layer, 16, torch.float32), shape, torch.float32)
    backward = _targets(plain.captured.backward)
    assert backward.count(OURS.convolution_backward.default) == 1
    assert aten.convolution_backward.default not in backward


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize(
    "layer",
    [
        lambda: nn.Conv2d(4, 8, 5, padding=2),  # few channels, a wide kernel: slices
        lambda: nn.Conv2d(16, 8, 3, groups=4, padding=1),  # several groups
        lambda: nn.Conv2d(16, 8, 1, stride=2),  # a strided 1x1: slices
    ],
    ids=["narrow", "groups", "strided_pointwise"],
)
def test_a_convolution_the_operator_does_not_take_trains_through_the_decomposition(
    layer: Any,
) -> None:
    torch.manual_seed(0)
    conv = layer()
    channels = conv.in_channels
    model = _Convolved(conv, channels, torch.float32)
    plain = _trains_like_eager(model, (2, channels, 8, 8), torch.float32)
    assert OURS.convolution_backward.default not in _targets(plain.captured.backward)


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("frozen", ["weight", "bias", "input", "grouped_weight"])
def test_the_operator_computes_only_the_gradients_asked_for(frozen: str) -> None:
    """A frozen weight or bias (a fine-tuned CNN's first layers) and an input that needs no
    gradient (an image into the first convolution): each gradient asked for equals eager's,
    the others are never made. A frozen grouped convolution's input gradient, one grouped
    ConvTranspose, is the operator's too."""
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 8, 3, padding=1, groups=2 if frozen == "grouped_weight" else 1)
    model: nn.Module = _Convolved(conv, 16, torch.float32)
    if frozen == "input":
        model = conv  # no parameter before the convolution
    else:
        getattr(conv, frozen.removeprefix("grouped_")).requires_grad_(False)
    eager = copy.deepcopy(model)
    x = torch.randn(2, 16, 8, 8)
    example = x if frozen == "input" else x.clone().requires_grad_()
    plain = PlainCall(model, example)
    assert plain.captured.backward is not None
    assert _targets(plain.captured.backward).count(OURS.convolution_backward.default) == 1
    out, expected = plain(example), eager(example)
    assert ran_in_plain_ort(out)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        if not q.requires_grad:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=name)
