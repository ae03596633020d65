"""A convolution's backward as one operator of ours in the plain backend's traces
(`convolution_backward`), translated to the ONNX nodes its decomposition made.

torch has no decomposition of `aten.convolution_backward`; ours (`windows`) computes the
input's gradient as the adjoint convolution and the weight's as a matrix product with the
input's patches, in five to fifteen operators, each traced on fake tensors through aot's
functionalization, partitioned and translated one by one. ResNet-50's 53 convolutions' were a
quarter of its trace. Here each is one node whose translation (`TRANSLATIONS`) adds the same
ONNX nodes the decomposition's operators were translated to, in the same order: a
`ConvTranspose` (a `Conv` for a transposed convolution) for the input; for the weight, the
source itself (a 1x1 convolution reading every position) or its patches from one `Conv` with
one-hot kernels, times the other activation, per image and summed or at once
(`windows.contracts_per_image`); a `ReduceSum` for the bias.

The operator applies where its translation makes what the decomposition would
(`translatable`): float32 or float64, static sizes, one to three spatial dimensions, and a
weight gradient (where one is asked for) of one group taken from the source itself or from
the one-hot convolution. Elsewhere (several groups, slices of the patches, symbolic sizes,
half precision) the decomposition runs as before. The operator's eager kernel is the
decomposition, so a translation can be held to it (tests) and a graph run in torch runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE as NAMESPACE
from ort_autopatch.engine.backends.ort import windows
from ort_autopatch.engine.backends.ort.declared import Declared, declarable

aten = torch.ops.aten


@torch.library.custom_op(f"{NAMESPACE}::convolution_backward", mutates_args=())
def convolution_backward_operator(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    groups: int,
    asked: Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of a convolution's input, weight and bias (`asked`: which; the others
    empty), as the decomposition computes them."""
    dims = input.dim() - 2
    grads = windows.convolution_backward(
        grad_output,
        input,
        weight,
        None,
        stride,
        padding,
        dilation,
        transposed,
        [0] * dims,
        groups,
        asked,
    )
    return tuple(  # type: ignore[return-value]
        input.new_empty(0) if g is None else g.contiguous() for g in grads
    )


@convolution_backward_operator.register_fake
def _(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    groups: int,
    asked: Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shapes = (input.shape, weight.shape, (grad_output.shape[1],))
    return tuple(  # type: ignore[return-value]
        input.new_empty(shape if a else (0,)) for a, shape in zip(asked, shapes, strict=True)
    )


def translatable(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    groups: int,
    output_mask: Sequence[bool],
) -> bool:
    """Whether the operator's translation makes what the decomposition would here (see the
    module's docstring)."""
    if input.dim() != weight.dim() or not 3 <= input.dim() <= 5:
        return False
    if not declarable(grad_output, input, weight):
        return False
    kernel = list(weight.shape[2:])
    if output_mask[0] and not transposed:
        extra = windows.unreached(input, grad_output, kernel, stride, padding, dilation)
        if any(e < 0 for e in extra):
            return False
    if output_mask[1]:
        if groups != 1:
            return False
        source, target = (grad_output, input) if transposed else (input, grad_output)
        outer = list(target.shape[2:])
        if not windows.pointwise(kernel, stride, padding) and not windows.convolves_patches(
            source, outer, kernel, stride, padding, dilation
        ):
            return False
    return True


def convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`aten.convolution_backward` for the trace: the operator where it is translatable,
    else the decomposition."""
    dims = input.dim() - 2
    stride, padding, dilation = (windows.spatial(v, dims) for v in (stride, padding, dilation))
    mask = [bool(m) for m in output_mask]
    args = (stride, padding, dilation, transposed, groups)
    if not translatable(grad_output, input, weight, *args, mask):
        return windows.convolution_backward(
            grad_output, input, weight, bias_sizes, *args[:4], output_padding, groups, mask
        )
    grads = torch.ops.ort_autopatch.convolution_backward(grad_output, input, weight, *args, mask)
    return tuple(g if m else None for g, m in zip(grads, mask, strict=True))  # type: ignore[return-value]


def lower_convolution_backward(
    grad_output: Any,
    input: Any,
    weight: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    groups: int,
    asked: Sequence[bool],
) -> Any:
    from onnxscript import opset18 as op

    d, w, g = Declared(input), Declared(weight), Declared(grad_output)
    kernel = w.sizes[2:]
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    pads = padding * 2
    if not asked[0]:
        grad_input = d.empty()
    elif transposed:  # the adjoint of a transposed convolution is a convolution
        conv = op.Conv(
            grad_output,
            weight,
            strides=stride,
            pads=pads,
            group=groups,
            dilations=dilation,
            kernel_shape=kernel,
        )
        grad_input = d.shaped(d.sizes)(conv)
    else:
        extra = windows.unreached(input, grad_output, kernel, stride, padding, dilation)
        adjoint = op.ConvTranspose(
            grad_output,
            weight,
            strides=stride,
            pads=pads,
            group=groups,
            dilations=dilation,
            output_padding=extra,
            kernel_shape=kernel,
        )
        grad_input = d.shaped(d.sizes)(adjoint)
    if asked[1]:
        source, target = (grad_output, input) if transposed else (input, grad_output)
        grad_weight = _lower_weight_gradient(source, target, w, stride, padding, dilation)
    else:
        grad_weight = d.empty()
    if asked[2]:
        axes: Any = op.Constant(value_ints=[0, *range(2, g.rank)])
        grad_bias = g.shaped([g.sizes[1]])(op.ReduceSum(grad_output, axes, keepdims=0))
    else:
        grad_bias = d.empty()
    return grad_input, grad_weight, grad_bias


def _lower_weight_gradient(
    source: Any,
    target: Any,
    w: Declared,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> Any:
    """`windows._weight_gradient` of one group, from the source itself or its patches by
    one-hot kernels (`translatable` admits no other)."""
    from onnxscript import opset18 as op

    s, t = Declared(source), Declared(target)
    kernel = w.sizes[2:]
    batch, channels = s.sizes[:2]
    out_channels, outer = t.sizes[1], t.sizes[2:]
    positions = math.prod(outer)
    rows = s.reshaped(target, [batch, out_channels, positions])
    if windows.pointwise(kernel, stride, padding):
        cols = s.reshaped(source, [batch, channels, positions])
        width = channels
    else:
        count = math.prod(kernel)
        one_hot = windows.one_hot_kernels(channels, kernel, torch.float64).numpy()
        patches = op.Conv(
            source,
            s.array(one_hot),
            strides=stride,
            pads=padding * 2,
            group=channels,
            dilations=dilation,
            kernel_shape=kernel,
        )
        patches = s.shaped([batch, channels * count, *outer])(patches)
        width = channels * count
        cols = s.reshaped(patches, [batch, width, positions])
    grad = _lower_contracted(rows, cols, s, batch, out_channels, width, positions)
    return w.reshaped(grad, w.sizes)


def _lower_contracted(
    rows: Any, cols: Any, s: Declared, batch: int, m: int, n: int, positions: int
) -> Any:
    """`windows._contracted`: rows (batch, m, positions) times cols (batch, n, positions)
    summed over batch and positions, (m, n)."""
    from onnxscript import opset18 as op

    if windows.contracts_per_image(n, positions):
        cols_t = s.shaped([batch, positions, n])(op.Transpose(cols, perm=[0, 2, 1]))
        products = s.shaped([batch, m, n])(op.MatMul(rows, cols_t))
        first: Any = op.Constant(value_ints=[0])
        return s.shaped([m, n])(op.ReduceSum(products, first, keepdims=0))
    flat_rows = s.shaped([m, batch, positions])(op.Transpose(rows, perm=[1, 0, 2]))
    flat_cols = s.shaped([n, batch, positions])(op.Transpose(cols, perm=[1, 0, 2]))
    flat_rows = s.reshaped(flat_rows, [m, batch * positions])
    flat_cols = s.reshaped(flat_cols, [n, batch * positions])
    cols_t = s.shaped([batch * positions, n])(op.Transpose(flat_cols, perm=[1, 0]))
    return s.shaped([m, n])(op.MatMul(flat_rows, cols_t))


#: our operator and its ONNX translation (`lowering.registry_for`)
TRANSLATIONS: dict[Any, Any] = {
    torch.ops.ort_autopatch.convolution_backward.default: lower_convolution_backward,
}
