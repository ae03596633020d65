"""Which plain attributes an export reads, so the patcher can guard them, and which it writes,
so that a graph never silently drops what forward stores.

A graph reused on a cache hit does not run forward, so an attribute forward writes
(`self.src_mask = mask`, `self.aux_loss = loss`, `self.calls += 1`) would keep the value of
the traced call. `side_effects` undoes every write of the trace and says what to do with each:
a tensor becomes an extra graph output the patcher writes back after every call (`Replay`), a
write that leaves the value as it was needs nothing, and anything else (a Python counter, a
submodule or parameter created in forward, an attribute deleted, a container or tensor attribute
changed in place) cannot be replayed: the class runs in PyTorch, with the attribute and the
line named.

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
import copy
import dataclasses
import enum
import pathlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Set on every recording subclass: the class-creation hook must not patch our own subclasses.
RECORDER_MARKER = "__ort_autopatch_recorder__"
# (owner, attribute name, dotted path from the exported module)
Read = tuple[Any, str, str]


@dataclasses.dataclass
class Write:
    """An attribute forward assigned or deleted during a trace."""

    owner: Any
    name: str
    path: str  # dotted path from the exported module
    before: Any  # the value it held before the trace, or MISSING
    where: str  # the user's file:line of the first write


MISSING: Any = object()

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

    def __init__(self, reads: list[Read], writes: list[Write]) -> None:
        self.reads = reads
        self.writes = writes
        self.written: set[tuple[int, str]] = set()
        self.swapped: list[tuple[Any, type]] = []
        self.path: dict[int, str] = {}  # id(object) -> dotted path from the root
        # guard-relevant state of mutable values forward read, as first read
        self.first_seen: dict[tuple[int, str], Any] = {}

    def _path(self, owner: Any, name: str) -> str:
        prefix = self.path.get(id(owner), "")
        return f"{prefix}.{name}" if prefix else name

    def read(self, owner: Any, name: str, value: Any) -> None:
        if id(owner) not in self.path:
            return  # a copy forward made of a watched object (its class came along): not state
        path = self._path(owner, name)
        self.reads.append((owner, name, path))
        key = (id(owner), name)
        if key not in self.first_seen and key not in self.written and _changes_in_place(value):
            self.first_seen[key] = (owner, name, _state_of(value), _copy(value))
        if _plain_object(value):
            self.watch(value, path)  # config.flag reads are guarded too

    def wrote(self, owner: Any, name: str) -> None:
        if id(owner) not in self.path:
            return  # a copy forward made and changes (transformers' `get_text_config`)
        key = (id(owner), name)
        if key in self.written:
            return
        self.written.add(key)
        self.writes.append(
            Write(owner, name, self._path(owner, name), held(owner, name), _caller())
        )

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

        assign: Callable[[Any, str, Any], None] = cls.__setattr__  # type: ignore[assignment]
        remove: Callable[[Any, str], None] = cls.__delattr__  # type: ignore[assignment]

        def __setattr__(self: Any, name: str, value: Any) -> None:
            recording: _Recording | None = getattr(_RECORDING, "current", None)
            if recording is not None and not _dunder(name):
                recording.wrote(self, name)
            assign(self, name, value)

        def __delattr__(self: Any, name: str) -> None:
            recording: _Recording | None = getattr(_RECORDING, "current", None)
            if recording is not None and not _dunder(name):
                recording.wrote(self, name)
            remove(self, name)

        namespace = {
            "__getattribute__": __getattribute__,
            "__setattr__": __setattr__,
            "__delattr__": __delattr__,
            "__qualname__": cls.__qualname__,
            "__module__": cls.__module__,
            RECORDER_MARKER: True,
        }
        recorder = type(cls.__name__, (cls,), namespace)
        _recorder_classes[cls] = recorder
    return recorder


@contextlib.contextmanager
def recording_access(
    root: torch.nn.Module, reads: list[Read], writes: list[Write]
) -> Iterator[list[tuple[Any, str, Any, Any]]]:
    """Swap every module of the tree (and plain objects forward reaches through their
    attributes) to recording subclasses for the duration of the trace; `reads` collects what
    forward read and `writes` what it assigned or deleted. Yields a list that, when the block
    ends, holds the mutable values forward read (owner, name, state and copy as first read)."""
    recording = _Recording(reads, writes)
    previous = getattr(_RECORDING, "current", None)
    seen: list[tuple[Any, str, Any, Any]] = []
    try:
        for name, module in root.named_modules():
            recording.watch(module, name)
        _RECORDING.current = recording
        yield seen
    finally:
        _RECORDING.current = previous
        recording.restore()
        seen.extend(recording.first_seen.values())


@dataclasses.dataclass
class Replay:
    """A graph's user output together with the tensors forward assigned to attributes, keyed by
    dotted path from the module; a plain dataclass, so it travels through the graph's output
    pytree and comes back from every call for `apply`."""

    output: Any
    writes: dict[str, Any]
    detached: frozenset[str] = frozenset()  # paths forward assigned `.detach()`-ed tensors to

    def apply(self, root: Any) -> Any:
        """Assign the tensors as forward did, and hand back the user's output."""
        for path, value in self.writes.items():
            owner_path, _, name = path.rpartition(".")
            owner = root
            for part in owner_path.split(".") if owner_path else []:
                owner = getattr(owner, part)
            if type(value) is Frozen:
                value = value.tensor
            elif path in self.detached:
                value = _detach(value)
            setattr(owner, name, value)
        return self.output


class Frozen:
    """A tensor the graph holds as a constant, written back as the very same object after
    each call (a leaf of the output pytree, not a graph output)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Unreplayable(Exception):
    """forward changed state that a graph cannot change again on the next call."""

    def __init__(self, what: str, where: str, key: tuple[int, str]) -> None:
        super().__init__(f"{what} at {where}")
        self.what, self.where, self.key = what, where, key


def side_effects(
    writes: list[Write],
    seen: list[tuple[Any, str, Any, Any]],
    same: Callable[[Any, Any], bool],
    constant: Callable[[torch.Tensor], bool],
    detached: Callable[[torch.Tensor], bool],
) -> Replay | None:
    """Undo every write of a trace and return the tensors to replay after each call, by path.

    Raises `Unreplayable` for a write a graph cannot repeat, after undoing all of them, so
    the eager run that follows writes once, as without the tool. `same(a, b)` compares two
    values as the guards do; `constant(t)` says whether the trace computed `t` from no input,
    `detached(t)` whether it made `t` with `.detach()`. Returns the writes to replay (its
    `output` is filled in by the caller), or None when there are none.
    """
    replay: dict[str, Any] = {}
    cut: set[str] = set()
    refused: Unreplayable | None = None
    for write in reversed(writes):  # the first write's `before` is restored last
        after = held(write.owner, write.name)
        _restore(write.owner, write.name, write.before)
        if after is MISSING and write.before is MISSING:
            continue
        if _tensors(after) and not _registered(write.owner, write.name):
            # A tensor the trace computed from no input is a constant of the graph (a mask
            # sized by `len(x)`, guarded by the trace's size checks): the same object each call.
            # Containers of tensors (a cached `(k, v)`) travel as graph outputs too.
            frozen = isinstance(after, torch.Tensor) and constant(after)
            replay[write.path] = Frozen(after) if frozen else after
            if not frozen and all(map(detached, _leaves(after))):
                cut.add(write.path)
            continue
        if after is write.before or (
            after is not MISSING and write.before is not MISSING and same(after, write.before)
        ):
            continue
        label = f"{type(write.owner).__qualname__}.{write.name}"
        what = (
            f"forward deletes {label}"
            if after is MISSING
            else f"forward writes {label} ({type(after).__name__})"
        )
        refused = Unreplayable(what, write.where, (id(write.owner), write.name))
    for owner, name, state, saved in seen:
        value = held(owner, name)
        if _state_of(value) != state:
            _put_back(value, saved)  # so the eager run that follows changes it once
            label = f"{type(owner).__qualname__}.{name}"
            refused = refused or Unreplayable(
                f"forward changes {label} in place", "forward", (id(owner), name)
            )
    if refused is not None:
        raise refused
    if not replay:
        return None
    return Replay(None, dict(reversed(replay.items())), frozenset(cut))


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if value is not None else ()
    return [t for v in items for t in _leaves(v)]


def _tensors(value: Any) -> bool:
    """A tensor (not a parameter), or a tuple, list or string-keyed dict of such (or None)."""
    if isinstance(value, torch.Tensor):
        return not isinstance(value, torch.nn.Parameter)
    if type(value) in (tuple, list):
        return bool(value) and all(v is None or _tensors(v) for v in value)
    if type(value) is dict:
        return (
            bool(value)
            and all(type(k) is str for k in value)
            and all(v is None or _tensors(v) for v in value.values())
        )
    return False


def held(owner: Any, name: str) -> Any:
    """What `owner.name` holds (an attribute, or a module's parameter, buffer or submodule)."""
    namespace = object.__getattribute__(owner, "__dict__")
    if name in namespace:
        return namespace[name]
    if isinstance(owner, torch.nn.Module):
        for table in (owner._parameters, owner._buffers, owner._modules):
            if name in table:
                return table[name]
    return MISSING


def _registered(owner: Any, name: str) -> bool:
    """A parameter, buffer or submodule slot: replacing one is a structure change."""
    return isinstance(owner, torch.nn.Module) and any(
        name in table for table in (owner._parameters, owner._buffers, owner._modules)
    )


def _restore(owner: Any, name: str, value: Any) -> None:
    """Put `owner.name` back as it was, past any custom or patched `__setattr__` (the undo is
    not the user's write): a plain attribute in `__dict__`, a module's slot through
    `torch.nn.Module`'s own methods."""
    namespace = object.__getattribute__(owner, "__dict__")
    slot = isinstance(owner, torch.nn.Module) and (
        _registered(owner, name) or isinstance(value, (torch.nn.Parameter, torch.nn.Module))
    )
    if value is MISSING:
        if slot:
            torch.nn.Module.__delattr__(owner, name)
        else:
            namespace.pop(name, None)
    elif slot:
        torch.nn.Module.__setattr__(owner, name, value)
    else:
        namespace[name] = value


def _changes_in_place(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, list, dict, set))


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.copy(value)  # list, dict, set (subclasses included): a shallow copy


def _put_back(value: Any, saved: Any) -> None:
    """Undo an in-place change of a container or tensor a trace made."""
    if isinstance(value, torch.Tensor):
        if value.shape == saved.shape:
            with torch.no_grad():
                value.copy_(saved)
    elif isinstance(value, list):
        value[:] = saved
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(saved)


def _state_of(value: Any) -> Any:
    """What an in-place change moves: a tensor's version and shape, a container's items."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version, tuple(value.shape))
    if isinstance(value, (list, dict, set)):
        items = value.items() if isinstance(value, dict) else value
        return (type(value), tuple(map(_item_state, items)))
    return value


def _item_state(item: Any) -> Any:
    if isinstance(item, tuple):
        return tuple(map(_item_state, item))
    if isinstance(item, torch.Tensor):
        return ("tensor", id(item), item._version)
    return ("object", id(item))


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _caller() -> str:
    """The file:line of the write in the user's code: the first frame outside this package
    and torch (whose `Module.__setattr__` may sit in between)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "forward"


_SKIPPED = (
    str(pathlib.Path(torch.__file__).parent),
    str(pathlib.Path(__file__).parent),
)
