"""The one decomposition table of the plain backend: which ATen operators are rewritten, at
trace time, into operators the ONNX exporter translates faithfully.

ONNX's op library (onnxscript's torchlib) has no backward operators, so every backward
operator in a joint graph must be decomposed. The base is the exporter's own choice (each
operator torchlib lacks gets torch's decomposition); on top of it, declared here once:

- `_native_batch_norm_legit_functional`: torchlib's translation hard-codes training off, so a
  BatchNorm in train mode would silently normalise with the running statistics. Decomposed
  (ours: in fewer passes over the input than torch's).
- `nll_loss_forward`: torchlib's translation returns a total weight of 1 where ATen returns
  the number of counted targets (the backward divides by it): with the mean reduction every
  gradient came out batch-size times too large, again without an error. Decomposed.
- `convolution_backward`: torch has no decomposition; ours below covers every stride,
  padding, dilation, groups and transposed convolution (1-d to 3-d). The weight's gradient is
  a matrix product with the input's patches, not a convolution (which ORT ran slowly).
- `max_pool2d_with_indices` and its backward, for pools whose windows tile the input: an
  elementwise maximum over the windows' strided slices, with no indices (ORT's MaxPool with
  indices is nine times slower than without), no scatter and no small trailing window axis.
- `threshold_backward` (ReLU's) and `leaky_relu_backward`: a product with the mask instead of
  ORT's slow `Where` (ten times a Greater, a Cast and a Mul on a CNN's activations).
- `select_backward` and `slice_backward`: as pads rather than torch's scatters into zeros,
  which ORT runs as ScatterElements (a quarter of a transformer layer's step).
- `avg_pool2d_backward`, `avg_pool3d_backward` (every padding, divisor and ceil mode, as a
  transposed convolution with a kernel of ones) and `_adaptive_avg_pool2d_backward` (the
  cases an average pool is a convolution with a constant kernel; other adaptive sizes as one
  matrix product per dimension with the windows' weights): torch has none either.
  `_adaptive_avg_pool3d` and its backward the same way (torchlib has no 3-d adaptive pool).
- `avg_pool2d` and `avg_pool3d` with `divisor_override`: torchlib's translation ignores the
  override (its results were off by the window's size over the divisor). Each window's sum
  over the divisor; other average pools keep the exporter's AveragePool.
- `max_pool3d_with_indices_backward` (neither torch nor torchlib has one): a scatter-add of
  each window's gradient at its index.
- Transposed convolutions in these backwards whose `output_padding` depends on symbolic
  sizes: ONNX takes it as a constant attribute, so they are computed whole, padded and cut
  (`_transposed`); every convolution's backward had been traced once per input shape.
- `max_pool1d` (`BEFORE_AUTOGRAD`): ATen's composite pools over the sizes as plain integers
  for the untracked tensors of a trace, fixing the length; ours is the 2-d pool over a
  height of one.
- pooling, normalisation, embedding, dropout and loss backwards: torch's decompositions,
  named so the tests can hold each one to eager.
- `bernoulli.p` (feature dropout's mask: `dropout1d/2d/3d`, `Dropout2d` on any rank):
  torchlib's translation draws from `RandomUniformLike` inside a local function, whose
  generator ORT seeds once per session: unseen by the tool's seeding and by the first-call
  check (which then compared a random mask with eager's and refused every such graph), and
  drawing another mask where a graph is run again with the forward's seed. Ours is the mask
  of an ONNX `Dropout` over ones, drawn per run from the tool's stream like `nn.Dropout`'s.
- `uniform` (`Tensor.uniform_`) and `rrelu_with_noise_functional` (`nn.RReLU` in training):
  torch's decompositions end in `prims.uniform`, which nothing translates; ours draw with
  `rand_like` (ONNX `RandomUniformLike`, seeded per session as a user's `rand_like` is).
- `adaptive_avg_pool2d` (`BEFORE_AUTOGRAD`): ATen's composite kernel, for an output of 1x1
  over a channels-last input, re-strides the mean it computes in place (`as_strided_`, a
  change of strides alone: every size-1 layout is both contiguous and channels-last), and
  autograd differentiates that as any `as_strided`, by scattering into a zero storage
  (`prims.as_strided_scatter`, which ONNX cannot express: convnext and swin_t failed on it).
  Ours is the same mean without the re-striding.
- `_scaled_dot_product_flash_attention_for_cpu` and its backward (torch has no backward):
  attention is traced with the kernel eager picks, and the flash kernel's backward is not the
  softmax's (see its docstring): tracing every attention with the math kernel instead gave
  BERT with padding masks gradients 0.35 % off eager's. Ours compute what the kernel computes
  (equal to ATen's in float32 and float64 at every mask, causal, GQA and layout it takes; OPT's
  zoo entry, once 3.4x off, had been held to a reference run on the math kernel: issue 35).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten

#: torch's own decompositions this backend relies on, declared so each has a test.
TORCH_DECOMPOSED = (
    aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default,
    aten.native_batch_norm_backward.default,
    aten.embedding_dense_backward.default,
    aten.native_layer_norm_backward.default,
    aten.native_group_norm_backward.default,
    aten.native_dropout_backward.default,
    aten.nll_loss_backward.default,
    aten.nll_loss2d_backward.default,
    aten._log_softmax_backward_data.default,
    aten._softmax_backward_data.default,
    aten.mse_loss_backward.default,
    aten.binary_cross_entropy_backward.default,
    aten.smooth_l1_loss_backward.default,
    aten.gelu_backward.default,
    aten.tanh_backward.default,
    aten.sigmoid_backward.default,
    aten.silu_backward.default,
)


#: operators the exporter's table decomposes that a trace must keep: `lift` and `lift_fresh`
#: turn a constant made in forward (`torch.tensor(1.0)`) into the trace's fake tensor, and
#: their decomposition (an alias of the real tensor) fails the trace.
KEPT = (aten.lift.default, aten.lift_fresh.default)


def _spatial(values: Sequence[int], dims: int) -> list[int]:
    return list(values) * dims if len(values) == 1 else list(values)


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
    """`aten.convolution_backward` as convolutions (ONNX Conv / ConvTranspose) and a sum.

    The input's gradient is the adjoint convolution (a transposed one for a convolution, a
    plain one for a transposed convolution). The weight's gradient correlates input and
    output gradient with batch and channel swapped, stride and dilation exchanging roles,
    one group per convolution group; trailing positions no window reached are cut off.
    """
    dims = input.dim() - 2
    stride, padding, dilation = (_spatial(v, dims) for v in (stride, padding, dilation))
    kernel = list(weight.shape[2:])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = aten.convolution(
                grad_output, weight, None, stride, padding, dilation, False, [0] * dims, groups
            )
        else:
            extra = [
                input.shape[2 + d]
                - (
                    (grad_output.shape[2 + d] - 1) * stride[d]
                    - 2 * padding[d]
                    + dilation[d] * (kernel[d] - 1)
                    + 1
                )
                for d in range(dims)
            ]
            grad_input = _transposed(grad_output, weight, stride, padding, dilation, groups, extra)
    if output_mask[1]:
        # transposed: the weight's gradient of the adjoint, with the two activations swapped
        source, target = (grad_output, input) if transposed else (input, grad_output)
        grad_weight = _weight_gradient(source, target, kernel, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


def _transposed(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    extra: list[Any],
) -> torch.Tensor:
    """A transposed convolution whose output has `extra` more trailing positions than its
    windows reach (a convolution's input positions no window read: their gradient).

    ONNX's ConvTranspose takes that as its `output_padding` attribute, a constant: with
    symbolic sizes `extra` is an expression of them and the translation failed, so every
    convolution's backward (and average pool's) was traced once per input shape. Then the
    full transposed convolution (no padding) is padded by `extra` zeros at the end and the
    `padding` positions cut from both sides: the same values (the positions past the last
    window get nothing but zeros), with sizes that stay symbolic."""
    dims = len(stride)
    if all(isinstance(e, int) and e >= 0 for e in extra):
        return aten.convolution(x, weight, None, stride, padding, dilation, True, extra, groups)
    full = aten.convolution(x, weight, None, stride, [0] * dims, dilation, True, [0] * dims, groups)
    pads: list[Any] = []
    for d in reversed(range(dims)):
        pads += [0, extra[d]]
    full = aten.constant_pad_nd(full, pads, 0.0)
    for d in range(dims):
        if padding[d]:
            full = aten.slice(full, 2 + d, padding[d], full.shape[2 + d] - padding[d])
    return full


def _weight_gradient(
    source: torch.Tensor,
    target: torch.Tensor,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    """d(conv(source, w)) / dw contracted with `target`: shape (target channels,
    source channels / groups, *kernel).

    As a matrix product with the source's patches (one strided slice of the padded source per
    kernel position): grad_w[o, i, k] = sum over batch and positions p of target[o, p] *
    patch_k[i, p]. Written as a convolution whose kernel is the whole target instead, ORT ran
    it 2 to 5 times slower than this (0.3 to 0.8 ms against 0.12 for a 3x3 convolution's
    weight on (8, 3, 32, 32)), slower than eager's whole convolution backward.
    """
    dims = source.dim() - 2
    batch, channels = source.shape[0], source.shape[1]
    out_channels = target.shape[1]
    outer = list(target.shape[2:])
    pads: list[int] = []
    for d in reversed(range(dims)):
        pads += [padding[d], padding[d]]
    padded = aten.constant_pad_nd(source, pads, 0.0) if any(padding) else source
    # slices by leading kernel offsets, each taken once (a 3x3 kernel: 3 + 9 slices, not 18)
    sliced: dict[tuple[int, ...], torch.Tensor] = {(): padded}
    for offsets in itertools.product(*(range(k) for k in kernel)):
        for d in range(dims):
            if offsets[: d + 1] not in sliced:
                start = offsets[d] * dilation[d]
                end = start + (outer[d] - 1) * stride[d] + 1
                sliced[offsets[: d + 1]] = aten.slice(
                    sliced[offsets[:d]], 2 + d, start, end, stride[d]
                )
    patches = [sliced[o] for o in itertools.product(*(range(k) for k in kernel))]
    positions = math.prod(outer)
    count = len(patches)
    # One product per group contracts batch and positions together: (groups, out / groups,
    # batch * positions) by (groups, batch * positions, in / groups * kernel positions), in
    # the weight's order. A product per image summed over the batch afterwards made a
    # (batch, out, in * kernel) intermediate, 32 MB for a DCGAN's 128-to-256 4x4 layer at
    # batch 16, whose sum was most of the backward graph's time; the two transposes here
    # copy only the patches and the output gradient. The last transpose ORT folds into the
    # product.
    cols = torch.stack(patches, 2).reshape(batch, groups, channels // groups * count, positions)
    cols = cols.permute(1, 2, 0, 3).reshape(groups, channels // groups * count, batch * positions)
    rows = target.reshape(batch, groups, out_channels // groups, positions)
    rows = rows.permute(1, 2, 0, 3).reshape(groups, out_channels // groups, batch * positions)
    grad = aten.bmm(rows, cols.transpose(1, 2))
    return grad.reshape(out_channels, channels // groups, *kernel)


def _window_sums(
    x: torch.Tensor, kernel: list[int], stride: list[int], left: list[int], out: Sequence[Any]
) -> torch.Tensor:
    """Each window's sum of x (shape (B, 1, *spatial)): `left` zeros before each spatial dim,
    as many after as the `out` windows reach (fewer, cut, where they stop short), one
    convolution with a kernel of ones. Zeros count nothing, so windows hanging off the input
    (ceil mode) sum what they cover, as ATen's."""
    dims = len(kernel)
    pads: list[Any] = []
    for d in reversed(range(dims)):
        size = x.shape[2 + d]
        pads += [left[d], (out[d] - 1) * stride[d] + kernel[d] - size - left[d]]
    padded = aten.constant_pad_nd(x, pads, 0.0)
    box = torch.ones((1, 1, *kernel), dtype=x.dtype, device=x.device)
    return aten.convolution(padded, box, None, stride, [0] * dims, [1] * dims, False, [0] * dims, 1)


def _avg_pool_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    dims: int,
) -> torch.Tensor:
    """Each output's gradient spread evenly over its window, for 1 to 3 spatial dims, batched
    or not: a transposed convolution with a kernel of ones, after dividing by each window's
    divisor. The divisor is ATen's: the override, else the window's size, clipped to the
    padded input where windows hang off it (ceil mode) and to the input itself without
    `count_include_pad`; such divisors are counted by the same windows over ones."""
    kernel = _spatial(kernel_size, dims)
    stride = _spatial(stride, dims) if stride else kernel
    padding = _spatial(padding, dims)
    batched = input.dim() == dims + 2
    x = input if batched else input.unsqueeze(0)
    g = grad_output if batched else grad_output.unsqueeze(0)
    n, c = x.shape[0], x.shape[1]
    sizes, out = list(x.shape[2:]), list(g.shape[2:])
    if divisor_override:
        g = g / divisor_override
    elif not ceil_mode and (count_include_pad or not any(padding)):
        g = g / math.prod(kernel)
    else:
        if count_include_pad:
            region = [s + 2 * p for s, p in zip(sizes, padding, strict=True)]
            left = [0] * dims
        else:
            region, left = sizes, padding
        ones = torch.ones((1, 1, *region), dtype=x.dtype, device=x.device)
        g = g / _window_sums(ones, kernel, stride, left, out)
    box = torch.ones((1, 1, *kernel), dtype=g.dtype, device=g.device)
    extra = [
        size - ((o - 1) * s - 2 * p + k)
        for size, o, s, p, k in zip(sizes, out, stride, padding, kernel, strict=True)
    ]
    flat = g.reshape(n * c, 1, *out)
    result = _transposed(flat, box, stride, padding, [1] * dims, 1, extra)
    result = result.reshape(n, c, *sizes)
    return result if batched else result.squeeze(0)


def avg_pool2d_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """`aten.avg_pool2d_backward` (torch has no decomposition): `_avg_pool_backward`."""
    return _avg_pool_backward(
        grad_output,
        input,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
        2,
    )


def avg_pool3d_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """`aten.avg_pool3d_backward` (neither torch nor torchlib has one): `_avg_pool_backward`."""
    return _avg_pool_backward(
        grad_output,
        input,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
        3,
    )


def _pooled_size(size: Any, kernel: int, stride: int, padding: int, ceil_mode: bool) -> Any:
    """ATen's pooled length: windows from -padding in steps of `stride`; in ceil mode one
    more where it would start inside the input or its left padding."""
    span = size + 2 * padding - kernel
    # the ceiling without negative operands: with symbolic sizes the division becomes ONNX's
    # integer Div, which truncates (-(-3 // 2) came out 1, not 2)
    out = ((span + stride - 1) // stride if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _avg_pool_divided(
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    divisor_override: int | None,
    dims: int,
) -> Any:
    """An average pool with `divisor_override`: each window's sum over the override.
    torchlib's translation ignores the override (it divides by the window's size:
    `AvgPool2d(2, divisor_override=3)` came out 4/3 of eager's, caught only by the first-call
    check). Without an override the exporter's AveragePool stays."""
    if not divisor_override:
        return NotImplemented
    kernel = _spatial(kernel_size, dims)
    stride = _spatial(stride, dims) if stride else kernel
    padding = _spatial(padding, dims)
    batched = input.dim() == dims + 2
    x = input if batched else input.unsqueeze(0)
    n, c, sizes = x.shape[0], x.shape[1], list(x.shape[2:])
    out = [
        _pooled_size(size, k, s, p, ceil_mode)
        for size, k, s, p in zip(sizes, kernel, stride, padding, strict=True)
    ]
    sums = _window_sums(x.reshape(n * c, 1, *sizes), kernel, stride, padding, out)
    result = (sums / divisor_override).reshape(n, c, *out)
    return result if batched else result.squeeze(0)


def avg_pool2d(
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Any:
    return _avg_pool_divided(input, kernel_size, stride, padding, ceil_mode, divisor_override, 2)


def avg_pool3d(
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Any:
    return _avg_pool_divided(input, kernel_size, stride, padding, ceil_mode, divisor_override, 3)


def max_pool3d_with_indices_backward(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices: torch.Tensor,
) -> torch.Tensor:
    """Each window's gradient added at its maximum, by the forward's indices (flat over the
    three spatial dims, per batch and channel, as ATen's): a scatter-add. Neither torch nor
    torchlib has this backward; windows may overlap, so positions sum what they receive."""
    lead = x.dim() - 3
    flat_grad = grad_output.flatten(lead)
    flat_index = indices.flatten(lead)
    zeros = grad_output.new_zeros((*x.shape[:lead], x.shape[-3] * x.shape[-2] * x.shape[-1]))
    return zeros.scatter_add(lead, flat_index, flat_grad).reshape(x.shape)


def _adaptive_weights(
    size_in: Any, size_out: Any, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(size_out, size_in): row i averages ATen's window i of one dimension, from
    floor(i * in / out) to ceil((i + 1) * in / out), each element weighted by one over the
    window's length. Built from the sizes by integer arithmetic on tensors, so a graph with
    symbolic sizes builds it for each call's."""
    index = torch.arange(size_out, device=device)
    start = torch.div(index * size_in, size_out, rounding_mode="floor")
    end = torch.div((index + 1) * size_in + size_out - 1, size_out, rounding_mode="floor")
    position = torch.arange(size_in, device=device)
    inside = (position >= start.unsqueeze(1)) & (position < end.unsqueeze(1))
    return inside.to(dtype) / (end - start).unsqueeze(1).to(dtype)


def _adaptive_apply(x: torch.Tensor, sizes: Sequence[Any], transposed: bool) -> torch.Tensor:
    """Contract each of x's trailing len(sizes) dims with its window weights: a pool to
    `sizes` (x's sizes are the inputs'), or, `transposed`, its adjoint back to `sizes`."""
    dims = len(sizes)
    for d in range(dims):
        axis = x.dim() - dims + d
        size_here = x.shape[axis]
        weights = (
            _adaptive_weights(sizes[d], size_here, x.dtype, x.device)
            if transposed
            else _adaptive_weights(size_here, sizes[d], x.dtype, x.device).transpose(0, 1)
        )
        x = torch.matmul(x.movedim(axis, -1), weights).movedim(-1, axis)
    return x


def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """An adaptive average pool whose sizes divide evenly is an average pool; other sizes
    (windows of unequal lengths, overlapping) spread each output's gradient over its window
    by one matrix product per dimension."""
    size_in, size_out = input.shape[-2:], grad_output.shape[-2:]
    if any(i % o for i, o in zip(size_in, size_out, strict=True)):
        return _adaptive_apply(grad_output, list(size_in), transposed=True)
    kernel = [i // o for i, o in zip(size_in, size_out, strict=True)]
    return avg_pool2d_backward(grad_output, input, kernel, kernel, [0, 0], False, True, None)


def adaptive_avg_pool3d(input: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """`_adaptive_avg_pool3d` (torchlib has none): one matrix product per dimension."""
    return _adaptive_apply(input, list(output_size), transposed=False)


def adaptive_avg_pool3d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    return _adaptive_apply(grad_output, list(input.shape[-3:]), transposed=True)


def adaptive_avg_pool2d(input: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """ATen's composite `adaptive_avg_pool2d` without its re-striding: the mean over the
    spatial dims for an output of 1x1 (ATen's own computation), `_adaptive_avg_pool2d`
    otherwise (as ATen's kernel calls it). Only the result's strides differ from ATen's
    ((c, 1, 1, 1) where ATen gives a channels-last input's result (c, 1, c, c): the same
    tensor to every view and every operator, since its spatial sizes are 1)."""
    if all(size == 1 for size in output_size):
        return input.mean([-1, -2], keepdim=True)
    return aten._adaptive_avg_pool2d(input, output_size)


def max_pool1d(
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    dilation: Sequence[int] = (1,),
    ceil_mode: bool = False,
) -> torch.Tensor:
    """ATen's composite `max_pool1d` as the 2-d pool over a height of one, which it is. Its
    kernel, for a tensor autograd does not track (as a trace's are), pools in C++ over the
    sizes as plain integers: a trace with symbolic sizes fixed the length to the traced one,
    and every length got a graph of its own."""
    stride = list(stride) or list(kernel_size)
    result, _ = aten.max_pool2d_with_indices(
        input.unsqueeze(-2),
        [1, kernel_size[0]],
        [1, stride[0]],
        [0, padding[0]],
        [1, dilation[0]],
        ceil_mode,
    )
    return result.squeeze(-2)


def bernoulli_p(
    input: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Ones with probability `p`, zeros elsewhere, in the input's shape and dtype: the kept
    mask of a dropout of ones at rate 1 - p (ONNX `Dropout`, whose mask is boolean, so the
    values are exactly 0 and 1 as ATen's). Dropout's rate must lie in [0, 1): the two
    certain cases are constants."""
    if generator is not None:
        return NotImplemented
    if p >= 1:
        return torch.ones_like(input)
    if p <= 0:
        return torch.zeros_like(input)
    _, kept = aten.native_dropout(torch.ones_like(input), 1 - p, True)
    return kept.to(input.dtype)


def uniform(
    input: torch.Tensor,
    low: float = 0.0,
    high: float = 1.0,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`Tensor.uniform_`: torch's own decomposition ends in `prims.uniform`, which nothing
    translates; a uniform draw in [0, 1) scaled to [low, high) is ONNX's `RandomUniformLike`
    (seeded as every graph's random operators are, `random_ops`)."""
    if generator is not None:
        return NotImplemented
    return torch.rand_like(input) * (high - low) + low


def rrelu_with_noise_functional(
    input: torch.Tensor,
    noise: torch.Tensor,
    lower: float = 0.125,
    upper: float = 1.0 / 3.0,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RReLU as ATen computes it: in training, each input at or below zero is multiplied by
    its own slope drawn uniformly from [lower, upper) and the slopes (1 elsewhere) are the
    noise the backward multiplies by; in eval, a leaky ReLU with the mean slope (the noise
    left as it was)."""
    if generator is not None:
        return NotImplemented
    if not training:
        return aten.leaky_relu(input, (lower + upper) / 2), noise
    slopes = torch.rand_like(input) * (upper - lower) + lower
    drawn = torch.where(input <= 0, slopes, torch.ones_like(input))
    return input * drawn, drawn


def _attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """The flash kernel's scores: q k^T times the scale, then the mask added (a boolean one as
    0 or -inf, as the kernel converts it; a causal one from the top left)."""
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), -math.inf)
        else:
            scores = scores + attn_mask.to(scores.dtype)
    if is_causal:
        rows, cols = query.shape[-2], key.shape[-2]
        above = torch.ones(rows, cols, dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(above, -math.inf)
    return scores


def _flash_supported(query: torch.Tensor, key: torch.Tensor, dropout_p: float) -> bool:
    """No dropout, (batch, heads, length, dim), and key heads that divide the query's (grouped
    query attention, `enable_gqa`: query head h reads key and value head h // group)."""
    return dropout_p == 0 and query.dim() == 4 and query.shape[1] % key.shape[1] == 0


def _heads_as_query(t: torch.Tensor, heads: Any) -> torch.Tensor:
    """Key or value heads repeated to the query's, each `heads // t.shape[1]` times in a row
    (what the kernel reads under grouped query attention); `t` itself when they match."""
    kv_heads = t.shape[1]
    if kv_heads == heads:
        return t
    group = heads // kv_heads
    b, _, length, dim = t.shape
    return t.unsqueeze(2).expand(b, kv_heads, group, length, dim).reshape(b, heads, length, dim)


def _heads_as_key(grad: torch.Tensor, kv_heads: Any) -> torch.Tensor:
    """The gradient of `_heads_as_query`: each group of query heads summed onto its head."""
    heads = grad.shape[1]
    if kv_heads == heads:
        return grad
    b, _, length, dim = grad.shape
    return grad.reshape(b, kv_heads, heads // kv_heads, length, dim).sum(2)


def scaled_dot_product_flash_attention_for_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    """The CPU flash kernel's output and its log-sum-exp, computed as the kernel does (one
    block of keys): row maximum m of the scores s, e = exp(s - m), output (e v) / sum(e),
    lse = m + log(sum(e)); in float32 for half types, as the kernel accumulates."""
    if not _flash_supported(query, key, dropout_p):
        return NotImplemented
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    heads = query.shape[1]
    q, k, v = (t.to(work) for t in (query, key, value))
    k, v = _heads_as_query(k, heads), _heads_as_query(v, heads)
    scores = _attention_scores(q, k, is_causal, attn_mask, scale)
    peak = scores.amax(-1, keepdim=True)
    # a row with every key at -inf: the kernel gives an output and a log-sum-exp of 0
    # (so its backward, exp(-inf - 0), gives no gradient), where the softmax gives NaN
    masked = peak == -math.inf
    peak = torch.where(masked, 0.0, peak)
    weights = torch.exp(scores - peak)
    total = weights.sum(-1, keepdim=True)
    output = torch.matmul(weights, v) / torch.where(masked, 1.0, total)
    logsumexp = torch.where(masked, 0.0, peak + torch.log(total)).squeeze(-1)
    # the kernel's layouts (views after it need them): the output strided as the query
    # ((batch, length, heads, dim) transposed, as attention layers hand it over, or
    # contiguous), the log-sum-exp always (batch, length, heads) transposed
    output = output.to(query.dtype)
    if not query.is_contiguous() and query.transpose(1, 2).is_contiguous():
        output = output.transpose(1, 2).contiguous().transpose(1, 2)
    logsumexp = logsumexp.transpose(1, 2).contiguous().transpose(1, 2)
    return output, logsumexp


def scaled_dot_product_flash_attention_for_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    """The CPU flash kernel's backward (torch has none): the probabilities recomputed from the
    forward's log-sum-exp, p = exp(s - lse), not renormalised. That is what eager computes,
    and where every key of a row is masked by a large negative number (transformers' masks
    use the dtype's minimum) it is not the softmax's derivative: lse rounds to the minimum,
    each p is 1 instead of 1 / keys, and eager's gradients are that many times larger. The
    softmax's own backward (the math kernel's) was 0.35 % off eager's on BERT's embeddings."""
    if not _flash_supported(query, key, dropout_p):
        return NotImplemented
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v, o, g = (t.to(work) for t in (query, key, value, out, grad_out))
    k, v = _heads_as_query(k, query.shape[1]), _heads_as_query(v, query.shape[1])
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = _attention_scores(q, k, is_causal, attn_mask, scale)
    p = torch.exp(scores - logsumexp.to(work).unsqueeze(-1))
    grad_value = torch.matmul(p.transpose(-2, -1), g)
    grad_p = torch.matmul(g, v.transpose(-2, -1))
    row = (g * o).sum(-1, keepdim=True)
    grad_scores = p * (grad_p - row) * scale
    grad_query = torch.matmul(grad_scores, k)
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), q)
    grad_key, grad_value = (
        _heads_as_key(grad_key, key.shape[1]),
        _heads_as_key(grad_value, key.shape[1]),
    )
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


def select_backward(
    grad_output: torch.Tensor, input_sizes: Sequence[int], dim: int, index: int
) -> torch.Tensor:
    """Zeros around the selected slice, as a pad (ONNX Pad). torch's own decomposition
    scatters into zeros, which ORT runs as ScatterElements: in a transformer layer's backward
    (the q, k, v split) that was a quarter of the step."""
    rank = len(input_sizes)
    dim %= rank
    index %= input_sizes[dim]
    pad = [0, 0] * (rank - 1 - dim) + [index, input_sizes[dim] - index - 1]
    return aten.constant_pad_nd(grad_output.unsqueeze(dim), pad, 0.0)


def slice_backward(
    grad_output: torch.Tensor,
    input_sizes: Sequence[int],
    dim: int,
    start: int,
    end: int,
    step: int,
) -> torch.Tensor:
    """A step-1 slice's gradient as a pad, like `select_backward`; other steps scatter."""
    rank = len(input_sizes)
    dim %= rank
    size = input_sizes[dim]
    if step != 1:
        zeros = grad_output.new_zeros(input_sizes)
        return aten.slice_scatter(zeros, grad_output, dim, start, end, step)
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    pad = [0, 0] * (rank - 1 - dim) + [start, size - end]
    return aten.constant_pad_nd(grad_output, pad, 0.0)


def diagonal_backward(
    grad_output: torch.Tensor, input_sizes: Sequence[int], offset: int, dim1: int, dim2: int
) -> torch.Tensor:
    """The diagonal's gradient placed by a mask, out of place: torch's decomposition copies
    into a diagonal view of zeros, an in-place write aot_autograd refuses in a joint graph
    (and ONNX has no diagonal scatter). Element k of the diagonal sits in row k (offset >= 0)
    or column k (offset < 0): the gradient, padded to that length, is spread along the other
    axis and kept where the mask marks the diagonal."""
    rank = len(input_sizes)
    dim1, dim2 = dim1 % rank, dim2 % rank
    rows, cols = input_sizes[dim1], input_sizes[dim2]
    along = rows if offset >= 0 else cols
    spread = aten.constant_pad_nd(grad_output, [0, along - grad_output.shape[-1]], 0.0)
    spread = spread.unsqueeze(-1) if offset >= 0 else spread.unsqueeze(-2)
    i = torch.arange(rows, device=grad_output.device).unsqueeze(-1)
    j = torch.arange(cols, device=grad_output.device)
    on_diagonal = (j - i) == offset
    placed = torch.where(on_diagonal, spread, grad_output.new_zeros(()))
    return torch.movedim(placed, (-2, -1), (dim1, dim2))


def weight_norm_interface_backward(
    grad_w: torch.Tensor, v: torch.Tensor, g: torch.Tensor, norms: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight_norm's gradient (w = v * g / |v|, the norm over every dim but `dim`), which
    torch has as one fused kernel only: with s = sum(grad_w * v) over those dims,
    grad_g = s / |v| and grad_v = g / |v| * (grad_w - v * s / |v|^2)."""
    dim %= v.dim()
    over = [k for k in range(v.dim()) if k != dim]
    s = (grad_w * v).sum(over, keepdim=True)
    grad_g = s / norms
    grad_v = (g / norms) * (grad_w - v * (grad_g / norms))
    return grad_v, grad_g


def threshold_backward(
    grad_output: torch.Tensor, self: torch.Tensor, threshold: float
) -> torch.Tensor:
    """ReLU's gradient as a product with the mask: ORT's CPU `Where` took 4x the time of a
    Greater, a Cast and a Mul (33 ms against 8 on a transformer layer's activations). Only
    an infinite or NaN gradient where the input is below the threshold differs from eager's
    (NaN instead of 0): a step that scaling rejects either way."""
    return grad_output * (self > threshold).to(grad_output.dtype)


def leaky_relu_backward(
    grad_output: torch.Tensor, self: torch.Tensor, negative_slope: float, self_is_result: bool
) -> torch.Tensor:
    """LeakyReLU's gradient as a product with a factor that is exactly 1 where the input is
    positive and exactly the slope elsewhere (NaN inputs included, as in ATen): ORT's CPU
    `Where` ran 1.0 ms on a DCGAN discriminator's (16, 32, 16, 16) activations, this 0.1 ms.
    The factor never multiplies a gradient by 0, so infinite and NaN gradients come out as
    eager's too. `self_is_result` changes nothing: a positive slope keeps the sign."""
    positive = (self > 0).to(grad_output.dtype)
    return grad_output * (positive + (1 - positive) * negative_slope)


def native_batch_norm_legit_functional(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """BatchNorm in train mode in six passes over the input where torch's decomposition
    takes nine (its `var_mean` finds the mean twice, and it scales by the inverse deviation
    and the weight one after the other): mean, centre, square, mean, then one scale and one
    shift per channel. Eval mode is torch's own."""
    if not training:
        from torch._decomp import decompositions as torch_decompositions

        result: tuple[torch.Tensor, ...] = torch_decompositions._native_batch_norm_legit_functional(
            input, weight, bias, running_mean, running_var, training, momentum, eps
        )
        return result
    dims = [0, *range(2, input.dim())]
    computation = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    x = input.to(computation)
    mean = x.mean(dims, keepdim=True)
    centred = x - mean
    variance = (centred * centred).mean(dims, keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    scale = rstd if weight is None else rstd * weight.flatten().reshape(mean.shape)
    output = centred * scale
    if bias is not None:
        output = output + bias.flatten().reshape(mean.shape)
    save_mean, save_rstd = mean.flatten(), rstd.flatten()
    count = input.numel() / input.shape[1]
    new_mean = momentum * save_mean + (1 - momentum) * running_mean
    new_var = momentum * variance.flatten() * (count / (count - 1)) + (1 - momentum) * running_var
    # the saved statistics stay in the computation's precision, as ATen's kernel keeps them
    return output.to(input.dtype), save_mean, save_rstd, new_mean, new_var


def _tiles(
    x: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> list[int] | None:
    """The kernel, when a 2-d max pool's windows tile the input exactly (stride = kernel, no
    padding or dilation, sizes divisible: `MaxPool2d(2)`); else None."""
    k = _spatial(kernel, 2)
    s = _spatial(stride, 2) if stride else k
    if s != k or any(_spatial(padding, 2)) or any(d != 1 for d in _spatial(dilation, 2)):
        return None
    if x.dim() != 4 or x.shape[2] % k[0] or x.shape[3] % k[1]:
        return None
    return k


def _slots(x: torch.Tensor, k: list[int]) -> list[torch.Tensor]:
    """The windows' elements by position, in ATen's scan order (row by row): kh * kw strided
    slices of (N, C, H / kh, W / kw) each. Elementwise work on these runs at ORT's full speed;
    a trailing window axis of 4 made every broadcast, reduction and transpose over it 10 to 50
    times slower per element (1.5 ms of a small CNN's 3.4 ms forward)."""
    return [x[:, :, i :: k[0], j :: k[1]] for i in range(k[0]) for j in range(k[1])]


def _maximum(slots: list[torch.Tensor]) -> torch.Tensor:
    result = slots[0]
    for slot in slots[1:]:
        result = torch.maximum(result, slot)
    return result


def max_pool2d_with_indices(
    x: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    dilation: Sequence[int] = (1,),
    ceil_mode: bool = False,
) -> Any:
    """Tiling windows as the elementwise maximum of the windows' slots. ORT's MaxPool with
    its indices output is nine times slower than without (4.5 ms against 0.5 on (8, 16, 32,
    32)); the indices are only computed where something reads them, and the backward below
    needs none. Other pools keep the exporter's MaxPool."""
    k = _tiles(x, kernel_size, stride, padding, dilation)
    if k is None:
        return NotImplemented
    slots = _slots(x, k)
    result = _maximum(slots)
    # the first maximum, as ATen's kernel picks: the lowest slot equal to the maximum
    position = torch.full_like(result, len(slots) - 1, dtype=torch.int64)
    for j in range(len(slots) - 2, -1, -1):
        position = torch.where(slots[j] == result, j, position)
    row = torch.arange(x.shape[2] // k[0], device=x.device).view(-1, 1) * k[0]
    col = torch.arange(x.shape[3] // k[1], device=x.device).view(1, -1) * k[1]
    indices = (row + position // k[1]) * x.shape[3] + col + position % k[1]
    return result, indices


def max_pool2d_with_indices_backward(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices: torch.Tensor,
) -> torch.Tensor:
    """For tiling windows, each window's gradient to its first maximum, found again from the
    input (no indices, no scatter): one masked copy of the gradient per slot, put back in
    place by a transposed convolution with one-hot kernels (stride = kernel, so each input
    position receives exactly one slot's value plus zeros: exact). Other pools scatter by
    the indices (torch's own)."""
    k = _tiles(x, kernel_size, stride, padding, dilation)
    if k is None:
        from torch._decomp import decompositions as torch_decompositions

        result: torch.Tensor = torch_decompositions.max_pool2d_with_indices_backward(
            grad_output, x, kernel_size, stride, padding, dilation, ceil_mode, indices
        )
        return result
    slots = _slots(x, k)
    maximum = _maximum(slots)
    taken = slots[0] == maximum
    spread = [grad_output * taken.to(grad_output.dtype)]
    for slot in slots[1:]:
        first = (slot == maximum) & ~taken
        spread.append(grad_output * first.to(grad_output.dtype))
        taken = taken | first
    n, c, h, w = x.shape
    count = len(slots)
    stacked = torch.stack(spread, 2).reshape(n * c, count, h // k[0], w // k[1])
    one_hot = torch.eye(count, dtype=grad_output.dtype, device=grad_output.device)
    result = aten.convolution(
        stacked, one_hot.reshape(count, 1, *k), None, k, [0, 0], [1, 1], True, [0, 0], 1
    )
    return result.reshape(n, c, h, w)


OURS: dict[Any, Callable[..., Any]] = {
    aten._native_batch_norm_legit_functional.default: native_batch_norm_legit_functional,
    aten.max_pool2d_with_indices.default: max_pool2d_with_indices,
    aten.max_pool2d_with_indices_backward.default: max_pool2d_with_indices_backward,
    aten.threshold_backward.default: threshold_backward,
    aten.leaky_relu_backward.default: leaky_relu_backward,
    aten.select_backward.default: select_backward,
    aten.slice_backward.default: slice_backward,
    aten.diagonal_backward.default: diagonal_backward,
    aten._weight_norm_interface_backward.default: weight_norm_interface_backward,
    aten.convolution_backward.default: convolution_backward,
    aten.avg_pool2d_backward.default: avg_pool2d_backward,
    aten.avg_pool3d_backward.default: avg_pool3d_backward,
    aten.avg_pool2d.default: avg_pool2d,
    aten.avg_pool3d.default: avg_pool3d,
    aten.max_pool3d_with_indices_backward.default: max_pool3d_with_indices_backward,
    aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
    aten._adaptive_avg_pool3d.default: adaptive_avg_pool3d,
    aten._adaptive_avg_pool3d_backward.default: adaptive_avg_pool3d_backward,
    aten.bernoulli.p: bernoulli_p,
    aten.uniform.default: uniform,
    aten.rrelu_with_noise_functional.default: rrelu_with_noise_functional,
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        scaled_dot_product_flash_attention_for_cpu
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        scaled_dot_product_flash_attention_for_cpu_backward
    ),
}


#: composite operators of the table: their ATen kernel (CompositeImplicitAutograd) runs above
#: autograd and calls other operators, so a trace never hands the operator itself to a
#: decomposition table; each entry is marked (`before_autograd`), and the capture puts it in
#: the ATen kernel's place while aot traces (`trace_context.composites_replaced`).
BEFORE_AUTOGRAD: dict[Any, Callable[..., Any]] = {
    aten.adaptive_avg_pool2d.default: adaptive_avg_pool2d,
    aten.max_pool1d.default: max_pool1d,
}
for _function in BEFORE_AUTOGRAD.values():
    _function.before_autograd = True  # type: ignore[attr-defined]


@functools.cache
def table(implemented: frozenset[Any] | None = None) -> dict[Any, Callable[..., Any]]:
    """The decompositions the capture traces with (built once: it walks torch's tables):
    torch's, less those of the operators torchlib translates (`implemented`, by default
    `lowering.implemented()`, which imports the exporter)."""
    from torch._decomp import get_decompositions
    from torch.onnx._internal.exporter import _decomp

    if implemented is None:
        from ort_autopatch.engine.backends.ort import lowering

        implemented = lowering.implemented()
    found: dict[Any, Callable[..., Any]] = dict(
        _decomp.create_onnx_friendly_decomposition_table(set(implemented))
    )
    found.update(get_decompositions(list(TORCH_DECOMPOSED)))
    found.update(OURS)
    found.update(BEFORE_AUTOGRAD)
    for op in KEPT:
        found.pop(op, None)
    return found


@functools.cache
def decomposable() -> frozenset[Any]:
    """The operators torch's tables decompose: those whose place in `table` depends on what
    torchlib translates (about 0.05 s, once)."""
    return frozenset(torch.export.default_decompositions()) | frozenset(
        torch._decomp.decomposition_table
    )


def alike(one: frozenset[Any], other: frozenset[Any]) -> bool:
    """Whether `table(one)` and `table(other)` are one table: the two sets agree on every
    operator torch's tables decompose (what else they hold is never read)."""
    return not (one ^ other) & decomposable()
