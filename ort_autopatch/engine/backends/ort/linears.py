"""`nn.Linear` (`aten.linear`) as one operator of ours each way in the plain backend's traces:
`linear` forward, `linear_backward` for the gradients autograd asks of it.

ATen's composite `linear` is four operators over an input of more than two dimensions (a
view to two, the weight's transpose, `addmm`, a view back), and autograd differentiates them
into about eight more (the gradient's views, a product and transposes per gradient, the bias's
sum), each traced on fake tensors through aot's functionalization, partitioned and translated
one by one: BERT-base's 74 linears were about a third of its traced operators. Here each is
one node each way: `linear` replaces ATen's composite kernel while aot traces
(`decompositions.BEFORE_AUTOGRAD`), its autograd formula (`register_autograd`) calls
`linear_backward`, and their translations (`TRANSLATIONS`) add the ONNX nodes the
composite's operators were translated to: a `Gemm` of the input flattened to two dimensions
(a `MatMul` without bias), and for the gradients a `MatMul` each and the bias's `ReduceSum`.

The operators apply where the translation makes what torchlib makes of the composite
(`applies`): float32 or float64 tensors of one type and static, non-zero sizes, an input of
two or more dimensions, a weight matrix. Elsewhere (half precision, autocast, which casts
before this kernel runs, symbolic sizes, a vector input, an empty batch) ATen's composite runs
as before. The kernels
compute in torch what the translations compute, so a graph run in torch runs them and tests
hold the translations to eager.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE as NAMESPACE
from ort_autopatch.engine.backends.ort.declared import Declared, declarable

aten = torch.ops.aten


@torch.library.custom_op(f"{NAMESPACE}::linear", mutates_args=())
def linear_operator(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`input @ weight.T + bias`."""
    return torch.nn.functional.linear(input, weight, bias)


@linear_operator.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{NAMESPACE}::linear_backward", mutates_args=())
def linear_backward(
    grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, asked: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `linear`'s input, weight and bias (`asked`: which; the others
    empty): `grad @ weight`, `grad.T @ input` and the sum of `grad`, over the leading
    dimensions flattened."""
    out_features, in_features = weight.shape
    rows = grad_output.reshape(-1, out_features)
    grad_input = (rows @ weight).reshape(input.shape) if asked[0] else input.new_empty(0)
    grad_weight = rows.t() @ input.reshape(-1, in_features) if asked[1] else input.new_empty(0)
    grad_bias = rows.sum(0) if asked[2] else input.new_empty(0)
    return grad_input, grad_weight, grad_bias


@linear_backward.register_fake
def _(
    grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, asked: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shapes = (input.shape, weight.shape, weight.shape[:1])
    return tuple(  # type: ignore[return-value]
        input.new_empty(shape if a else (0,)) for a, shape in zip(asked, shapes, strict=True)
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    input, weight, bias = inputs
    ctx.save_for_backward(input, weight)
    ctx.has_bias = bias is not None


def _backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    input, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    asked = [bool(needs[0]), bool(needs[1]), bool(ctx.has_bias and needs[2])]
    grads = linear_backward(grad_output, input, weight, asked)
    return tuple(g if a else None for g, a in zip(grads, asked, strict=True))


linear_operator.register_autograd(_backward, setup_context=_setup_context)


def applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the operators' translations make what torchlib makes of ATen's composite here
    (see the module's docstring)."""
    if input.dim() < 2 or weight.dim() != 2 or (bias is not None and bias.dim() != 1):
        return False
    return declarable(input, weight, bias)


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`aten.linear` for the trace (in place of ATen's composite kernel): the operator where
    it applies, else ATen's composite."""
    if applies(input, weight, bias):
        return torch.ops.ort_autopatch.linear(input, weight, bias)
    # ATen's own composite kernel (`decompose` would find this function in its place)
    composite = torch._C.DispatchKey.CompositeImplicitAutograd
    return aten.linear.default._op_dk(composite, input, weight, bias)


def lower_linear(input: Any, weight: Any, bias: Any) -> Any:
    from onnxscript import opset18 as op

    d, w = Declared(input), Declared(weight)
    out_features, in_features = w.sizes
    lead = d.sizes[:-1]
    if bias is None:
        transposed = w.shaped([in_features, out_features])(op.Transpose(weight, perm=[1, 0]))
        return d.shaped([*lead, out_features])(op.MatMul(input, transposed))
    rows = math.prod(lead)
    flat = input if d.rank == 2 else d.reshaped(input, [rows, in_features])
    product = d.shaped([rows, out_features])(op.Gemm(flat, weight, bias, transB=1))
    return product if d.rank == 2 else d.reshaped(product, [*lead, out_features])


def lower_linear_backward(grad_output: Any, input: Any, weight: Any, asked: Sequence[bool]) -> Any:
    from onnxscript import opset18 as op

    d, w = Declared(input), Declared(weight)
    out_features, in_features = w.sizes
    rows = math.prod(d.sizes[:-1])
    flat = d.rank == 2  # the activations are matrices already
    flat_grad = grad_output if flat else d.reshaped(grad_output, [rows, out_features])
    if asked[0]:
        product = d.shaped([rows, in_features])(op.MatMul(flat_grad, weight))
        grad_input = product if flat else d.reshaped(product, d.sizes)
    else:
        grad_input = d.empty()
    if asked[1]:
        flat_input = input if flat else d.reshaped(input, [rows, in_features])
        transposed = d.shaped([out_features, rows])(op.Transpose(flat_grad, perm=[1, 0]))
        grad_weight = w.shaped(w.sizes)(op.MatMul(transposed, flat_input))
    else:
        grad_weight = d.empty()
    if asked[2]:
        first: Any = op.Constant(value_ints=[0])
        grad_bias = d.shaped([out_features])(op.ReduceSum(flat_grad, first, keepdims=0))
    else:
        grad_bias = d.empty()
    return grad_input, grad_weight, grad_bias


#: our operators and their ONNX translations (`lowering.registry_for`)
TRANSLATIONS: dict[Any, Any] = {
    torch.ops.ort_autopatch.linear.default: lower_linear,
    torch.ops.ort_autopatch.linear_backward.default: lower_linear_backward,
}
