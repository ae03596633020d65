"""Types and shapes for the values the ONNX translations of our operators make (`norms`,
`convolutions`, `linears`, `matmuls`).

The translator gives every FX node's value its type and shape; a translation of ours adds
several ONNX nodes per FX node, and leaves their values undeclared unless it declares them.
A backward cut into stages (`stages`) declares the values crossing stages with their types
and shapes, and left whole the graphs where one had none (a small CNN's whole backward,
before the normalisations declared theirs). So each translation declares every value it
makes, with `Declared`; each operator applies where its tensors are `declarable`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: the types our operators take (half precision computes in float32 in ATen's kernels, and
#: the decompositions keep that)
TYPES = (torch.float32, torch.float64)


def declarable(*tensors: torch.Tensor | None) -> bool:
    """Whether our operators take these tensors (None: an argument not given, such as a
    missing bias): float32 or float64, all of one type, of static, non-zero sizes, so that
    every value a translation makes can be declared. (Symbolic sizes would make the
    translations' constants expressions; an empty batch would reach ORT's kernels as empty
    products: the decompositions take both.)"""
    given = [t for t in tensors if t is not None]
    if not given or given[0].dtype not in TYPES:
        return False
    if any(t.dtype != given[0].dtype for t in given):
        return False
    return all(type(size) is int and size > 0 for t in given for size in t.shape)


class Declared:
    """Declarations of values of one ONNX value's type (`like`, whose sizes must be known):
    `shaped` declares a value of that type and a given shape, `reshaped` reshapes one;
    `scalar`, `array` and `empty` make constants of that type."""

    def __init__(self, like: Any) -> None:
        shape = like.shape
        if shape is None or not all(isinstance(size, int) for size in shape):
            raise ValueError(f"the sizes of {like!r} are unknown")
        self.dtype, self.sizes, self.rank = like.dtype, [int(s) for s in shape], len(shape)

    def shaped(self, sizes: Sequence[int]) -> Callable[[Any], Any]:
        """Declares a value (and returns it) of the type and `sizes`."""
        from onnxscript import ir

        shape = ir.Shape(list(sizes))

        def given(value: Any) -> Any:
            if value.dtype is None:
                value.dtype = self.dtype
            if value.shape is None:
                value.shape = shape
            return value

        return given

    def scalar(self, value: float) -> Any:
        """`value` as a constant of the type, rounded once from Python's double (a float
        constant cast to float64 would carry float32's rounding: eps came out
        1e-5 + 2.5e-13)."""
        import numpy as np

        return self.array(np.array(value))

    def array(self, values: Any) -> Any:
        """A numpy array as a constant of the type, declared with the array's shape."""
        import numpy as np
        from onnxscript import ir
        from onnxscript import opset18 as op

        array = np.asarray(values, dtype=self.dtype.numpy())
        constant: Any = ir.tensor(array)
        return self.shaped(array.shape)(op.Constant(value=constant))

    def reshaped(self, value: Any, sizes: Sequence[int]) -> Any:
        """`value` (of the type) reshaped to `sizes`, declared."""
        from onnxscript import opset18 as op

        shape: Any = op.Constant(value_ints=list(sizes))
        return self.shaped(sizes)(op.Reshape(value, shape))

    def empty(self) -> Any:
        """A gradient not asked for: an empty tensor of the type, which nothing reads."""
        import numpy as np

        return self.array(np.zeros(0))
