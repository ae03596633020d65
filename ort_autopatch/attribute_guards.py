"""The plain attributes a patched instance's graphs depend on: what forward read while it was
exported (the attribute guards of the call key) and what it wrote (done again after every call
of the graph, or refused).

A graph bakes in the values of the attributes forward read (`self.causal`, a transformers
config's `use_cache`), so they belong in the key of the graph (`engine/callkey.py`'s `Guards`,
implemented here): a changed value selects or builds another graph. `recording.py` records the
reads and writes of one export; this module keeps the reads of every export of one instance as
guards, and judges the writes: a write a graph repeats comes back as `Replay`, any other raises
`SideEffectError`.

`SideEffectError` lives here, beside its only `raise`, rather than in `ort_autopatch/errors.py`:
it is an engine `UnsupportedModelError` (the export passes it through as the model's own refusal,
and the fallback policy maps it as one), and `errors.py` must import nothing, since the engine's
errors import it.
"""

from __future__ import annotations

import collections
import enum
import operator
import types
from collections.abc import Hashable
from typing import Any

import torch

from ort_autopatch.engine import hazards, in_untraced_run, is_exporting
from ort_autopatch.engine.errors import UnsupportedModelError
from ort_autopatch.recording import (
    Read,
    Replay,
    Unreplayable,
    Write,
    recording_access,
    side_effects,
)


class SideEffectError(UnsupportedModelError):
    """forward changes state (a Python attribute, a container in place) that a graph reused on
    the next call would not change again."""

    reason = "forward changes state a graph cannot replay"
    once = False  # the first refusal for this attribute (the caller may trace again)


class AttributeGuards:
    """The attributes forward read in the exports of one patched instance (the engine's
    `Guards`), and its refusals of writes a graph cannot repeat. `module_class` names the
    class in errors."""

    def __init__(self, module_class: str) -> None:
        self.module_class = module_class
        # (owner's __dict__, attribute name, owner label, dotted path from the root) for every
        # attribute forward read
        self._guards: list[tuple[dict[str, Any], str, str, str]] = []
        self._guard_set: set[tuple[int, str]] = set()
        # the objects the guarded attributes held last call, their guard values, and which of
        # them can change in place (tensors, containers)
        self._last: tuple[list[Any], tuple[Hashable, ...], list[int]] = ([], (), [])
        self._guard_owners: list[dict[str, Any]] = []  # columns of `_guards`, for map() in C
        self._guard_names: list[str] = []
        # traces refused for a write a graph cannot repeat, per (owner, attribute); the second
        # refusal of one attribute sends every later call to PyTorch without tracing
        self._refusals: collections.Counter[tuple[int, str]] = collections.Counter()
        #: forward changes state on every call: no graph, and no more traces to learn it
        self.unreplayable: SideEffectError | None = None
        self._replaying = False  # assigning forward's writes again (not the user's writes)

    def __len__(self) -> int:
        """How many attributes are guarded."""
        return len(self._guards)

    def values(self) -> tuple[Hashable, ...]:
        """Current guard values of every attribute an export read: a changed one selects (or
        builds) another graph, and a value toggled back finds its old graph again. While every
        attribute still holds the object it held last call, only the values that can change in
        place (tensors, containers) are read again, and the previous tuple is returned."""
        if not self._guards:
            return ()
        current = list(map(dict.get, self._guard_owners, self._guard_names))
        objects, values, mutable = self._last  # one read: another thread may replace it
        if len(current) == len(objects) and all(map(operator.is_, current, objects)):
            if not mutable or all(guard_value(current[i]) == values[i] for i in mutable):
                return values
        values = tuple(map(guard_value, current))
        mutable = [i for i, value in enumerate(current) if not _immutable(value)]
        self._last = (current, values, mutable)
        return values

    def labels(self) -> list[str]:
        return [f"{label}.{name}" for _, name, label, _ in self._guards]

    def ignores(self, module: torch.nn.Module, name: str) -> bool:
        """Whether a write on the patched instance itself is one no graph notices: not to a
        guarded attribute, nor forward's own (the trace's writes are undone, and replays are
        forward's writes), nor a replacement of a parameter, buffer or submodule. Deeper writes
        are caught by the guards and the engine's structure check on the next call."""
        if name == "training" or self._replaying or is_exporting():
            return False
        if name in module._parameters or name in module._buffers or name in module._modules:
            # The engine's structure check sees (and names) a replacement on the next call; a
            # note here would outlive FSDP2's swaps to the sharded parameter and back.
            return False
        return (id(module.__dict__), name) not in self._guard_set

    def replay(self, replay: Replay, module: torch.nn.Module) -> Any:
        """Assign again the tensors forward assigned while it was traced; the call's output."""
        self._replaying = True
        try:
            return replay.apply(module)
        finally:
            self._replaying = False

    def paths(self) -> list[str]:
        return [path for _, _, _, path in self._guards]

    def adopt(self, root: torch.nn.Module, paths: list[str]) -> None:
        """Guard attributes named by path (a graph loaded from disk was not exported here)."""
        for path in paths:
            owner_path, _, name = path.rpartition(".")
            owner: Any = root
            for part in owner_path.split(".") if owner_path else []:
                owner = getattr(owner, part, None)
            if owner is not None and name in getattr(owner, "__dict__", {}):
                self._guard(owner, name, path)

    def _guard(self, owner: Any, name: str, path: str) -> None:
        key = (id(owner.__dict__), name)
        if key not in self._guard_set:
            self._guard_set.add(key)
            self._guards.append((owner.__dict__, name, type(owner).__qualname__, path))
            self._guard_owners.append(owner.__dict__)
            self._guard_names.append(name)

    def recording_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """What the engine exports: forward, recording which plain attributes it reads and
        writes. The trace's writes are undone; tensors it assigned come back from every call
        of the graph (`Replay`), other changes send the class to PyTorch."""
        reads: list[Read] = []
        writes: list[Write] = []
        with recording_access(module, reads, writes) as seen:
            output = module.forward(*args, **kwargs)
        for owner, name, path in () if in_untraced_run() else reads:  # a graph's reads only
            if name == "training" and isinstance(owner, torch.nn.Module):
                continue  # train flags are part of every key: a change reads as a mode change
            self._guard(owner, name, path)
        try:
            replay = side_effects(
                writes, seen, _same_guard, hazards.traced_constant, hazards.traced_detached
            )
        except Unreplayable as exc:
            # Once may be a first call's setup; the same attribute again means every call.
            self._refusals[exc.key] += 1
            error = SideEffectError(
                self.module_class,
                f"{exc.what} (at {exc.where}): a graph reused on the next call would not do it "
                "again",
                "It runs in PyTorch; keep such state outside the selected module (or in a "
                "buffer updated in place), or exclude the class (ORT_AUTOPATCH_EXCLUDE)",
            )
            error.once = self._refusals[exc.key] == 1
            if not error.once:
                self.unreplayable = error
            raise error from None
        if replay is None:
            return output
        replay.output = output
        return replay


_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.device})


_IMMUTABLE_KINDS = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    type,
    enum.Enum,
)


def _same_guard(a: Any, b: Any) -> bool:
    return bool(guard_value(a) == guard_value(b))


def _immutable(value: Any) -> bool:
    """Whether holding the same object means holding the same guard value (it cannot change
    in place, or it is guarded by identity anyway)."""
    kind = type(value)
    if kind in _PLAIN_TYPES or isinstance(value, _IMMUTABLE_KINDS):
        return True
    if kind in (tuple, frozenset):
        return all(map(_immutable, value))
    if isinstance(value, torch.Tensor) or kind in (list, dict, set):
        return False
    return not _by_value(value)


def guard_value(value: Any) -> Hashable:
    """What a guard compares for an attribute value: plain values by value, tensors by identity,
    version counter, shape, dtype and device (never by their elements: comparing tensors with
    `!=` is ambiguous, and a graph baked the tensor's contents as of its version), containers
    element by element, anything else by value when hashable and by identity otherwise."""
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version, value.shape, value.dtype, value.device)
    if kind in (tuple, list):
        return (kind.__name__, tuple(map(guard_value, value)))
    if kind is dict:
        return ("dict", tuple((k, guard_value(v)) for k, v in value.items()))
    return value if _by_value(value) else ("id", id(value))


def _by_value(value: Any) -> bool:
    try:
        hash(value)
        equal = value == value  # some types compare to arrays (numpy) or raise
    except Exception:
        return False
    return type(equal) is bool
