"""Normalisations as operators of ours (`norms`): BatchNorm in train mode one each way,
LayerNorm's backward. The operators' kernels equal ATen's, a trace records one node where they
apply (and the decompositions elsewhere), and their ONNX translations run in ONNX Runtime to
eager's numbers at every rank the module takes, in float32 and float64."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch.engine.backends.ort import norms
from tests.plain_helpers import (
    PLAIN_READY,
    SKIP_REASON,
    PlainCall,
    steps_like_eager,
)

aten = torch.ops.aten
OURS = torch.ops.ort_autopatch
SHAPES = [(6, 4), (3, 4, 5), (2, 4, 5, 3), (2, 4, 3, 2, 3)]
DTYPES = [torch.float32, torch.float64]


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _gradients_equal(got: Sequence[Any], expected: Sequence[Any], mask: Sequence[bool]) -> None:
    """Each gradient asked for equals ATen's, in its type and shape; the others are None."""
    for asked, a, e in zip(mask, got, expected, strict=True):
        if not asked:
            assert a is None
            continue
        assert a is not None and a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "mask", [(True, True, True), (True, False, False), (True, True, False)], ids=str
)
def test_the_backward_equals_atens(
    shape: tuple[int, ...], dtype: torch.dtype, mask: tuple[bool, bool, bool]
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=dtype) * 3 + 1
    channels = shape[1]
    weight, bias = torch.randn(channels, dtype=dtype), torch.randn(channels, dtype=dtype)
    mean, var = torch.zeros(channels, dtype=dtype), torch.ones(channels, dtype=dtype)
    _, save_mean, save_rstd = aten.native_batch_norm(x, weight, bias, mean, var, True, 0.1, 1e-5)
    grad = torch.randn(shape, generator=gen, dtype=dtype)
    args = (grad, x, weight, mean, var, save_mean, save_rstd, True, 1e-5, list(mask))
    expected = aten.native_batch_norm_backward(*args)
    got = norms.native_batch_norm_backward(*args)
    _gradients_equal(got, expected, mask)


def test_the_operators_apply_to_whole_float_norms_of_static_sizes() -> None:
    x, c = torch.randn(2, 3, 4), torch.randn(3)
    assert norms.batch_norm_operators(x, c, c) == 8
    assert norms.batch_norm_operators(x.double(), c.double()) == 8
    assert norms.batch_norm_operators(x, None, c) is None  # affine=False
    assert norms.batch_norm_operators(x.bfloat16(), c, c) is None  # computed in float32
    assert norms.batch_norm_operators(x, c.double()) is None
    assert norms.batch_norm_operators(torch.randn(3), c) is None


def _three_steps_like_eager(
    model: nn.Module,
    eager: nn.Module,
    plain: PlainCall,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    laid: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> None:
    """`steps_like_eager` on inputs drawn at `shape` off a zero mean, then `laid` out."""
    steps_like_eager(model, eager, plain, lambda: laid(torch.randn(shape, dtype=dtype) * 3 + 1))


class _Normed(nn.Module):
    """A linear map over the channels, then BatchNorm: the BatchNorm's input requires grad
    (its gradient is the input's gradient's way back) and its parameters train."""

    def __init__(self, dims: int, dtype: torch.dtype, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.eye(4, dtype=dtype) + 0.1)
        norm = (nn.BatchNorm1d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 2]
        self.norm = norm(4, momentum=momentum, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.einsum("nc...,cd->nd...", x, self.mix))


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_batch_norm_trains_through_one_operator_each_way_to_eagers_numbers(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """The operators' translations in ONNX Runtime: outputs, gradients of the input, the
    weight and the bias, and the running statistics equal eager's over three steps."""
    torch.manual_seed(0)
    model = _Normed(len(shape), dtype)
    eager = copy.deepcopy(model)
    plain = PlainCall(model, torch.randn(shape, dtype=dtype, requires_grad=True))
    assert _targets(plain.captured.forward).count(OURS.batch_norm_training.default) == 1
    assert plain.captured.backward is not None
    backward = _targets(plain.captured.backward)
    assert backward.count(OURS.batch_norm_training_backward.default) == 1
    assert aten.rsqrt.default not in _targets(plain.captured.forward) + backward
    _three_steps_like_eager(model, eager, plain, shape, dtype)
    assert int(model.norm.num_batches_tracked) == 3


def _forward_operators(plain: PlainCall) -> list[str]:
    import onnx

    return [node.op_type for node in onnx.load_from_string(plain.lowered.forward).graph.node]


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_float32_batch_norm_forward_is_ort_s_kernel_a_float64_one_the_passes(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """On the CPU a float32 BatchNorm's forward is ONNX Runtime's `BatchNormalization` in
    training mode (its statistics made there, none by the graph's own passes); a float64
    one keeps the passes, which add the epsilon in float64. Numbers: the training test
    above, at every rank and both types."""
    torch.manual_seed(0)
    plain = PlainCall(_Normed(len(shape), dtype), torch.randn(shape, dtype=dtype))
    operators = _forward_operators(plain)
    if dtype == torch.float32:
        assert operators.count("BatchNormalization") == 1
        assert "ReduceMean" not in operators
    else:
        assert "BatchNormalization" not in operators
        assert operators.count("ReduceMean") == 2


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
def test_a_batch_whose_variance_overflows_leaves_the_next_calls_alone() -> None:
    """ORT's kernel writes its statistics over its running-statistics inputs: a batch whose
    variance is infinite must not reach the next call through them (zeros fed as constants
    held it: 0 * inf made the next batch's statistics NaN). The running variance itself goes
    to infinity, as eager's does."""
    torch.manual_seed(0)
    model = _Normed(4, torch.float32)
    eager = copy.deepcopy(model)
    shape = (2, 4, 5, 3)
    plain = PlainCall(model, torch.randn(shape, requires_grad=True))
    draws = iter([torch.randn(shape) * 1e20, torch.randn(shape), torch.randn(shape)])
    steps_like_eager(model, eager, plain, lambda: next(draws))
    assert torch.isinf(model.norm.running_var).all()


def test_only_a_float32_cpu_batch_norm_takes_ort_s_kernel() -> None:
    """CUDA's and ROCm's `BatchNormalization` refuse training mode at the opsets the
    exporter writes; float64 keeps the passes."""
    assert norms.one_kernel(torch.empty(2, 3))
    assert not norms.one_kernel(torch.empty(2, 3, dtype=torch.float64))
    assert not norms.one_kernel(torch.empty(2, 3, device="meta"))


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
def test_an_eval_mode_batch_norm_keeps_torchs_decomposition() -> None:
    """Eval mode normalises with the running statistics: torch's decomposition, no operator
    of ours."""
    torch.manual_seed(0)
    model = _Normed(4, torch.float32).eval()
    plain = PlainCall(model, torch.randn(2, 4, 3, 3, requires_grad=True))
    targets = _targets(plain.captured.forward)
    assert OURS.batch_norm_training.default not in targets
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(plain(x), model(x))


#: (input shape, normalised shape)
LAYER_NORMS = [((4, 6), (6,)), ((2, 3, 8), (8,)), ((2, 3, 4, 5), (4, 5)), ((2, 3, 8), (3, 8))]
MASKS = [(True, True, True), (True, False, False), (True, True, False), (False, True, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize(("shape", "normalized"), LAYER_NORMS, ids=str)
def test_the_layer_norm_backward_equals_atens(
    shape: tuple[int, ...],
    normalized: tuple[int, ...],
    mask: tuple[bool, bool, bool],
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=dtype) * 3 + 1
    weight = torch.randn(normalized, generator=gen, dtype=dtype)
    bias = torch.randn(normalized, generator=gen, dtype=dtype)
    _, mean, rstd = aten.native_layer_norm(x, list(normalized), weight, bias, 1e-5)
    grad = torch.randn(shape, generator=gen, dtype=dtype)
    args = (grad, x, list(normalized), mean, rstd, weight, bias, list(mask))
    expected = aten.native_layer_norm_backward(*args)
    got = norms.native_layer_norm_backward(*args)
    _gradients_equal(got, expected, mask)


class _LayerNormed(nn.Module):
    def __init__(self, normalized: tuple[int, ...], dtype: torch.dtype, frozen: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=dtype))
        self.norm = nn.LayerNorm(normalized, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-1, 1)
        self.norm.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x * self.scale)


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "normalized"), LAYER_NORMS, ids=str)
def test_a_layer_norm_trains_through_one_backward_operator_to_eagers_numbers(
    shape: tuple[int, ...], normalized: tuple[int, ...], dtype: torch.dtype, frozen: bool
) -> None:
    """The backward operator's translation in ONNX Runtime: the gradients of the input, of a
    parameter before the LayerNorm and of its own weight and bias (or none: a frozen
    LayerNorm, as LoRA fine-tuning leaves it) equal eager's over three steps."""
    torch.manual_seed(0)
    model = _LayerNormed(normalized, dtype, frozen)
    eager = copy.deepcopy(model)
    plain = PlainCall(model, torch.randn(shape, dtype=dtype, requires_grad=True))
    assert plain.captured.backward is not None
    backward = _targets(plain.captured.backward)
    assert backward.count(OURS.layer_norm_backward.default) == 1
    _three_steps_like_eager(model, eager, plain, shape, dtype)
    assert all(p.grad is None for p in model.norm.parameters()) == frozen


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
def test_a_channels_last_batch_norm_with_its_own_momentum_trains_to_eagers_numbers() -> None:
    """An input laid out channels last (as `model.to(memory_format=torch.channels_last)`
    feeds a CNN's BatchNorms) and a momentum other than the default."""
    torch.manual_seed(0)
    model = _Normed(4, torch.float32, momentum=0.5)
    eager = copy.deepcopy(model)
    channels_last = lambda x: x.contiguous(memory_format=torch.channels_last)  # noqa: E731
    shape = (2, 4, 5, 3)
    plain = PlainCall(model, channels_last(torch.randn(shape)).requires_grad_())
    assert _targets(plain.captured.forward).count(OURS.batch_norm_training.default) == 1
    _three_steps_like_eager(model, eager, plain, shape, torch.float32, channels_last)


@pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)
def test_a_layer_norm_of_a_transposed_input_trains_to_eagers_numbers() -> None:
    """A LayerNorm whose input is not contiguous (a transposed view, as sequence-first
    models pass it): the operator reads it laid out contiguously."""
    torch.manual_seed(0)
    model = _LayerNormed((8,), torch.float32, frozen=False)
    eager = copy.deepcopy(model)
    transposed = lambda x: x.transpose(0, 1)  # noqa: E731
    plain = PlainCall(model, transposed(torch.randn(3, 2, 8)).requires_grad_())
    assert plain.captured.backward is not None
    assert _targets(plain.captured.backward).count(OURS.layer_norm_backward.default) == 1
    _three_steps_like_eager(model, eager, plain, (3, 2, 8), torch.float32, transposed)
