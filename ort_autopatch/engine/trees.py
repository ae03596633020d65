"""Nested inputs and outputs as pytrees, dataclasses included, without touching pytree's
global registry.

torch's pytree treats an unregistered dataclass as a leaf, and registering the user's dataclass
in torch's process-wide registry would be visible to everyone: a user who later registers the
same class (for `torch.export`, say) would get "already registered". So `flatten` stands each
dataclass instance in for a `_Fields` node (our own type, the only one we register: the
dataclass's type and field names as context, its field values as children), and `unflatten`
turns them back into instances of the user's class. A dataclass with `init=False` fields cannot
be rebuilt from its fields and stays a leaf (so it is refused as an input, as before).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from torch.utils import _pytree as pytree


class _Fields:
    """A dataclass instance while it is inside a pytree: type, field names, values."""

    __slots__ = ("cls", "names", "values")

    def __init__(self, cls: type, names: tuple[str, ...], values: tuple[Any, ...]) -> None:
        self.cls, self.names, self.values = cls, names, values


def _flatten_fields(node: _Fields) -> tuple[list[Any], Any]:
    return list(node.values), (node.cls, node.names)


def _unflatten_fields(values: Iterable[Any], context: Any) -> _Fields:
    cls, names = context
    return _Fields(cls, names, tuple(values))


def _flatten_fields_with_keys(node: _Fields) -> tuple[list[tuple[Any, Any]], Any]:
    keys = [pytree.GetAttrKey(name) for name in node.names]
    return list(zip(keys, node.values, strict=True)), (node.cls, node.names)


pytree.register_pytree_node(
    _Fields,
    _flatten_fields,
    _unflatten_fields,
    flatten_with_keys_fn=_flatten_fields_with_keys,
)


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """`pytree.tree_flatten`, with dataclass instances flattened to their fields."""
    return pytree.tree_flatten(_to_fields(tree))


def flatten_with_path(tree: Any) -> tuple[list[tuple[Any, Any]], pytree.TreeSpec]:
    """`pytree.tree_flatten_with_path`, with dataclass fields named by attribute."""
    return pytree.tree_flatten_with_path(_to_fields(tree))


def unflatten(leaves: Iterable[Any], spec: pytree.TreeSpec) -> Any:
    """The inverse of `flatten`: instances of the user's dataclasses again."""
    return _from_fields(pytree.tree_unflatten(leaves, spec))


def _plain_dataclass(node: Any) -> bool:
    """A dataclass instance pytree does not know (transformers' ModelOutput is registered)."""
    return (
        dataclasses.is_dataclass(node)
        and not isinstance(node, type)
        and type(node) not in pytree.SUPPORTED_NODES
        and all(f.init for f in dataclasses.fields(node))  # else it cannot be rebuilt: a leaf
    )


def _to_fields(tree: Any) -> Any:
    def convert(node: Any) -> Any:
        if not _plain_dataclass(node):
            return node
        names = tuple(f.name for f in dataclasses.fields(node))
        return _Fields(type(node), names, tuple(_to_fields(getattr(node, n)) for n in names))

    return pytree.tree_map(convert, tree, is_leaf=_plain_dataclass)


def _from_fields(tree: Any) -> Any:
    def convert(node: Any) -> Any:
        if not isinstance(node, _Fields):
            return node
        values = (_from_fields(value) for value in node.values)
        return node.cls(**dict(zip(node.names, values, strict=True)))

    return pytree.tree_map(convert, tree, is_leaf=lambda node: isinstance(node, _Fields))
