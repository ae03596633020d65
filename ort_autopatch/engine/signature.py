"""What a call looks like to the cache: its tensors, its structure and its constants."""

from __future__ import annotations

import enum
import operator
from collections.abc import Hashable
from itertools import repeat
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ort_autopatch.engine import trees
from ort_autopatch.engine.calls import CallSpec
from ort_autopatch.engine.errors import MixedDevicesError, UnsupportedInputError

_CONSTANT_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    enum.Enum,
)

TensorSig = tuple[torch.dtype, int, torch.device, bool]


class FlatCall:
    """One call: its tensors in pytree's leaf order, its signature, and what a miss needs."""

    __slots__ = ("_shapes", "args", "call_spec", "kwargs", "signature", "tensors")

    def __init__(
        self,
        tensors: list[torch.Tensor],
        signature: Hashable,
        call_spec: CallSpec | None,  # built lazily: only a cache miss needs it
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.tensors = tensors
        self.signature = signature
        self.call_spec = call_spec
        self.args = args
        self.kwargs = kwargs
        self._shapes: tuple[tuple[int, ...], ...] | None = None

    def spec(self) -> CallSpec:
        if self.call_spec is None:
            self.call_spec = _call_spec(self.args, self.kwargs)
        return self.call_spec

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Read once per call: hot shapes, the key and the graph's checks all ask."""
        if self._shapes is None:
            self._shapes = tuple(map(tuple, map(_SHAPE, self.tensors)))
        return self._shapes


_SHAPE = operator.attrgetter("shape")
_TENSOR = torch.Tensor


def _tensor_sig(t: torch.Tensor) -> TensorSig:
    return (t.dtype, t.dim(), t.device, t.requires_grad)


def flatten_call(
    cls: str, args: tuple[Any, ...], kwargs: dict[str, Any], check_devices: bool = True
) -> FlatCall:
    """Split a call into its tensors and a hashable signature (structure, dtypes, ranks,
    devices, requires_grad and the values of non-tensor leaves)."""
    if all(map(isinstance, args, repeat(_TENSOR))) and (
        not kwargs or all(v is None or isinstance(v, _TENSOR) for v in kwargs.values())
    ):
        # The common case (tensors, and keywords that are tensors or None) without pytree's
        # cost, on every call, in C-level passes where it can; the tensors come in pytree's
        # leaf order, as `spec()` will number them.
        if kwargs:
            tensors = [*args, *(v for v in kwargs.values() if v is not None)]
            named = tuple((k, None if v is None else _tensor_sig(v)) for k, v in kwargs.items())
        else:
            tensors, named = list(args), ()
        sig: Hashable = (len(args), tuple(map(_tensor_sig, args)), named)
        if check_devices:
            _check_devices(cls, tensors)
        return FlatCall(tensors, sig, None, args, kwargs)
    leaves, spec = trees.flatten((args, kwargs))
    tensors = []
    parts: list[Hashable] = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            parts.append(_tensor_sig(leaf))
        elif isinstance(leaf, _CONSTANT_TYPES):
            parts.append((type(leaf), leaf))
        else:
            path = _leaf_path(args, kwargs, index)
            raise UnsupportedInputError(
                cls,
                f"argument {path} is a {type(leaf).__name__}, which a graph can neither take as a "
                "tensor nor bake in as a constant",
                "Pass tensors, Python numbers, strings or None (containers of them are fine)",
            )
    if check_devices:
        _check_devices(cls, tensors)
    return FlatCall(tensors, (spec, tuple(parts)), None, args, kwargs)


def _call_spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallSpec:
    leaves, spec = trees.flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return CallSpec(spec, constants, positions)


def _check_devices(cls: str, tensors: list[torch.Tensor]) -> None:
    if len(tensors) < 2:
        return
    first = tensors[0].device
    for t in tensors[1:]:
        if t.device != first:
            raise MixedDevicesError(
                cls,
                f"inputs on {first} and {t.device}",
                "Move every input to the module's device before calling it",
            )


def _leaf_path(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> str:
    paths, _ = trees.flatten_with_path((args, kwargs))
    path = paths[index][0]
    if path and isinstance(path[0], pytree.SequenceKey):
        head, rest = ("args" if path[0].idx == 0 else "kwargs"), path[1:]
        if head == "kwargs" and rest and isinstance(rest[0], pytree.MappingKey):
            return f"{rest[0].key!s}{pytree.keystr(tuple(rest[1:]))}"
        if head == "args" and rest and isinstance(rest[0], pytree.SequenceKey):
            return f"#{rest[0].idx}{pytree.keystr(tuple(rest[1:]))}"
    return pytree.keystr(path)
