"""Activation gradients as one operator of ours each in the plain backend's traces: ReLU's
(`threshold_backward`) and LeakyReLU's (`leaky_relu_backward`).

Both gradients are a product with a mask the input decides (ORT's CPU `Where`, which the
plain reading would use, ran four to ten times slower than a comparison, a cast and a
product). Written as those ATen operators, each gradient was three to six nodes, each traced
on fake tensors through aot's functionalization, partitioned and translated one by one:
ResNet-50's 49 ReLU gradients were 147 of its 638 traced operators, each gradient 3.8 ms of
the trace against 0.9 for a convolution. Here each is one node (1.9 ms), whose translation
(`TRANSLATIONS`) adds the comparison, cast and products torchlib made of the operators
before.

The operators apply where the mask's translation declares every value (`applies`: float32
or float64, one dtype, static sizes, gradient and input of one shape); their fake kernels
give the layout the decomposition gives (`_one_dense_layout`). Elsewhere the table keeps
the decomposition, the same arithmetic in ATen operators. Each gradient is written once, as
a mask of the activation and its product with the gradient (`Gradient`), over an arithmetic
in torch (the eager and fake kernels, the decompositions), in ONNX (the translations) and in
FX (the passes), so a translation can be held to the kernels (tests) and a graph run in
torch runs them.

What forward saves: an activation backward reads for its gradient alone is saved as the
boolean mask (`fx_passes.activation_masks_saved`), as the partitioner chose for the ATen
operators, one byte an element (a transformer layer's feed-forward saved its ReLU's output
in float beside its dropout's otherwise). Where the gradient meets dropout's mask, the
operator is written out again so that both masks multiply once
(`fx_passes.masks_multiplied_once`).

Numbers: ReLU's mask is ATen's test (an input passes unless at most the threshold, so a NaN
input passes its gradient), and the product with it differs from ATen only where the
gradient is infinite or NaN and the input masked (NaN, not 0), a step that loss scaling
rejects either way; LeakyReLU's factor is exactly 1 or the slope, so its gradient is ATen's
to the bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE as NAMESPACE
from ort_autopatch.engine.backends.ort.declared import Declared, declarable

aten = torch.ops.aten


class _Torch:
    """The formulas' arithmetic in torch (the operators' eager and fake kernels, and the
    decompositions where the operators do not apply)."""

    def mul(self, a: Any, b: Any) -> Any:
        return a * b

    def add(self, a: Any, b: Any) -> Any:
        return a + b

    def rsub(self, a: float, b: Any) -> Any:
        return a - b

    def le(self, a: Any, b: float) -> Any:
        return a <= b

    def gt(self, a: Any, b: float) -> Any:
        return a > b

    def not_(self, a: Any) -> Any:
        return ~a

    def typed(self, mask: Any, like: Any) -> Any:
        return mask.to(like.dtype)


class _Onnx:
    """The same arithmetic as ONNX nodes, the nodes torchlib made of the ATen operators
    (a Python number a constant of the gradient's type), every value declared with the
    gradient's type (comparisons: bool) and shape."""

    def __init__(self, like: Any) -> None:
        self.d = Declared(like)

    def _value(self, value: Any, boolean: bool = False) -> Any:
        from onnxscript import ir

        if boolean:
            value.dtype = ir.DataType.BOOL
        return self.d.shaped(self.d.sizes)(value)

    def _const(self, value: Any) -> Any:
        return self.d.scalar(float(value)) if isinstance(value, (int, float)) else value

    def mul(self, a: Any, b: Any) -> Any:
        from onnxscript import opset18 as op

        return self._value(op.Mul(a, self._const(b)))

    def add(self, a: Any, b: Any) -> Any:
        from onnxscript import opset18 as op

        return self._value(op.Add(a, self._const(b)))

    def rsub(self, a: float, b: Any) -> Any:
        from onnxscript import opset18 as op

        return self._value(op.Sub(self._const(a), b))

    def le(self, a: Any, b: float) -> Any:
        from onnxscript import opset18 as op

        return self._value(op.LessOrEqual(a, self._const(b)), boolean=True)

    def gt(self, a: Any, b: float) -> Any:
        from onnxscript import opset18 as op

        return self._value(op.Greater(a, self._const(b)), boolean=True)

    def not_(self, a: Any) -> Any:
        from onnxscript import opset18 as op

        return self._value(op.Not(a), boolean=True)

    def typed(self, mask: Any, like: Any) -> Any:
        from onnxscript import opset18 as op

        return self._value(op.Cast(mask, to=self.d.dtype))


class Fx:
    """The same arithmetic as ATen nodes of an FX graph, each value's fake tensor made by
    the operator itself (the passes that move a gradient's mask between forward and
    backward: `fx_passes.activation_masks_saved`, `fx_passes.masks_multiplied_once`)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph

    def _node(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        mode = next(
            (getattr(v, "fake_mode", None) for v in values if hasattr(v, "fake_mode")), None
        )
        with mode if mode is not None else contextlib.nullcontext():
            value = target(*values, **kwargs)
        node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = value
        return node

    def mul(self, a: Any, b: Any) -> Any:
        return self._node(aten.mul.Tensor, a, b)

    def add(self, a: Any, b: Any) -> Any:
        return self._node(aten.add.Tensor, a, b)

    def rsub(self, a: float, b: Any) -> Any:
        return self._node(aten.sub.Tensor, a, b)  # as the table decomposes `rsub`

    def le(self, a: Any, b: float) -> Any:
        return self._node(aten.le.Scalar, a, b)

    def gt(self, a: Any, b: float) -> Any:
        return self._node(aten.gt.Scalar, a, b)

    def not_(self, a: Any) -> Any:
        return self._node(aten.bitwise_not.default, a)

    def typed(self, mask: Any, like: Any) -> Any:
        return self._node(aten._to_copy.default, mask, dtype=like.meta["val"].dtype)


_TORCH = _Torch()


@dataclass(frozen=True)
class Gradient:
    """An activation's gradient as a mask of the activation (`mask(o, x, arg)`, boolean)
    and its product with the gradient (`apply(o, g, mask, arg)`), in any arithmetic `o`
    (`_Torch`, `_Onnx`, `Fx`); `arg` is the operator's last argument (the threshold, the
    slope). Written once, for the kernels, the translations and the passes alike."""

    mask: Callable[[Any, Any, Any], Any]
    apply: Callable[[Any, Any, Any, Any], Any]

    def __call__(self, o: Any, grad_output: Any, self_: Any, arg: Any) -> Any:
        return self.apply(o, grad_output, self.mask(o, self_, arg), arg)


def _leaky_factor(o: Any, grad_output: Any, positive: Any, slope: Any) -> Any:
    factor = o.typed(positive, grad_output)
    return o.mul(grad_output, o.add(factor, o.mul(o.rsub(1.0, factor), slope)))


#: ReLU's: not "at most the threshold", as ATen's kernel decides (a NaN input passes its
#: gradient)
RELU = Gradient(
    mask=lambda o, x, threshold: o.not_(o.le(x, threshold)),
    apply=lambda o, g, mask, threshold: o.mul(g, o.typed(mask, g)),
)
#: LeakyReLU's: a factor exactly 1 where the input is positive, exactly the slope elsewhere
LEAKY_RELU = Gradient(mask=lambda o, x, slope: o.gt(x, 0.0), apply=_leaky_factor)


def _one_dense_layout(grad_output: torch.Tensor, self: torch.Tensor) -> bool:
    """Whether the product's layout is the gradient's: both of one layout, contiguous or
    channels last. The fake kernels then make it directly (half the trace's time for the
    operator); elsewhere they run the decomposition on fake tensors, whose layout the trace
    recorded before."""
    if grad_output.stride() != self.stride():
        return False
    return any(grad_output.is_contiguous(memory_format=layout) for layout in _DENSE)


#: layouts whose strides a product of two tensors of that layout keeps
_DENSE = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


@torch.library.custom_op(f"{NAMESPACE}::threshold_backward", mutates_args=())
def threshold_backward_operator(
    grad_output: torch.Tensor, self: torch.Tensor, threshold: float
) -> torch.Tensor:
    """ReLU's (and `F.threshold`'s) gradient: `grad_output` where `self` is above
    `threshold`, else 0."""
    return RELU(_TORCH, grad_output, self, threshold)


@torch.library.custom_op(f"{NAMESPACE}::leaky_relu_backward", mutates_args=())
def leaky_relu_backward_operator(
    grad_output: torch.Tensor, self: torch.Tensor, negative_slope: float
) -> torch.Tensor:
    """LeakyReLU's gradient: `grad_output` where `self` is positive, else `grad_output` times
    the slope (NaN inputs take the slope, as in ATen)."""
    return LEAKY_RELU(_TORCH, grad_output, self, negative_slope)


def _fake(gradient: Gradient) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """A gradient operator's fake kernel: the gradient's layout where `_one_dense_layout`
    says it is the product's, else the formula on fake tensors."""

    def fake(grad_output: torch.Tensor, self: torch.Tensor, arg: float) -> torch.Tensor:
        if _one_dense_layout(grad_output, self):
            return torch.empty_like(grad_output)
        return gradient(_TORCH, grad_output, self, arg)

    return fake


threshold_backward_operator.register_fake(_fake(RELU))
leaky_relu_backward_operator.register_fake(_fake(LEAKY_RELU))


def applies(grad_output: torch.Tensor, self: torch.Tensor) -> bool:
    """Whether the operators take these tensors (see the module's docstring)."""
    return declarable(grad_output, self) and grad_output.shape == self.shape


def threshold_backward(
    grad_output: torch.Tensor, self: torch.Tensor, threshold: float
) -> torch.Tensor:
    """`aten.threshold_backward` for the trace: our operator where it `applies`, else the
    same product with the mask in ATen operators (ORT's CPU `Where` took 4x the time of a
    comparison, a Cast and a Mul: 33 ms against 8 on a transformer layer's activations; the
    `Not` the mask adds runs over bytes)."""
    if applies(grad_output, self):
        return torch.ops.ort_autopatch.threshold_backward(grad_output, self, threshold)
    return RELU(_TORCH, grad_output, self, threshold)


def leaky_relu_backward(
    grad_output: torch.Tensor, self: torch.Tensor, negative_slope: float, self_is_result: bool
) -> torch.Tensor:
    """`aten.leaky_relu_backward` for the trace: our operator where it `applies`, else the
    same product with a factor that is exactly 1 where the input is positive and exactly the
    slope elsewhere, in ATen operators (ORT's CPU `Where` ran 1.0 ms on a DCGAN
    discriminator's (16, 32, 16, 16) activations, this 0.1 ms). The factor never multiplies
    a gradient by 0, so infinite and NaN gradients come out as eager's too. `self_is_result`
    changes nothing: a positive slope keeps the sign."""
    if applies(grad_output, self):
        return torch.ops.ort_autopatch.leaky_relu_backward(grad_output, self, negative_slope)
    return LEAKY_RELU(_TORCH, grad_output, self, negative_slope)


def lower_threshold_backward(grad_output: Any, self: Any, threshold: float) -> Any:
    return RELU(_Onnx(grad_output), grad_output, self, threshold)


def lower_leaky_relu_backward(grad_output: Any, self: Any, negative_slope: float) -> Any:
    return LEAKY_RELU(_Onnx(grad_output), grad_output, self, negative_slope)


#: our gradient operators and their formulas (the passes rewrite the operators' nodes with
#: them: `fx_passes.activation_masks_saved`, `fx_passes.masks_multiplied_once`)
GRADIENTS: dict[Any, Gradient] = {
    torch.ops.ort_autopatch.threshold_backward.default: RELU,
    torch.ops.ort_autopatch.leaky_relu_backward.default: LEAKY_RELU,
}

#: our operators and their ONNX translations (`lowering.registry_for`)
TRANSLATIONS: dict[Any, Any] = {
    torch.ops.ort_autopatch.threshold_backward.default: lower_threshold_backward,
    torch.ops.ort_autopatch.leaky_relu_backward.default: lower_leaky_relu_backward,
}
