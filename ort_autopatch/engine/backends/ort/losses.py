"""Cross-entropy's gradient as operators of ours in the plain backend's traces: the gradient of
`nll_loss` over a batch of rows (`nll_loss_backward`), of `log_softmax` (`log_softmax_backward`),
and the two as one where the first feeds the second (`cross_entropy_backward`, made by
`fx_passes.cross_entropy_backward_fused`).

A language model's loss is a cross entropy over its vocabulary, whose gradient is the largest
elementwise work of its step: (tokens, vocabulary) floats, 125 MB for BERT-base at batch 8.
torch's decompositions made it eight passes over that tensor: zeros (an `Expand`), the one-hot
scattered into them, a product with each row's weight, the row sums of that, the
log-probabilities' exponent, its product with the sums, the difference, all beside the
decoder's own gradient (BERT-base MLM at batch 8, two threads: about 157 ms of a 4.4 s step in
ORT's profile). The gradient is
`a_i * (onehot_i - exp(log_probs_i))` with one number per row, `a_i = -weight[target_i] *
grad / total_weight` (0 where the target is ignored), so the fused operator's translation
makes the exponent, multiplies it by `-a_i` and adds `a_i` at each row's target: two passes
and a scatter of one value a row.

Numbers: the translations compute ATen's kernels' arithmetic in their order (the row's value
`weight * -(grad / total_weight)`, each element `0 - exp * a` or `a - exp * a`, negation
being exact), so a graph equals eager wherever ORT's `Exp` rounds as ATen's `exp` (the
unfused translation's `Exp` is the same node). The operators apply to a batch of rows
(`nll_loss` over (N, C) log-probabilities, `log_softmax` over any dimension) of float32 or
float64 of static sizes (`applies_*`); elsewhere torch's decompositions as before. Their
kernels are ATen's, so a graph run in torch runs them and tests hold the translations to
eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE as NAMESPACE
from ort_autopatch.engine.backends.ort.declared import Declared, declarable

aten = torch.ops.aten

#: ATen's reductions (`torch.nn._reduction`)
NONE, MEAN, SUM = 0, 1, 2


@torch.library.custom_op(f"{NAMESPACE}::nll_loss_backward", mutates_args=())
def nll_loss_backward_operator(
    grad_output: torch.Tensor,
    log_probs: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """ATen's `nll_loss_backward` over (N, C) log-probabilities."""
    return aten.nll_loss_backward(
        grad_output, log_probs, target, weight, reduction, ignore_index, total_weight
    )


def _like_log_probs(grad_output: torch.Tensor, log_probs: torch.Tensor, *rest: Any) -> torch.Tensor:
    """The fake kernel of both gradients of the log-probabilities (`nll_loss_backward`,
    `cross_entropy_backward`): a tensor like them."""
    return log_probs.new_empty(log_probs.shape)


nll_loss_backward_operator.register_fake(_like_log_probs)


@torch.library.custom_op(f"{NAMESPACE}::log_softmax_backward", mutates_args=())
def log_softmax_backward_operator(
    grad_output: torch.Tensor, output: torch.Tensor, dim: int
) -> torch.Tensor:
    """ATen's `_log_softmax_backward_data` in the output's type."""
    return aten._log_softmax_backward_data(grad_output, output, dim, output.dtype)


@log_softmax_backward_operator.register_fake
def _(grad_output: torch.Tensor, output: torch.Tensor, dim: int) -> torch.Tensor:
    return output.new_empty(output.shape)


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(
    grad_output: torch.Tensor,
    log_probs: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """The gradient of `nll_loss(log_softmax(x, 1), ...)` with respect to `x`, from the
    log-probabilities: ATen's two backward kernels in turn."""
    grad = aten.nll_loss_backward(
        grad_output, log_probs, target, weight, reduction, ignore_index, total_weight
    )
    return aten._log_softmax_backward_data(grad, log_probs, 1, log_probs.dtype)


cross_entropy_backward.register_fake(_like_log_probs)


NLL_LOSS_BACKWARD = torch.ops.ort_autopatch.nll_loss_backward.default
LOG_SOFTMAX_BACKWARD = torch.ops.ort_autopatch.log_softmax_backward.default
CROSS_ENTROPY_BACKWARD = torch.ops.ort_autopatch.cross_entropy_backward.default


def applies_nll(
    grad_output: torch.Tensor,
    log_probs: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    total_weight: torch.Tensor,
) -> bool:
    """Whether the operator takes this `nll_loss_backward`: a batch of rows (N, C), int64
    targets (N,), a gradient of the reduction's shape, all floats of one type and static
    sizes."""
    if log_probs.dim() != 2 or target.dtype != torch.int64 or target.dim() != 1:
        return False
    if not declarable(log_probs, grad_output, weight, total_weight):
        return False  # (sizes compared below only once known static: no guard on a symbol)
    if type(target.shape[0]) is not int or target.shape != log_probs.shape[:1]:
        return False
    if reduction not in (NONE, MEAN, SUM) or total_weight.dim() != 0:
        return False
    if grad_output.shape != (log_probs.shape[:1] if reduction == NONE else ()):
        return False
    return weight is None or weight.shape == log_probs.shape[1:]


def nll_loss_backward(
    grad_output: torch.Tensor,
    log_probs: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """`aten.nll_loss_backward` for the trace: the operator where it applies, else torch's
    decomposition."""
    args = (grad_output, log_probs, target, weight, reduction, ignore_index, total_weight)
    if applies_nll(grad_output, log_probs, target, weight, reduction, total_weight):
        return NLL_LOSS_BACKWARD(*args)
    return _torchs(aten.nll_loss_backward.default)(*args)


def log_softmax_backward(
    grad_output: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype
) -> torch.Tensor:
    """`aten._log_softmax_backward_data` for the trace: the operator over tensors of one float
    type (no half-precision input) and static sizes, else torch's decomposition."""
    if input_dtype == output.dtype and output.dim() > 0 and declarable(grad_output, output):
        return LOG_SOFTMAX_BACKWARD(grad_output, output, dim % output.dim())
    return _torchs(aten._log_softmax_backward_data.default)(grad_output, output, dim, input_dtype)


def _torchs(op: Any) -> Callable[..., Any]:
    """torch's own decomposition of `op`."""
    return torch._decomp.decomposition_table[op]


# --- translations -----------------------------------------------------------------------------


def _row_values(
    grad_output: Any,
    target: Any,
    weight: Any,
    reduction: int,
    ignore_index: int,
    total_weight: Any,
    d: Declared,
) -> tuple[Any, Any]:
    """Each row's target with ignored rows sent to column 0, as (N, 1) int64, and each row's
    value of the gradient at its target (0 for an ignored row), as (N, 1): ATen's kernel's
    `weight[t] * -(grad / total_weight)` (no division for `sum`, a gradient per row for
    `none`)."""
    from onnxscript import ir
    from onnxscript import opset18 as op

    rows = d.sizes[0]
    row, column = d.shaped([rows]), d.shaped([rows, 1])
    targets = Declared(target)  # int64 (N,)
    ignored: Any = op.Equal(target, op.Constant(value_int=ignore_index))
    ignored.dtype = ir.DataType.BOOL
    kept: Any = op.Not(targets.shaped([rows])(ignored))
    kept.dtype = ir.DataType.BOOL
    kept = targets.shaped([rows])(kept)
    safe = targets.shaped([rows])(op.Where(kept, target, op.Constant(value_int=0)))
    scaled = grad_output
    if reduction == MEAN:
        scaled = d.shaped([])(op.Div(grad_output, total_weight))
    negated = d.shaped([] if reduction != NONE else [rows])(op.Neg(scaled))
    if weight is not None:
        negated = row(op.Mul(row(op.Gather(weight, safe, axis=0)), negated))
    value = row(op.Where(kept, negated, d.scalar(0.0)))  # (a scalar broadcast to the rows)
    axis: Any = op.Constant(value_ints=[1])
    index = targets.shaped([rows, 1])(op.Unsqueeze(safe, axis))
    return index, column(op.Unsqueeze(value, axis))


def lower_nll_loss_backward(
    grad_output: Any,
    log_probs: Any,
    target: Any,
    weight: Any,
    reduction: int,
    ignore_index: int,
    total_weight: Any,
) -> Any:
    """Zeros with each row's value at its target (`ScatterElements` into `ConstantOfShape`)."""
    import numpy as np
    from onnxscript import ir
    from onnxscript import opset18 as op

    d = Declared(log_probs)
    full = d.shaped(d.sizes)
    index, value = _row_values(
        grad_output, target, weight, reduction, ignore_index, total_weight, d
    )
    zero: Any = ir.tensor(np.zeros(1, dtype=d.dtype.numpy()))
    shape: Any = op.Constant(value_ints=d.sizes)
    zeros = full(op.ConstantOfShape(shape, value=zero))
    return full(op.ScatterElements(zeros, index, value, axis=1))


def lower_log_softmax_backward(grad_output: Any, output: Any, dim: int) -> Any:
    """torch's decomposition's arithmetic: `grad - exp(output) * sum(grad, dim)`."""
    from onnxscript import opset18 as op

    d = Declared(output)
    full = d.shaped(d.sizes)
    summed_sizes = [1 if k == dim else s for k, s in enumerate(d.sizes)]
    axes: Any = op.Constant(value_ints=[dim])
    summed = d.shaped(summed_sizes)(op.ReduceSum(grad_output, axes, keepdims=1))
    return full(op.Sub(grad_output, full(op.Mul(full(op.Exp(output)), summed))))


def lower_cross_entropy_backward(
    grad_output: Any,
    log_probs: Any,
    target: Any,
    weight: Any,
    reduction: int,
    ignore_index: int,
    total_weight: Any,
) -> Any:
    """`exp(log_probs) * -a`, then `a` added at each row's target: two passes over the
    (N, C) tensor and one value a row."""
    from onnxscript import opset18 as op

    d = Declared(log_probs)
    full = d.shaped(d.sizes)
    index, value = _row_values(
        grad_output, target, weight, reduction, ignore_index, total_weight, d
    )
    negated = d.shaped([d.sizes[0], 1])(op.Neg(value))
    spread = full(op.Mul(full(op.Exp(log_probs)), negated))
    return full(op.ScatterElements(spread, index, value, axis=1, reduction="add"))


#: our operators and their ONNX translations (`lowering.registry_for`)
TRANSLATIONS: dict[Any, Any] = {
    NLL_LOSS_BACKWARD: lower_nll_loss_backward,
    LOG_SOFTMAX_BACKWARD: lower_log_softmax_backward,
    CROSS_ENTROPY_BACKWARD: lower_cross_entropy_backward,
}
