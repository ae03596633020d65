"""A snapshot of a module tree's structure, checked on every call.

Parameters and buffers are fed to the graph by reference, so the engine must notice when one is
replaced (`model.fc.weight = nn.Parameter(...)`), when a submodule is swapped anywhere below the
root, or when `.half()`/`.to()` changed a tensor's dtype or device in place. Nothing announces
such changes (FSDP2 writes `module._parameters` directly, `requires_grad_()` and a submodule's
`.eval()` bypass every patched method), so each call checks them all, as C-level `map`s over
flat lists made once per snapshot (about 20 ns per element), never as a Python loop.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterator
from itertools import repeat
from typing import Any

import torch

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DTYPE = operator.attrgetter("dtype")
_DEVICE_INDEX = torch.Tensor.get_device  # an int: no torch.device object made per tensor
_IS = operator.is_
_GET: Any = dict.get


class ModuleState:
    """Identity of every submodule, parameter and buffer under a root, as seen at snapshot time."""

    def __init__(self, root: torch.nn.Module) -> None:
        named = list(root.named_modules())
        # The root is held weakly: the engine lives in a WeakKeyDictionary keyed by it, and a
        # strong reference from the value would keep every model (and its sessions) alive.
        self._root = weakref.ref(root)
        self.modules: list[torch.nn.Module] = [m for _, m in named[1:]]  # below the root
        self._by_name: dict[str, torch.nn.Module] = dict(named[1:])
        self.edges: list[tuple[dict[str, Any], str, Any]] = [
            (parent._modules, name, child)
            for parent in (root, *self.modules)
            for name, child in parent._modules.items()
        ]
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.is_param: list[bool] = []
        self._slots: list[tuple[dict[str, Any], str, torch.Tensor, torch.dtype, torch.device]] = []
        seen: set[int] = set()
        for prefix, module in named:
            for kind, table in ((True, module._parameters), (False, module._buffers)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    qualified = f"{prefix}.{name}" if prefix else name
                    self._slots.append((table, name, tensor, tensor.dtype, tensor.device))
                    if id(tensor) in seen:
                        continue  # tied: the export names it once, by its first name
                    seen.add(id(tensor))
                    self.names.append(qualified)
                    self.tensors.append(tensor)
                    self.is_param.append(kind)
        self.index = {name: k for k, name in enumerate(self.names)}
        # whose autocast state decides the graph (autocast.state); None without tensors
        self.device_type: str | None = self.tensors[0].device.type if self.tensors else None
        # Hook tables are mutated in place by register_*_hook: one flat list, checked in C.
        self._hook_tables = [
            table
            for module in self.modules
            for table in (
                module._forward_hooks,
                module._forward_pre_hooks,
                module._backward_hooks,
                module._backward_pre_hooks,
            )
        ]
        self.params = [t for t, p in zip(self.tensors, self.is_param, strict=True) if p]
        # The same facts as columns, so each check is one C-level pass.
        self._tables = [table for table, *_ in self.edges] + [table for table, *_ in self._slots]
        self._names = [name for _, name, _ in self.edges] + [name for _, name, *_ in self._slots]
        self._held = [child for *_, child in self.edges] + [t for _, _, t, *_ in self._slots]
        self._slot_tensors = [t for _, _, t, *_ in self._slots]
        self._dtypes = list(map(_DTYPE, self._slot_tensors))
        self._device_indices = list(map(_DEVICE_INDEX, self._slot_tensors))
        self._module_dicts = [root.__dict__] + [m.__dict__ for m in self.modules]

    def unchanged(self) -> bool:
        """True while no submodule, parameter or buffer was replaced or changed dtype/device."""
        return (
            all(map(_IS, map(dict.get, self._tables, self._names), self._held))
            and list(map(_DTYPE, self._slot_tensors)) == self._dtypes
            and list(map(_DEVICE_INDEX, self._slot_tensors)) == self._device_indices
        )

    def submodule_hooks(self) -> bool:
        """Whether any module below the root carries forward or backward hooks."""
        return any(self._hook_tables)

    def describe_change(self) -> str:
        """Why `unchanged()` said no, in a report's words (only called after a change)."""
        for table, name, child in self.edges:
            if table.get(name) is not child:
                return f"submodule {name} replaced"
        for table, name, tensor, dtype, device in self._slots:
            current = table.get(name)
            if current is not tensor:
                return f"{name} replaced"
            if tensor.device != device:
                return "device changed"
            if tensor.dtype != dtype:
                return "dtype changed"
        return "module structure changed"

    def training_flags(self) -> list[bool]:
        """The root's and every submodule's train flag, in snapshot order."""
        flags: list[bool] = list(map(_GET, self._module_dicts, repeat("training")))
        return flags

    def module_named(self, name: str) -> torch.nn.Module | None:
        """The submodule `name` ("" for the root) as of the snapshot."""
        return self._root() if name == "" else self._by_name.get(name)

    def named_modules(self) -> Iterator[tuple[str, torch.nn.Module]]:
        root = self._root()
        if root is not None:
            yield "", root
        yield from self._by_name.items()

    def requires_grad_flags(self) -> list[bool]:
        return list(map(_REQUIRES_GRAD, self.params))

    def devices(self) -> set[torch.device]:
        return {t.device for t in self.tensors}
