"""ReLU's and LeakyReLU's gradients as one operator of ours each (`activations`): the
operators' kernels equal ATen's, they apply where the translation declares every value (the
decompositions elsewhere), a trace records one node where they apply, with the layout the
decomposition gave, and their ONNX translations run in ONNX Runtime to eager's numbers at
every rank, in place or not, in float32 and float64. An activation nothing else in backward
reads is saved as its one-byte mask."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from ort_autopatch.engine.backends.ort import activations
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, trains_like_eager

aten = torch.ops.aten
OURS = torch.ops.ort_autopatch
#: every rank an elementwise activation takes, 0 to 5
SHAPES = [(), (7,), (3, 5), (2, 3, 4), (2, 3, 4, 5), (1, 2, 3, 2, 2)]
DTYPES = [torch.float32, torch.float64]


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _with_edges(shape: tuple[int, ...], dtype: torch.dtype, at: float) -> tuple[torch.Tensor, ...]:
    """An input with a value at the threshold and a NaN, a gradient with infinities."""
    torch.manual_seed(0)
    x, g = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    if x.numel() > 3:
        x.view(-1)[0] = at  # the boundary counts as below, as in ATen
        x.view(-1)[1] = float("nan")
        g.view(-1)[2] = float("inf")
        g.view(-1)[3] = -float("inf")
    return x, g


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("threshold", [0.0, 0.5, -1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_relus_gradient_equals_atens_for_finite_gradients(
    shape: tuple[int, ...], threshold: float, dtype: torch.dtype
) -> None:
    """Where the gradient is finite, a NaN input's included (it passes its gradient: NaN is
    not at most the threshold), to the bit. Both the operator's kernel and the table's
    entry, at every rank."""
    x, g = _with_edges(shape, dtype, threshold)
    g = g.nan_to_num(posinf=2.0, neginf=-2.0)
    expected = aten.threshold_backward(g, x, threshold)
    for got in (
        OURS.threshold_backward(g, x, threshold),
        activations.threshold_backward(g, x, threshold),
    ):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("slope", [0.2, 0.01, 1e-3, 3.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_leaky_relus_gradient_equals_atens_bit_for_bit(
    shape: tuple[int, ...], slope: float, dtype: torch.dtype
) -> None:
    """Zeros, NaN inputs and infinite gradients included: the factor is 1 or the slope
    exactly, so the result is ATen's to the bit."""
    x, g = _with_edges(shape, dtype, 0.0)
    for self_is_result in (False, True):
        expected = aten.leaky_relu_backward(g, x, slope, self_is_result)
        for got in (
            OURS.leaky_relu_backward(g, x, slope),
            activations.leaky_relu_backward(g, x, slope, self_is_result),
        ):
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_the_operators_apply_where_every_value_can_be_declared() -> None:
    x = torch.randn(2, 3, 4, 5)
    assert activations.applies(x, x)
    assert activations.applies(x.double(), x.double())
    assert activations.applies(torch.randn(()), torch.randn(()))  # a scalar
    channels_last = x.contiguous(memory_format=torch.channels_last)
    assert activations.applies(channels_last, channels_last)
    assert activations.applies(x, channels_last)  # layouts are the fake kernels' concern
    assert not activations.applies(x.bfloat16(), x.bfloat16())  # as ATen computes
    assert not activations.applies(x, x.double())
    assert not activations.applies(x, x[:1])
    assert not activations.applies(torch.randn(0, 3), torch.randn(0, 3))  # empty


@pytest.mark.parametrize(
    ("entry", "ours", "extra"),
    [
        (activations.threshold_backward, OURS.threshold_backward.default, (0.0,)),
        (activations.leaky_relu_backward, OURS.leaky_relu_backward.default, (0.1, False)),
    ],
    ids=["relu", "leaky_relu"],
)
def test_a_trace_records_one_node_where_the_operator_applies(
    entry: Callable[..., torch.Tensor], ours: object, extra: tuple[object, ...]
) -> None:
    x = torch.randn(2, 3, 4, 5)

    def traced(g: torch.Tensor, s: torch.Tensor) -> list[object]:
        return _targets(make_fx(lambda g, s: entry(g, s, *extra))(g, s))

    assert traced(x, x) == [ours]
    elsewhere = traced(x.bfloat16(), x.bfloat16())  # the decomposition, in ATen operators
    assert ours not in elsewhere and aten.mul.Tensor in elsewhere


def _called(entry: Callable[..., torch.Tensor], g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return entry(g, s, 0.0)


def _leaky_decomposed(g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The table's decomposition before the operator (slope 0)."""
    positive = (s > 0).to(g.dtype)
    return g * (positive + (1 - positive) * 0.0)


@pytest.mark.parametrize(
    ("entry", "decomposed"),
    [
        (activations.threshold_backward, lambda g, s: g * (~(s <= 0.0)).to(g.dtype)),
        (OURS.threshold_backward, lambda g, s: g * (~(s <= 0.0)).to(g.dtype)),
        (OURS.leaky_relu_backward, _leaky_decomposed),
    ],
    ids=["relu_entry", "relu", "leaky_relu"],
)
def test_the_operators_value_has_the_decompositions_layout(
    entry: Callable[..., torch.Tensor], decomposed: Callable[..., torch.Tensor]
) -> None:
    """What the trace records of the value (its strides) is what the table's decomposition
    gave before the operator, in every pairing of layouts, broadcast gradients among
    them."""
    x = torch.randn(2, 3, 4, 5)
    channels_last = x.contiguous(memory_format=torch.channels_last)
    expanded = torch.randn(1, 3, 1, 5).expand(2, 3, 4, 5)
    permuted = torch.randn(2, 4, 3, 5).transpose(1, 2)  # dense, neither of the two layouts
    pairs = [
        (x, x),
        (x, channels_last),
        (channels_last, x),
        (channels_last, channels_last),
        (expanded, x),
        (expanded, channels_last),
        (permuted, permuted),
        (permuted, x),
    ]

    def traced_strides(function: Callable[..., torch.Tensor], *args: torch.Tensor) -> object:
        graph = make_fx(function, tracing_mode="fake")(*args).graph
        return next(n for n in graph.nodes if n.op == "output").args[0].meta["val"].stride()

    for g, s in pairs:
        expected = traced_strides(decomposed, g, s)
        ours = traced_strides(functools.partial(_called, entry), g, s)
        assert ours == expected, (g.stride(), s.stride())


class _Activated(nn.Module):
    """A per-position scale (so a weight's gradient passes through the activation's), the
    activation, then a per-position gain (whose gradient reads the activation too) or a
    constant factor (the activation is then read by its own gradient alone)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        act: Callable[..., torch.Tensor],
        gain: bool = True,
    ) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(shape, dtype=dtype))
        self.gain = nn.Parameter(torch.randn(shape, dtype=dtype)) if gain else None
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x * self.scale) * (2 if self.gain is None else self.gain)


def _saved(plain: object) -> list[torch.Tensor]:
    """The values forward saves for backward (backward's inputs that are forward's outputs)."""
    captured = plain.captured  # type: ignore[attr-defined]
    placeholders = [n for n in captured.backward.graph.nodes if n.op == "placeholder"]
    reads = zip(placeholders, captured.backward_inputs, strict=True)
    return [node.meta["val"] for node, (kind, _) in reads if kind == "out"]


def _forward_output_makers(plain: object) -> list[str]:
    """The ONNX operator that makes each of forward's outputs."""
    import onnx

    forward = onnx.load_from_string(plain.lowered.forward).graph  # type: ignore[attr-defined]
    made_by = {out: node.op_type for node in forward.node for out in node.output}
    return [made_by.get(value.name, "input") for value in forward.output]


ACTIVATIONS: dict[str, tuple[Callable[..., torch.Tensor], object]] = {
    "relu": (F.relu, OURS.threshold_backward.default),
    "relu_inplace": (nn.ReLU(inplace=True), OURS.threshold_backward.default),
    "threshold": (lambda x: F.threshold(x, 0.3, -1.0), OURS.threshold_backward.default),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), OURS.leaky_relu_backward.default),
    "leaky_relu_inplace": (nn.LeakyReLU(0.05, inplace=True), OURS.leaky_relu_backward.default),
}


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activations_train_through_one_operator_to_eagers_numbers(
    name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """The activation read by a gain's gradient too: saved once, read by our operator."""
    act, ours = ACTIVATIONS[name]
    torch.manual_seed(0)
    plain = trains_like_eager(_Activated(shape, dtype, act), shape, dtype)
    assert _targets(plain.captured.backward).count(ours) == 1
    assert not plain.lowered.splits  # every node translated: no torch node cuts the graph


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_an_activation_read_by_its_gradient_alone_is_saved_as_its_mask(
    name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """One byte an element, as the partitioner saved the ATen operators' mask: forward
    saves the boolean mask, not the activation in float, and backward applies it."""
    act, ours = ACTIVATIONS[name]
    torch.manual_seed(0)
    plain = trains_like_eager(_Activated(shape, dtype, act, gain=False), shape, dtype)
    assert ours not in _targets(plain.captured.backward)
    assert not plain.lowered.splits  # every node translated: no torch node cuts the graph
    saved = [(v.shape, v.dtype) for v in _saved(plain)]
    # the mask, and the input and the scale (their product's gradients read them)
    assert sorted(saved, key=str) == sorted([(shape, torch.bool), *[(shape, dtype)] * 2], key=str)


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
def test_a_cnns_relus_train_through_the_operator_channels_last_too() -> None:
    """Convolution, BatchNorm and an in-place ReLU as torchvision's blocks have them, the
    input channels last: the first ReLU's output, a convolution's input, is saved once (not
    beside autograd's detach of it) and its gradient is our operator; the last one's output
    is read by its gradient alone, and saved as its mask."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 4, 3),
        nn.ReLU(),
    ).to(memory_format=torch.channels_last)
    plain = trains_like_eager(model, (2, 3, 8, 8), torch.float32)
    assert _targets(plain.captured.backward).count(OURS.threshold_backward.default) == 1
    assert "Identity" not in _forward_output_makers(plain)  # no copy of the activation
    assert [v.dtype for v in _saved(plain) if v.shape == (2, 4, 6, 6)] == [torch.bool]


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("name", ["threshold", "leaky_relu"])
def test_an_activation_of_the_input_itself_is_saved_as_its_mask(name: str) -> None:
    """`F.threshold` and LeakyReLU save their input: where that is the call's input, the
    mask is made among forward's first nodes, from the input, and trains like eager."""
    act, ours = ACTIVATIONS[name]
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return act(x) * 2 + self.bias

    plain = trains_like_eager(Model(), (3, 5), torch.float32)
    assert ours not in _targets(plain.captured.backward)
    assert not plain.lowered.splits
    assert [(v.shape, v.dtype) for v in _saved(plain)] == [((3, 5), torch.bool)]
