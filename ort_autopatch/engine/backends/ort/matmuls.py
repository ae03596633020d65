"""Batched matrix products (`torch.matmul` of two tensors of one batch shape, attention's
`q @ k.transpose(-2, -1)` and `scores @ v`) as one operator of ours each way in the plain
backend's traces: `matmul` forward, `matmul_backward` for the gradients autograd asks of it.

ATen's composite `matmul` over two 4-d tensors is about seven operators (each side expanded
and reshaped to three dimensions, a copy where a side is a transposed view, `bmm`, a view
back), and autograd differentiates them into about as many per gradient, each traced on fake
tensors through aot's functionalization, partitioned and translated one by one: BERT-base's
and GPT-2 small's attention products were a quarter of their traced operators. Here each is
one node each way: `matmul` replaces ATen's composite kernel while aot traces
(`decompositions.BEFORE_AUTOGRAD`), its autograd formula (`register_autograd`) calls
`matmul_backward`, and their translations (`TRANSLATIONS`) are ONNX `MatMul`s (the gradients'
with the other side transposed, which ONNX Runtime folds into its `FusedMatMul`).

The operators apply where no broadcasting happens (`applies`): two tensors of three or more
dimensions, of one batch shape, float32 or float64 of one type, of static, non-zero sizes.
Elsewhere (a matrix or a vector, batch dimensions that broadcast, half precision, symbolic
sizes) ATen's composite runs as before. The kernels compute in torch what the translations
compute, so a graph run in torch runs them and tests hold the translations to eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE as NAMESPACE
from ort_autopatch.engine.backends.ort.declared import Declared, declarable

aten = torch.ops.aten


@torch.library.custom_op(f"{NAMESPACE}::matmul", mutates_args=())
def matmul_operator(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` over one batch shape."""
    return torch.matmul(a, b)


@matmul_operator.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


@torch.library.custom_op(f"{NAMESPACE}::matmul_backward", mutates_args=())
def matmul_backward(
    grad_output: torch.Tensor, a: torch.Tensor, b: torch.Tensor, asked: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `matmul`'s two sides (`asked`: which; the other empty):
    `grad @ b^T` and `a^T @ grad`, the last two dimensions transposed."""
    grad_a = grad_output @ b.transpose(-2, -1) if asked[0] else a.new_empty(0)
    grad_b = a.transpose(-2, -1) @ grad_output if asked[1] else a.new_empty(0)
    return grad_a, grad_b


@matmul_backward.register_fake
def _(
    grad_output: torch.Tensor, a: torch.Tensor, b: torch.Tensor, asked: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        a.new_empty(a.shape if asked[0] else (0,)),
        a.new_empty(b.shape if asked[1] else (0,)),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    a, b = ctx.saved_tensors
    asked = [bool(n) for n in ctx.needs_input_grad[:2]]
    grads = matmul_backward(grad_output, a, b, asked)
    return tuple(g if n else None for g, n in zip(grads, asked, strict=True))


matmul_operator.register_autograd(_backward, setup_context=_setup_context)


def applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the operators' translations make what torchlib makes of ATen's composite here
    (see the module's docstring)."""
    if a.dim() < 3 or a.dim() != b.dim() or a.shape[:-2] != b.shape[:-2]:
        return False
    return a.shape[-1] == b.shape[-2] and declarable(a, b)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`aten.matmul` for the trace (in place of ATen's composite kernel): the operator where
    it applies, else ATen's composite."""
    if applies(a, b):
        return torch.ops.ort_autopatch.matmul(a, b)
    # ATen's own composite kernel (`decompose` would find this function in its place)
    composite = torch._C.DispatchKey.CompositeImplicitAutograd
    return aten.matmul.default._op_dk(composite, a, b)


def _swapped(rank: int) -> list[int]:
    """The permutation that transposes the last two of `rank` dimensions."""
    return [*range(rank - 2), rank - 1, rank - 2]


def lower_matmul(a: Any, b: Any) -> Any:
    from onnxscript import opset18 as op

    d, e = Declared(a), Declared(b)
    return d.shaped([*d.sizes[:-1], e.sizes[-1]])(op.MatMul(a, b))


def lower_matmul_backward(grad_output: Any, a: Any, b: Any, asked: Sequence[bool]) -> Any:
    from onnxscript import opset18 as op

    d, e = Declared(a), Declared(b)
    perm = _swapped(d.rank)
    if asked[0]:
        b_t = e.shaped([*e.sizes[:-2], e.sizes[-1], e.sizes[-2]])(op.Transpose(b, perm=perm))
        grad_a = d.shaped(d.sizes)(op.MatMul(grad_output, b_t))
    else:
        grad_a = d.empty()
    if asked[1]:
        a_t = d.shaped([*d.sizes[:-2], d.sizes[-1], d.sizes[-2]])(op.Transpose(a, perm=perm))
        grad_b = e.shaped(e.sizes)(op.MatMul(a_t, grad_output))
    else:
        grad_b = d.empty()
    return grad_a, grad_b


#: our operators and their ONNX translations (`lowering.registry_for`)
TRANSLATIONS: dict[Any, Any] = {
    torch.ops.ort_autopatch.matmul.default: lower_matmul,
    torch.ops.ort_autopatch.matmul_backward.default: lower_matmul_backward,
}
