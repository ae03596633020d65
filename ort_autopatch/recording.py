"""Which plain attributes an export reads, so the patcher can guard them.

Global effect: for the length of one export, every submodule of the exported module, and every
plain object (a transformers config, say) that forward reaches through their attributes, has its
`__class__` swapped to a recording subclass and restored afterwards. Another thread that looks at
`type(obj)` during that window sees the subclass (`isinstance` still holds). The recording
subclasses are cached per class for the life of the process, so they keep their base classes
alive. Objects with `__slots__` or a builtin layout cannot be swapped; their reads stay unguarded.
Reads are collected per thread: only the exporting thread records.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Set on every recording subclass: the class-creation hook must not patch our own subclasses.
RECORDER_MARKER = "__ort_autopatch_recorder__"
# (owner, attribute name, dotted path from the exported module)
Read = tuple[Any, str, str]

_RECORDING = threading.local()
_recorder_classes: dict[type, type] = {}
_MAX_RECORDED_OBJECTS = 10_000
_NOT_RECORDED = (
    torch.nn.Module,
    torch.Tensor,
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    enum.Enum,
)


def is_recorder(cls: type) -> bool:
    """True for the export-time subclasses this module creates."""
    return bool(cls.__dict__.get(RECORDER_MARKER))


class _Recording:
    """One export's reads: (owner, attribute) pairs, and the objects whose class was swapped."""

    def __init__(self, reads: list[Read]) -> None:
        self.reads = reads
        self.swapped: list[tuple[Any, type]] = []
        self.path: dict[int, str] = {}  # id(object) -> dotted path from the root

    def read(self, owner: Any, name: str, value: Any) -> None:
        prefix = self.path.get(id(owner), "")
        path = f"{prefix}.{name}" if prefix else name
        self.reads.append((owner, name, path))
        if _plain_object(value):
            self.watch(value, path)  # config.flag reads are guarded too

    def watch(self, obj: Any, path: str) -> None:
        """Swap `obj` to a recording subclass until the export ends (if its layout allows)."""
        if id(obj) in self.path or len(self.path) >= _MAX_RECORDED_OBJECTS:
            return
        self.path[id(obj)] = path
        cls = type(obj)
        try:
            # object.__setattr__: a patched or custom __setattr__ must not see this
            object.__setattr__(obj, "__class__", _recorder_class(cls))
        except TypeError:
            return  # slots or a builtin layout: its reads stay unguarded
        self.swapped.append((obj, cls))

    def restore(self) -> None:
        for obj, cls in reversed(self.swapped):
            object.__setattr__(obj, "__class__", cls)


def _plain_object(value: Any) -> bool:
    """Objects such as a transformers config, whose attributes forward may read."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, _NOT_RECORDED)
        and type(value).__module__ != "builtins"
    )


def _recorder_class(cls: type) -> type:
    """A subclass of `cls` whose reads of plain instance attributes are recorded."""
    recorder = _recorder_classes.get(cls)
    if recorder is None:
        # The class's own lookup (transformers' PretrainedConfig maps names through
        # attribute_map in its __getattribute__); recording only watches what it returns.
        lookup: Callable[[Any, str], Any] = cls.__getattribute__  # type: ignore[assignment]

        def __getattribute__(self: Any, name: str) -> Any:
            value = lookup(self, name)
            recording: _Recording | None = getattr(_RECORDING, "current", None)
            if (
                recording is not None
                and not name.startswith("_")
                and name in object.__getattribute__(self, "__dict__")
            ):
                recording.read(self, name, value)
            return value

        namespace = {
            "__getattribute__": __getattribute__,
            "__qualname__": cls.__qualname__,
            "__module__": cls.__module__,
            RECORDER_MARKER: True,
        }
        recorder = type(cls.__name__, (cls,), namespace)
        _recorder_classes[cls] = recorder
    return recorder


@contextlib.contextmanager
def recording_reads(root: torch.nn.Module, reads: list[Read]) -> Iterator[None]:
    """Swap every module of the tree (and plain objects forward reaches through their
    attributes) to recording subclasses for the duration of the trace; `reads` collects what
    forward read."""
    recording = _Recording(reads)
    previous = getattr(_RECORDING, "current", None)
    try:
        for name, module in root.named_modules():
            recording.watch(module, name)
        _RECORDING.current = recording
        yield
    finally:
        _RECORDING.current = previous
        recording.restore()
