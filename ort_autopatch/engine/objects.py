"""Output objects that hold tensors, such as transformers' `DynamicCache` (returned by every
decoder whose config has `use_cache=True`, the default).

pytree sees such an object as one leaf. Baked into the graph as a constant it would hand every
call the tensors of the export's own trace. Instead its tensors become graph outputs, and each
call gets a fresh shallow copy of the object (and of every object or container on the way to a
tensor) carrying that call's tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

#: How deep an object is searched for tensors (DynamicCache -> layers -> layer -> keys is 3).
MAX_DEPTH = 6


class _Slot:
    """Where one tensor goes."""


class _NumberSlot:
    """Where a Python int goes that the tracer handed over as a 0-d tensor (a size)."""


_SLOT = _Slot()
_NUMBER = _NumberSlot()
_SIZE_OPS = {"aten::size", "prim::NumToTensor", "aten::sym_size", "onnx::Shape"}


def _traced_from_sizes(t: torch.Tensor, depth: int = 8) -> bool:
    """True for a 0-d integer tensor the tracer derived from tensor sizes: eagerly it was an
    int (`DynamicSlidingWindowLayer.cumulative_length += key_states.shape[-2]`)."""
    if t.dim() != 0 or t.is_floating_point() or torch._C._get_tracing_state() is None:
        return False
    try:
        frontier = [torch._C._get_value_trace(t).node()]  # type: ignore[attr-defined]
    except RuntimeError:
        return False
    for _ in range(depth):
        if any(node.kind() in _SIZE_OPS for node in frontier):
            return True
        frontier = [value.node() for node in frontier for value in node.inputs()]
        if not frontier:
            return False
    return False


@dataclass
class _Node:
    """An object with tensors somewhere below: a template copy and its tensor-bearing fields."""

    template: Any
    fields: dict[str, Any]


@dataclass
class _Sequence:
    kind: type
    items: list[Any]


@dataclass
class _Mapping:
    kind: type
    items: dict[Any, Any]


@dataclass
class Carrier:
    """An output leaf that is an object holding tensors; `fill` makes this call's copy."""

    skeleton: Any
    count: int

    def fill(self, tensors: Iterator[torch.Tensor]) -> Any:
        return _fill(self.skeleton, tensors)


def _searchable(value: Any) -> bool:
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, (type, torch.nn.Module))
        and type(value).__module__ != "builtins"
        and not callable(value)
    )


def _strip(value: Any, found: list[torch.Tensor], depth: int, seen: set[int]) -> Any:
    """The skeleton of `value` (tensors replaced by slots, appended to `found`), or `value`
    itself when nothing below it is a tensor."""
    if isinstance(value, torch.Tensor):
        found.append(value)
        return _NUMBER if _traced_from_sizes(value) else _SLOT
    if isinstance(value, torch.SymInt):  # a size the plain backend's trace keeps symbolic
        found.append(torch.scalar_tensor(value, dtype=torch.int64))  # type: ignore[arg-type]
        return _NUMBER
    if depth >= MAX_DEPTH or id(value) in seen:
        return value
    seen.add(id(value))
    if isinstance(value, (list, tuple)):
        items = [_strip(v, found, depth + 1, seen) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return _Sequence(type(value), items)
    if isinstance(value, dict):
        mapped = {k: _strip(v, found, depth + 1, seen) for k, v in value.items()}
        if all(mapped[k] is v for k, v in value.items()):
            return value
        return _Mapping(type(value), mapped)
    if _searchable(value):
        fields = {}
        for name, field in vars(value).items():
            stripped = _strip(field, found, depth + 1, seen)
            if stripped is not field:
                fields[name] = stripped
        if not fields:
            return value
        template = copy.copy(value)
        for name in fields:
            vars(template)[name] = None  # the template must not keep the trace's tensors
        return _Node(template, fields)
    return value


def carrier_of(leaf: Any) -> tuple[Carrier, list[torch.Tensor]] | None:
    """A carrier for an object leaf that holds tensors, and those tensors; None otherwise."""
    if not _searchable(leaf):
        return None
    found: list[torch.Tensor] = []
    skeleton = _strip(leaf, found, 0, set())
    if not found:
        return None
    return Carrier(skeleton, len(found)), found


def _fill(skeleton: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if skeleton is _SLOT:
        return next(tensors)
    if skeleton is _NUMBER:
        return int(next(tensors))
    if isinstance(skeleton, _Node):
        obj = copy.copy(skeleton.template)
        for name, child in skeleton.fields.items():
            vars(obj)[name] = _fill(child, tensors)
        return obj
    if isinstance(skeleton, _Sequence):
        items = [_fill(v, tensors) for v in skeleton.items]
        if skeleton.kind is list:
            return items
        if hasattr(skeleton.kind, "_fields"):  # namedtuple
            return skeleton.kind(*items)
        return skeleton.kind(items)
    if isinstance(skeleton, _Mapping):
        return skeleton.kind((k, _fill(v, tensors)) for k, v in skeleton.items.items())
    return skeleton
