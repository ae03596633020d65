"""Normalisations as operators of ours in the plain backend's traces: BatchNorm in train mode
one each way, forward and backward, and LayerNorm's backward (its forward is torchlib's
LayerNormalization). Each translates to the ONNX nodes the decompositions made before.

Decomposed, a BatchNorm is about fifteen forward operators (the statistics, the scale and
shift, the running statistics' update) and about twenty backward ones, and a LayerNorm's
backward about fifteen, each traced on fake tensors through aot's functionalization,
partitioned and translated one by one. ResNet-50's 53 BatchNorms were half of its first call:
the same network with the BatchNorms taken out traced in 1.4 s against 4.3 s, and lowered in
0.6 s against 1.3 s. Here each is one node (`batch_norm_training`,
`batch_norm_training_backward`, `layer_norm_backward`) whose translation (`TRANSLATIONS`)
adds the same arithmetic, in the same order, to the ONNX graph.

The arithmetic is the decompositions': BatchNorm's forward in six passes over the input
(mean, centre, square, mean, one scale and one shift per channel: `decomposed_batch_norm`),
the backwards torch's `native_batch_norm_backward` (train mode) and
`native_layer_norm_backward`. A float32 BatchNorm on the CPU translates its forward to ONNX
Runtime's own kernel instead (`one_kernel`), which makes the same statistics in three
passes. The operators' eager kernels compute the same in torch, so a translation can be held
to them (tests) and a graph run in torch runs them. The
decompositions decide where the operators apply: float32 or float64, weight and bias given,
static sizes (the running variance's correction and 1 / N are constants); elsewhere the
decompositions as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE as NAMESPACE
from ort_autopatch.engine.backends.ort.declared import Declared, declarable

aten = torch.ops.aten


def _channel_shape(rank: int) -> list[int]:
    """(1, C, 1, ...): a per-channel value broadcast against an input of `rank`."""
    return [1, -1] + [1] * (rank - 2)


def _reduced(rank: int) -> list[int]:
    """Every dimension but the channels'."""
    return [0, *range(2, rank)]


@torch.library.custom_op(f"{NAMESPACE}::batch_norm_training", mutates_args=())
def batch_norm_training(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
    correction: float,
    one_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BatchNorm of `input` (N, C, ...) over its batch statistics: the output, the saved
    mean and inverse deviation (C,), and the new running mean and variance (the variance's
    update takes the batch variance times `correction`, N / (N - 1) over N values a
    channel). `one_kernel` says how it translates (`one_kernel`), not what it computes."""
    shape = _channel_shape(input.dim())
    mean, centred, variance, rstd = _batch_statistics(input, eps)
    output = centred * (rstd * weight.reshape(shape)) + bias.reshape(shape)
    new_mean, new_var = _running(mean, variance, running_mean, running_var, momentum, correction)
    return output, mean.flatten(), rstd.flatten(), new_mean, new_var


def _batch_statistics(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """Per channel (shaped to broadcast): the mean, the centred input, the variance and the
    inverse deviation, in four passes over the input (mean, centre, square, mean)."""
    dims = _reduced(x.dim())
    mean = x.mean(dims, keepdim=True)
    centred = x - mean
    variance = (centred * centred).mean(dims, keepdim=True)
    return mean, centred, variance, torch.rsqrt(variance + eps)


def _running(
    mean: torch.Tensor,
    variance: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    correction: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running statistics' update, from the batch's (the variance times `correction`)."""
    new_mean = momentum * mean.flatten() + (1 - momentum) * running_mean
    new_var = momentum * variance.flatten() * correction + (1 - momentum) * running_var
    return new_mean, new_var


@batch_norm_training.register_fake
def _(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
    correction: float,
    one_kernel: bool,
) -> tuple[torch.Tensor, ...]:
    channels = (input.shape[1],)
    return (
        torch.empty_like(input),  # the layout ATen's kernel and the decomposition give
        input.new_empty(channels),
        input.new_empty(channels),
        running_mean.new_empty(channels),
        running_var.new_empty(channels),
    )


@torch.library.custom_op(f"{NAMESPACE}::batch_norm_training_backward", mutates_args=())
def batch_norm_training_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    save_mean: torch.Tensor,
    save_rstd: torch.Tensor,
    norm: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the input, weight and bias of a BatchNorm in train mode, from its
    saved statistics; `norm` is 1 / N over N values a channel. torch's decomposition of
    `native_batch_norm_backward` (train mode), its terms in its order."""
    dims = _reduced(input.dim())
    shape = _channel_shape(input.dim())
    centred = input - save_mean.reshape(shape)
    grad_output_sum = grad_output.sum(dims)
    dot = (grad_output * centred).sum(dims)
    grad_mean = (grad_output_sum * norm).reshape(shape)
    proj_scale = ((dot * norm) * (save_rstd * save_rstd)).reshape(shape)
    grad_scale = (save_rstd * weight).reshape(shape)
    grad_input = ((grad_output - centred * proj_scale) - grad_mean) * grad_scale
    return grad_input, dot * save_rstd, grad_output_sum


@batch_norm_training_backward.register_fake
def _(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    save_mean: torch.Tensor,
    save_rstd: torch.Tensor,
    norm: float,
) -> tuple[torch.Tensor, ...]:
    channels = (input.shape[1],)
    return (
        torch.empty_like(input),
        weight.new_empty(channels),
        weight.new_empty(channels),
    )


def _static_and_whole(input: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether our operators can take these tensors: every one given (a BatchNorm without
    affine parameters is the decompositions'), and all `declarable` (N / (N - 1) and 1 / N
    are constants of the translations)."""
    return all(other is not None for other in others) and declarable(input, *others)


def one_kernel(input: torch.Tensor) -> bool:
    """Whether a BatchNorm's forward translates to ONNX Runtime's own kernel in training mode
    (`BatchNormalization`, `training_mode` 1) instead of six passes over the input: a float32
    input on the CPU.

    With momentum 0 and zero running statistics in (`_fresh_zeros`), that kernel's running
    statistics out are the batch's mean and biased variance, so one node gives the output and
    the statistics the saved values and the running update are made of. It makes three passes
    where the translation's nodes make six: ResNet-50's BatchNorms, one each of its nine input
    shapes at batch 2, 4.8 -> 3.2 ms (two threads). CUDA's and ROCm's kernels refuse training
    mode at opset 14 and later, and its epsilon is an attribute, a float32: a float64 BatchNorm
    keeps the passes, which add the epsilon in float64 as ATen does."""
    return input.device.type == "cpu" and input.dtype == torch.float32


def batch_norm_operators(input: torch.Tensor, *others: torch.Tensor | None) -> int | None:
    """N, the values each channel's statistics are over, where our operators take this
    BatchNorm (an input of rank 2 or more, `_static_and_whole`); else None (the
    decompositions)."""
    if input.dim() < 2 or not _static_and_whole(input, *others):
        return None
    return math.prod([input.shape[0], *input.shape[2:]])


def decomposed_batch_norm(
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
    computation = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    mean, centred, variance, rstd = _batch_statistics(input.to(computation), eps)
    scale = rstd if weight is None else rstd * weight.flatten().reshape(mean.shape)
    output = centred * scale
    if bias is not None:
        output = output + bias.flatten().reshape(mean.shape)
    count = input.numel() / input.shape[1]
    correction = count / (count - 1)
    new_mean, new_var = _running(mean, variance, running_mean, running_var, momentum, correction)
    # the saved statistics stay in the computation's precision, as ATen's kernel keeps them
    return output.to(input.dtype), mean.flatten(), rstd.flatten(), new_mean, new_var


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
    """`aten._native_batch_norm_legit_functional`: our operator in train mode where it
    applies (`batch_norm_operators`), else `decomposed_batch_norm`."""
    values = batch_norm_operators(input, weight, bias, running_mean, running_var)
    if not training or values is None:
        return decomposed_batch_norm(
            input, weight, bias, running_mean, running_var, training, momentum, eps
        )
    assert weight is not None and bias is not None
    # N / (N - 1) in Python's double, as the decomposition computes it (one value: inf)
    correction = values / (values - 1) if values > 1 else math.inf
    return tuple(
        batch_norm_training(
            input,
            weight,
            bias,
            running_mean,
            running_var,
            momentum,
            eps,
            correction,
            one_kernel(input),
        )
    )


def native_batch_norm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    train: bool,
    eps: float,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`aten.native_batch_norm_backward`: our operator for train mode where it applies and
    the input's gradient is asked for; else torch's decomposition. Gradients not asked for
    are None, as the decomposition returns them (the operator's are a per-channel product
    and a sum the input's gradient computes anyway)."""
    values = batch_norm_operators(input, grad_out, weight, save_mean, save_invstd)
    if not train or not output_mask[0] or values is None:
        from torch._decomp import decompositions as torch_decompositions

        return torch_decompositions.native_batch_norm_backward(
            grad_out,
            input,
            weight,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            train,
            eps,
            list(output_mask),
        )
    assert weight is not None and save_mean is not None and save_invstd is not None
    grad_input, grad_weight, grad_bias = batch_norm_training_backward(
        grad_out, input, weight, save_mean, save_invstd, 1.0 / values
    )
    return (
        grad_input,
        grad_weight if output_mask[1] else None,
        grad_bias if output_mask[2] else None,
    )


@torch.library.custom_op(f"{NAMESPACE}::layer_norm_backward", mutates_args=())
def layer_norm_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    inner: int,
    asked: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the input, weight and bias of a LayerNorm over the last `inner`
    dimensions, from its saved mean and inverse deviation (shaped as the input, with those
    dimensions 1): torch's decomposition of `native_layer_norm_backward`, its terms in its
    order. The weight's and the bias's only where `asked` (two flags); else empty."""
    rank = input.dim()
    inner_dims, outer_dims = list(range(rank - inner, rank)), list(range(rank - inner))
    n = math.prod(input.shape[rank - inner :])
    x_hat = (input - mean) * rstd
    grad_x_hat = grad_output * weight
    a = grad_x_hat * n
    b = grad_x_hat.sum(inner_dims, keepdim=True)
    c3 = x_hat * (grad_x_hat * x_hat).sum(inner_dims, keepdim=True)
    grad_input = (rstd / n) * (a - b - c3)
    grad_weight = (grad_output * x_hat).sum(outer_dims) if asked[0] else input.new_empty(0)
    grad_bias = grad_output.sum(outer_dims) if asked[1] else input.new_empty(0)
    return grad_input, grad_weight, grad_bias


@layer_norm_backward.register_fake
def _(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    inner: int,
    asked: list[bool],
) -> tuple[torch.Tensor, ...]:
    return (
        input.new_empty(input.shape),
        weight.new_empty(weight.shape if asked[0] else (0,)),
        weight.new_empty(weight.shape if asked[1] else (0,)),
    )


def native_layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> Any:
    """`aten.native_layer_norm`: torchlib's LayerNormalization (NotImplemented: the trace
    keeps the operator), except in float64. ONNX's LayerNormalization keeps its mean and
    inverse deviation in float32 at most (`stash_type`), where ATen's are float64: ORT
    refused every float64 LayerNorm's training graph (the backward's reads declared double,
    the statistics float). There, torch's decomposition, in float64 throughout."""
    if input.dtype != torch.float64:
        return NotImplemented
    from torch._decomp import decomposition_table

    decomposition = decomposition_table[aten.native_layer_norm.default]  # torch._refs'
    return decomposition(input, list(normalized_shape), weight, bias, eps)


def native_layer_norm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`aten.native_layer_norm_backward`: our operator where it applies (float32 or float64,
    weight and bias given, static sizes, a dimension outside the normalised ones, the input's
    gradient asked for), else torch's decomposition. Gradients not asked for are None, as
    the decomposition returns them, and are not computed."""
    inner = len(normalized_shape)
    if not (
        output_mask[0]
        and 0 < inner < input.dim()
        and _static_and_whole(input, grad_out, mean, rstd, weight, bias)
    ):
        from torch._decomp import decompositions as torch_decompositions

        return torch_decompositions.native_layer_norm_backward(
            grad_out, input, list(normalized_shape), mean, rstd, weight, bias, list(output_mask)
        )
    assert weight is not None
    while mean.dim() < input.dim():  # as the decomposition takes them (`_unsqueeze_to_dim`)
        mean, rstd = mean.unsqueeze(-1), rstd.unsqueeze(-1)
    grad_input, grad_weight, grad_bias = layer_norm_backward(
        grad_out.contiguous(), input.contiguous(), mean, rstd, weight, inner, list(output_mask[1:])
    )
    return (
        grad_input,
        grad_weight if output_mask[1] else None,
        grad_bias if output_mask[2] else None,
    )


def _per_channel(d: Declared) -> tuple[Callable[[Any], Any], ...]:
    """The declarations of a BatchNorm's values: the input's shape, (C,), (1, C, 1, ...)."""
    channels = d.sizes[1]
    broadcast = [1, channels] + [1] * (d.rank - 2)
    return d.shaped(d.sizes), d.shaped([channels]), d.shaped(broadcast)


def lower_batch_norm_training(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    momentum: float,
    eps: float,
    correction: float,
    one_kernel: bool,
) -> Any:
    from onnxscript import opset18 as op

    d = Declared(input)
    full, channel, _ = _per_channel(d)
    if one_kernel:  # ORT's kernel: the output, the batch's mean and biased variance
        normalised, mean, variance = op.BatchNormalization(
            input,
            weight,
            bias,
            _fresh_zeros(weight, d),
            _fresh_zeros(bias, d),
            epsilon=eps,
            momentum=0.0,
            training_mode=1,
        )
        output, save_mean, variance_flat = full(normalised), channel(mean), channel(variance)
        add_eps = channel(op.Add(variance_flat, d.scalar(eps)))
        save_rstd = channel(op.Reciprocal(channel(op.Sqrt(add_eps))))
    else:
        output, save_mean, variance_flat, save_rstd = _six_passes(input, weight, bias, eps, d)
    kept = 1 - momentum
    new_mean = channel(
        op.Add(
            channel(op.Mul(save_mean, d.scalar(momentum))),
            channel(op.Mul(running_mean, d.scalar(kept))),
        )
    )
    new_var = channel(
        op.Add(
            channel(
                op.Mul(channel(op.Mul(variance_flat, d.scalar(momentum))), d.scalar(correction))
            ),
            channel(op.Mul(running_var, d.scalar(kept))),
        )
    )
    return output, save_mean, save_rstd, new_mean, new_var


def _fresh_zeros(like: Any, d: Declared) -> Any:
    """Zeros of `like`'s shape made by this run (`like < like` is false for every value, a NaN
    or an infinity too). ORT's kernel writes its statistics over its running-statistics
    inputs (the kernel aliases outputs 1 and 2 to inputs 3 and 4): fed one constant for both,
    the variance overwrote the mean, and a constant would carry one run's statistics into
    the next. Each zeros here is its own tensor of this run, made from a different input so
    that no common-subexpression pass merges the two."""
    from onnxscript import ir
    from onnxscript import opset18 as op

    _, channel, _ = _per_channel(d)
    never: Any = op.Less(like, like)
    never.dtype = ir.DataType.BOOL
    return channel(op.Cast(channel(never), to=d.dtype))


def _six_passes(input: Any, weight: Any, bias: Any, eps: float, d: Declared) -> Any:
    """BatchNorm in train mode as ONNX arithmetic: the output, the saved mean, the batch's
    biased variance and the inverse deviation (each (C,)), in six passes over the input (mean,
    centre, square, mean, one scale and one shift per channel: `decomposed_batch_norm`)."""
    from onnxscript import opset18 as op

    full, channel, wide = _per_channel(d)
    axes: Any = op.Constant(value_ints=_reduced(d.rank))
    shape: Any = op.Constant(value_ints=_channel_shape(d.rank))
    flat: Any = op.Constant(value_ints=[-1])
    mean = wide(op.ReduceMean(input, axes, keepdims=1))
    centred = full(op.Sub(input, mean))
    variance = wide(op.ReduceMean(full(op.Mul(centred, centred)), axes, keepdims=1))
    rstd = wide(op.Reciprocal(wide(op.Sqrt(wide(op.Add(variance, d.scalar(eps)))))))
    scale = wide(op.Mul(rstd, wide(op.Reshape(weight, shape))))
    output = full(op.Add(full(op.Mul(centred, scale)), wide(op.Reshape(bias, shape))))
    return (
        output,
        channel(op.Reshape(mean, flat)),
        channel(op.Reshape(variance, flat)),
        channel(op.Reshape(rstd, flat)),
    )


def lower_batch_norm_training_backward(
    grad_output: Any, input: Any, weight: Any, save_mean: Any, save_rstd: Any, norm: float
) -> Any:
    from onnxscript import opset18 as op

    d = Declared(input)
    full, channel, wide = _per_channel(d)
    axes: Any = op.Constant(value_ints=_reduced(d.rank))
    shape: Any = op.Constant(value_ints=_channel_shape(d.rank))
    centred = full(op.Sub(input, wide(op.Reshape(save_mean, shape))))
    grad_output_sum = channel(op.ReduceSum(grad_output, axes, keepdims=0))
    dot = channel(op.ReduceSum(full(op.Mul(grad_output, centred)), axes, keepdims=0))
    scale = d.scalar(norm)
    grad_mean = wide(op.Reshape(channel(op.Mul(grad_output_sum, scale)), shape))
    square = channel(op.Mul(save_rstd, save_rstd))
    proj_scale = wide(op.Reshape(channel(op.Mul(channel(op.Mul(dot, scale)), square)), shape))
    grad_scale = wide(op.Reshape(channel(op.Mul(save_rstd, weight)), shape))
    projected = full(op.Sub(grad_output, full(op.Mul(centred, proj_scale))))
    grad_input = full(op.Mul(full(op.Sub(projected, grad_mean)), grad_scale))
    return grad_input, channel(op.Mul(dot, save_rstd)), grad_output_sum


def lower_layer_norm_backward(
    grad_output: Any,
    input: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    inner: int,
    asked: Sequence[bool],
) -> Any:
    from onnxscript import opset18 as op

    d = Declared(input)
    full = d.shaped(d.sizes)
    outer = d.sizes[: d.rank - inner]
    stats = d.shaped(outer + [1] * inner)
    params = d.shaped(d.sizes[d.rank - inner :])
    inner_axes: Any = op.Constant(value_ints=list(range(d.rank - inner, d.rank)))
    outer_axes: Any = op.Constant(value_ints=list(range(d.rank - inner)))
    n = d.scalar(math.prod(d.sizes[d.rank - inner :]))
    x_hat = full(op.Mul(full(op.Sub(input, mean)), rstd))
    grad_x_hat = full(op.Mul(grad_output, weight))
    a = full(op.Mul(grad_x_hat, n))
    b = stats(op.ReduceSum(grad_x_hat, inner_axes, keepdims=1))
    c2 = stats(op.ReduceSum(full(op.Mul(grad_x_hat, x_hat)), inner_axes, keepdims=1))
    c3 = full(op.Mul(x_hat, c2))
    grad_input = full(op.Mul(stats(op.Div(rstd, n)), full(op.Sub(full(op.Sub(a, b)), c3))))
    grad_weight = (
        params(op.ReduceSum(full(op.Mul(grad_output, x_hat)), outer_axes, keepdims=0))
        if asked[0]
        else d.empty()
    )
    grad_bias = params(op.ReduceSum(grad_output, outer_axes, keepdims=0)) if asked[1] else d.empty()
    return grad_input, grad_weight, grad_bias


#: our operators and their ONNX translations (`lowering.registry_for`)
TRANSLATIONS: dict[Any, Any] = {
    torch.ops.ort_autopatch.batch_norm_training.default: lower_batch_norm_training,
    torch.ops.ort_autopatch.batch_norm_training_backward.default: (
        lower_batch_norm_training_backward
    ),
    torch.ops.ort_autopatch.layer_norm_backward.default: lower_layer_norm_backward,
}
