"""Nested inputs and outputs as pytrees, dataclasses included."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from torch.utils import _pytree as pytree

_lock = threading.Lock()
_seen: set[type] = set()


def register_dataclasses(tree: Any) -> None:
    """Teach pytree the dataclasses found in `tree`, so their tensor fields are flattened.

    Registration is global to pytree but only adds knowledge: a registered dataclass flattens
    to its fields and unflattens to an equal instance, which is what any pytree user expects.
    """
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            cls = type(node)
            with _lock:
                if cls not in _seen:
                    _seen.add(cls)
                    if cls not in pytree.SUPPORTED_NODES:
                        try:
                            pytree.register_dataclass(cls)
                        except (ValueError, TypeError):
                            pass  # e.g. init=False fields: stays a leaf, refused as input
            stack.extend(getattr(node, f.name) for f in dataclasses.fields(node))
