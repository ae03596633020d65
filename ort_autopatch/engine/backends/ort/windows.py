"""Decompositions of the windowed operators for the plain backend's table (`decompositions`):
convolution's backward and the pools (average, adaptive average, max), at one to three spatial
dimensions, batched or not, with static or symbolic sizes. Why each is ours and not torch's
or torchlib's is said in `decompositions`' docstring; the shared tools are a transposed
convolution whose output padding may be symbolic (`_transposed`) and each window's sum as a
convolution with a kernel of ones (`_window_sums`). Where a convolution's backward can be one
operator of ours, `convolutions` makes it so and translates it to the nodes these make; the
public helpers here (`spatial`, `pointwise`, `convolves_patches`, `contracts_per_image`,
`unreached`, `one_hot_kernels`) are the choices and pieces the two share.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE as NAMESPACE

aten = torch.ops.aten


def spatial(values: Sequence[int], dims: int) -> list[int]:
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
    stride, padding, dilation = (spatial(v, dims) for v in (stride, padding, dilation))
    kernel = list(weight.shape[2:])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = aten.convolution(
                grad_output, weight, None, stride, padding, dilation, False, [0] * dims, groups
            )
        else:
            extra = unreached(input, grad_output, kernel, stride, padding, dilation)
            grad_input = _transposed(grad_output, weight, stride, padding, dilation, groups, extra)
    if output_mask[1]:
        # transposed: the weight's gradient of the adjoint, with the two activations swapped
        source, target = (grad_output, input) if transposed else (input, grad_output)
        grad_weight = _weight_gradient(source, target, kernel, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


def unreached(
    input: torch.Tensor,
    output: torch.Tensor,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> list[Any]:
    """Per spatial dimension, how many trailing positions of a convolution's input its
    windows never read (the `output_padding` of the transposed convolution that is its
    input's gradient)."""
    return [
        input.shape[2 + d]
        - (
            (output.shape[2 + d] - 1) * stride[d]
            - 2 * padding[d]
            + dilation[d] * (kernel[d] - 1)
            + 1
        )
        for d in range(len(kernel))
    ]


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

    As a matrix product with the source's patches: grad_w[o, i, k] = sum over batch and
    positions p of target[o, p] * patch_k[i, p]. One group takes its patches from one
    convolution with one-hot kernels where that is faster (`_patches_by_convolution`), else
    from one strided slice of the padded source per kernel position. Written as a convolution
    whose kernel is the whole target instead, ORT ran it 2 to 5 times slower (0.3 to 0.8 ms
    against 0.12 for a 3x3 convolution's weight on (8, 3, 32, 32); 2 to 4 times on
    ResNet-50's layers), slower than eager's whole convolution backward.
    """
    dims = source.dim() - 2
    batch, channels = source.shape[0], source.shape[1]
    out_channels = target.shape[1]
    outer = list(target.shape[2:])
    narrow = type(channels) is int and channels < _NARROW_CHANNELS
    if groups == 1 and pointwise(kernel, stride, padding):
        # the one patch is the source itself, channels first, which the product takes
        # transposed for free: taken channels last, every 1x1 layer's input was copied whole
        # (a Transpose of (2, 256, 56, 56) took 2.9 ms in ResNet-50's step) and its gradient
        # permuted at the end; 0.85 of the time on ResNet-50's 1x1 layers alone
        positions = math.prod(outer)
        cols = source.reshape(batch, channels, positions)
        grad = _contracted(target.reshape(batch, out_channels, positions), cols)
        return grad.reshape(out_channels, channels, *kernel)
    if groups == 1:
        convolved = _patches_by_convolution(source, outer, kernel, stride, padding, dilation)
        if convolved is not None:
            count, positions = math.prod(kernel), math.prod(outer)
            cols = convolved.reshape(batch, channels * count, positions)  # channel-major
            grad = _contracted(target.reshape(batch, out_channels, positions), cols)
            return grad.reshape(out_channels, channels, *kernel)
        if narrow:
            return _narrow_weight_gradient(source, target, kernel, stride, padding, dilation)
    # Channels last: every patch is then a slice of whole channel rows (ORT copies those as
    # blocks; strided slices of NCHW's last axis it copied element by element, and stacking
    # (B, C, 1, ...) pieces moved blocks of a few floats: slices, stack and pad took 2 to 4
    # times the product's time on a DCGAN's layers).
    last = aten.permute(source, [0, *range(2, dims + 2), 1])
    padded = aten.constant_pad_nd(last, [0, 0, *_pads(padding)], 0.0) if any(padding) else last
    # slices by leading kernel offsets, each taken once (a 3x3 kernel: 3 + 9 slices, not 18)
    sliced: dict[tuple[int, ...], torch.Tensor] = {(): padded}
    for offsets in itertools.product(*(range(k) for k in kernel)):
        for d in range(dims):
            if offsets[: d + 1] not in sliced:
                start = offsets[d] * dilation[d]
                end = start + (outer[d] - 1) * stride[d] + 1
                whole = sliced[offsets[:d]]
                size = whole.shape[1 + d]
                whole_dim = start == 0 and stride[d] == 1 and type(end) is int and type(size) is int
                if whole_dim and end == size:
                    sliced[offsets[: d + 1]] = whole  # the window spans the whole dimension
                else:
                    sliced[offsets[: d + 1]] = aten.slice(whole, 1 + d, start, end, stride[d])
    patches = [sliced[o] for o in itertools.product(*(range(k) for k in kernel))]
    positions = math.prod(outer)
    count = len(patches)
    per_group = channels // groups
    # (batch * positions, kernel positions * channels). One group whose patch rows are no
    # wider than the positions: a product per image, summed (`_contracted`), with no
    # transposed copy of the target. Else one product per group contracts batch and positions
    # together, (groups, out / groups, batch * positions) by (groups, batch * positions,
    # kernel positions * in / groups): per image, a wide layer's products were larger than
    # the target ((batch, out, in * kernel), 32 MB for a 128-to-256 4x4 layer at batch 16).
    cols = torch.cat(patches, -1) if count > 1 else patches[0]
    width = count * channels
    if groups == 1 and type(positions) is int and type(width) is int and width <= positions:
        rows = target.reshape(batch, out_channels, positions)
        grad = aten.bmm(rows, cols.reshape(batch, positions, width)).sum(0)
        grad = grad.reshape(out_channels, *kernel, per_group)
        return grad.permute(0, dims + 1, *range(1, dims + 1)).contiguous()
    if groups == 1:
        cols = cols.reshape(1, batch * positions, count * channels)
    else:
        cols = cols.reshape(batch * positions, count, groups, per_group)
        cols = cols.permute(2, 0, 1, 3).reshape(groups, batch * positions, count * per_group)
    rows = target.reshape(batch, groups, out_channels // groups, positions)
    rows = rows.permute(1, 2, 0, 3).reshape(groups, out_channels // groups, batch * positions)
    grad = aten.bmm(rows, cols)  # (groups, out / groups, kernel positions * in / groups)
    grad = grad.reshape(out_channels, *kernel, per_group)
    return grad.permute(0, dims + 1, *range(1, dims + 1)).contiguous()


def pointwise(kernel: list[int], stride: list[int], padding: list[int]) -> bool:
    """A 1x1 convolution reading every position: its patch is its input."""
    return all(k == 1 for k in kernel) and all(s == 1 for s in stride) and not any(padding)


def _pads(padding: list[int]) -> list[int]:
    """`constant_pad_nd`'s pads for `padding` on each spatial dim (last dim first)."""
    return [p for size in reversed(padding) for p in (size, size)]


#: Below this many input channels a convolution's weight gradient takes its patches from the
#: channels-first input (`_narrow_weight_gradient`).
_NARROW_CHANNELS = 16


def _narrow_weight_gradient(
    source: torch.Tensor,
    target: torch.Tensor,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> torch.Tensor:
    """`_weight_gradient`'s slices for a source of few channels (an image's 3) and one group,
    cut from the channels-first source.

    Channels last, each patch row is a few floats, and ORT moved the patches' slices and
    their concatenation a few floats at a time (a CNN's first layer: 9 slices of (8, 32, 32,
    3)). Channels first, every slice copies rows of the image, side by side along the
    channels in blocks of a whole image plane (a stack along a new axis unsqueezed each, a
    node per patch)."""
    batch, channels = source.shape[:2]
    out_channels, outer = target.shape[1], list(target.shape[2:])
    positions = math.prod(outer)
    count = math.prod(kernel)
    padded = aten.constant_pad_nd(source, _pads(padding), 0.0) if any(padding) else source
    patches = []
    for offsets in itertools.product(*(range(k) for k in kernel)):
        patch = padded
        for d in range(len(kernel)):
            start = offsets[d] * dilation[d]
            end = start + (outer[d] - 1) * stride[d] + 1
            size = patch.shape[2 + d]
            whole = start == 0 and stride[d] == 1 and type(end) is int and type(size) is int
            if not (whole and end == size):  # not the window spanning the whole dimension
                patch = aten.slice(patch, 2 + d, start, end, stride[d])
        patches.append(patch)
    cols = torch.cat(patches, 1).reshape(batch, count * channels, positions)
    grad = _contracted(target.reshape(batch, out_channels, positions), cols)
    dims = len(kernel)
    grad = grad.reshape(out_channels, *kernel, channels)
    return grad.permute(0, dims + 1, *range(1, dims + 1)).contiguous()


def _contracted(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """rows (batch, m, positions) times cols (batch, n, positions), summed over batch and
    positions: (m, n). Per image, then summed, where the products (batch, m, n) are no larger
    than the operands (n <= positions): ORT takes cols transposed into the product for free,
    where contracting batch and positions in one product first moved both operands to
    (m, batch x positions) (two Transposes, a fifth of a small CNN's backward)."""
    batch, m, positions = rows.shape
    n = cols.shape[1]
    if contracts_per_image(n, positions):
        return aten.bmm(rows, cols.transpose(1, 2)).sum(0)
    rows = rows.permute(1, 0, 2).reshape(m, batch * positions)
    cols = cols.permute(1, 0, 2).reshape(n, batch * positions)
    return aten.mm(rows, cols.t())


def contracts_per_image(n: Any, positions: Any) -> bool:
    """Whether `_contracted` takes one product per image (summed), not one product over
    batch and positions together: products (batch, m, n) no larger than the operands."""
    return not (type(positions) is int and type(n) is int and n > positions)


def _patches_by_convolution(
    source: torch.Tensor,
    outer: list[Any],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> torch.Tensor | None:
    """The patches of a float32 source of static sizes as one grouped convolution with one-hot
    kernels (batch, channels x kernel positions, *outer), channel-major, or None where the
    slices are faster (`convolves_patches`). Multiplying by one and adding zeros is exact."""
    if not convolves_patches(source, outer, kernel, stride, padding, dilation):
        return None
    zeros = [0] * len(kernel)
    weight = one_hot_kernels(source.shape[1], kernel, source.dtype, source.device)
    return aten.convolution(
        source, weight, None, stride, padding, dilation, False, zeros, source.shape[1]
    )


def one_hot_kernels(
    channels: int, kernel: list[int], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """(channels x kernel positions, 1, *kernel): per channel, one kernel per position, one
    at that position and zeros elsewhere (`_patches_by_convolution`'s weight)."""
    count = math.prod(kernel)
    one_hot = torch.eye(count, dtype=dtype, device=device)
    return one_hot.reshape(count, 1, *kernel).repeat(channels, *[1] * (len(kernel) + 1))


def convolves_patches(
    source: torch.Tensor,
    outer: list[Any],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> bool:
    """Whether `_weight_gradient` takes one group's patches from one convolution with one-hot
    kernels: a float32 source of static sizes, a kernel of more than one position, windows
    reaching exactly the `outer` positions, and the convolution faster than the slices
    (`_convolved_patches_pay`)."""
    count, positions = math.prod(kernel), math.prod(outer)
    if source.dtype != torch.float32 or count == 1:
        return False
    sizes = list(source.shape)
    if not all(type(size) is int for size in [*sizes, *outer]):
        return False
    if not _convolved_patches_pay(sizes[1], count, positions, stride):
        return False
    reached = [
        (sizes[2 + d] + 2 * padding[d] - dilation[d] * (kernel[d] - 1) - 1) // stride[d] + 1
        for d in range(len(kernel))
    ]
    return reached == outer


def _convolved_patches_pay(channels: int, count: int, positions: int, stride: list[int]) -> bool:
    """Whether ORT takes the patches faster by the one-hot convolution than by slices (1 and 2
    threads, weight gradient alone). Slices channels last copy channel rows a few floats at
    a time and ORT copies slices strided along the last dimension element by element: the
    convolution took 0.56 to 0.94 of the slices' time on ResNet-50's 3x3 layers and a
    DCGAN's 4x4 stride-2 ones, 0.64 on a 5x5 and 0.94 on a 7x7 layer of 32 channels. Its
    grouped products are small: below 16 positions it lost (2x2 outputs: 427 us against
    170; one position, 213 against 65). Few channels' channels-first slices copy whole
    planes: there the convolution paid up to 3x3 kernels (0.71 to 0.76) and at every stride
    above 1 (0.43 to 0.83), not at 5x5 and stride 1 (1.09)."""
    if positions < 16:
        return False
    if channels < _NARROW_CHANNELS and all(s == 1 for s in stride):
        return count <= 9
    return True


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
    kernel = spatial(kernel_size, dims)
    stride = spatial(stride, dims) if stride else kernel
    padding = spatial(padding, dims)
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
    kernel = spatial(kernel_size, dims)
    stride = spatial(stride, dims) if stride else kernel
    padding = spatial(padding, dims)
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


def _average_pools(dims: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The table's entries for `aten.avg_pool{dims}d` (`_avg_pool_divided`) and its backward
    (`_avg_pool_backward`; torch has no decomposition of either backward, torchlib no 3-d one),
    with ATen's signatures."""

    def avg_pool(
        input: torch.Tensor,
        kernel_size: Sequence[int],
        stride: Sequence[int] = (),
        padding: Sequence[int] = (0,),
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> Any:
        return _avg_pool_divided(
            input, kernel_size, stride, padding, ceil_mode, divisor_override, dims
        )

    def avg_pool_backward(
        grad_output: torch.Tensor,
        input: torch.Tensor,
        kernel_size: Sequence[int],
        stride: Sequence[int],
        padding: Sequence[int],
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
    ) -> torch.Tensor:
        return _avg_pool_backward(
            grad_output,
            input,
            kernel_size,
            stride,
            padding,
            ceil_mode,
            count_include_pad,
            divisor_override,
            dims,
        )

    for function, name in ((avg_pool, "avg_pool"), (avg_pool_backward, "avg_pool_backward")):
        function.__name__ = function.__qualname__ = name.replace("pool", f"pool{dims}d")
    return avg_pool, avg_pool_backward


avg_pool2d, avg_pool2d_backward = _average_pools(2)
avg_pool3d, avg_pool3d_backward = _average_pools(3)


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


def _tiles(
    x: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> list[int] | None:
    """The kernel, when a 2-d max pool's windows tile the input exactly (stride = kernel, no
    padding or dilation, sizes divisible: `MaxPool2d(2)`); else None."""
    k = spatial(kernel, 2)
    s = spatial(stride, 2) if stride else k
    if s != k or any(spatial(padding, 2)) or any(d != 1 for d in spatial(dilation, 2)):
        return None
    if x.dim() != 4 or x.shape[2] % k[0] or x.shape[3] % k[1]:
        return None
    return k


@torch.library.custom_op(f"{NAMESPACE}::window_slots", mutates_args=())
def window_slots(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    """The elements of square windows that tile x (N, C, H, W), by position in the window,
    row by row: block * block tensors of (N, C, H / block, W / block), slot `i * block + j`
    holding `x[n, c, h * block + i, w * block + j]`. ONNX's `SpaceToDepth` puts them in
    that order along the channels (its channel `(i * block + j) * C + c`), and one `Split`
    cuts its runs of C channels apart."""
    n, c, h, w = x.shape
    view = x.reshape(n, c, h // block, block, w // block, block)
    return [view[:, :, :, i, :, j].clone() for i in range(block) for j in range(block)]


@window_slots.register_fake
def _(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    n, c, h, w = x.shape
    return [x.new_empty((n, c, h // block, w // block)) for _ in range(block * block)]


def lower_window_slots(x: Any, block: int) -> Any:
    from onnxscript import opset18 as op

    return op.Split(op.SpaceToDepth(x, blocksize=block), axis=1, num_outputs=block * block)


#: our operators and their ONNX translations (`lowering.registry_for`)
TRANSLATIONS: dict[Any, Any] = {
    torch.ops.ort_autopatch.window_slots.default: lower_window_slots,
}


def _slots(x: torch.Tensor, k: list[int]) -> list[torch.Tensor]:
    """The windows' elements by position, in ATen's scan order (row by row): kh * kw
    tensors of (N, C, H / kh, W / kw). Elementwise work on these runs at ORT's full speed;
    a trailing window axis of 4 made every broadcast, reduction and transpose over it 10 to 50
    times slower per element (1.5 ms of a small CNN's 3.4 ms forward). Square windows take
    their slots from one `SpaceToDepth` and a `Split` (`window_slots`: 87 us for the
    SpaceToDepth on (8, 16, 32, 32) at one thread, against 273 for the strided slices, which
    ORT copies element by element along the last dimension)."""
    if k[0] != k[1]:
        return [x[:, :, i :: k[0], j :: k[1]] for i in range(k[0]) for j in range(k[1])]
    return list(window_slots(x, k[0]))


def _running_maxima(slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The maximum of the first 1, 2, ... of the slots, the windows' maximum last (NaN where a
    window holds one, as ATen's pool; ONNX's ReduceMax skips NaN). Forward's maximum and
    backward's masks read the same chain, which the partitioner computes once."""
    running = [slots[0]]
    for slot in slots[1:]:
        running.append(torch.maximum(running[-1], slot))
    return running


def _first_maxima(slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Where each slot holds its window's first maximum, as ATen's kernel picks it (the lowest
    slot equal to the maximum; -0.0 and 0.0 tie): a slot equal to the maximum and greater
    than every slot before it, which the running maxima say in one comparison (eight
    elementwise nodes for a 2x2 window, where marking the slots taken before took twelve).
    No slot of a window holding NaN is marked."""
    running = _running_maxima(slots)
    maximum = running[-1]
    masks = [slots[0] == maximum]
    for j in range(1, len(slots)):
        first = slots[j] > running[j - 1]
        # the last slot above all the others is the maximum
        masks.append(first if j == len(slots) - 1 else first & (slots[j] == maximum))
    return masks


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
    result = _running_maxima(slots)[-1]
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
    position receives exactly one slot's value plus zeros: exact; ONNX's `DepthToSpace`, its
    inverse of `SpaceToDepth`, ran 210 us against the convolution's 77 on (8, 16, 32, 32)).
    Other pools scatter by the indices (torch's own)."""
    k = _tiles(x, kernel_size, stride, padding, dilation)
    if k is None:
        from torch._decomp import decompositions as torch_decompositions

        result: torch.Tensor = torch_decompositions.max_pool2d_with_indices_backward(
            grad_output, x, kernel_size, stride, padding, dilation, ceil_mode, indices
        )
        return result
    slots = _slots(x, k)
    spread = [grad_output * first.to(grad_output.dtype) for first in _first_maxima(slots)]
    n, c, h, w = x.shape
    count = len(slots)
    stacked = torch.stack(spread, 2).reshape(n * c, count, h // k[0], w // k[1])
    one_hot = torch.eye(count, dtype=grad_output.dtype, device=grad_output.device)
    result = aten.convolution(
        stacked, one_hot.reshape(count, 1, *k), None, k, [0, 0], [1, 1], True, [0, 0], 1
    )
    return result.reshape(n, c, h, w)
