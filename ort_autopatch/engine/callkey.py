"""The call key: whether a cached graph fits a call, as one frozen structure of named guards.

A graph bakes in the gradient mode, every module's train flag, the autocast state (a graph
exported inside `torch.autocast` computes in its dtypes), which parameters require grad,
the input signature (structure, dtypes, ranks, devices and constants; sizes stay dynamic), the
values of the attributes forward read (tensors by identity, version, shape, dtype and device)
and, for a model that specialises on sizes or an input shape that keeps coming back
(`HotShapes`), the input shapes. `KeyMaker` computes a call's key
and keeps the engine's memory of keys: a hit hands back the previous call's key object when no
guard moved (no hashing, no tuple built), and a miss is explained by `CallKey.diff` against the
last key used in the same mode, which is the rebuild reason the report shows. `persistent` is
the part of a key the on-disk graph cache stores.

Replaced parameters and submodules are not guards of a key: every graph binds the module's
tensors by position, so a structure change forgets them all (`KeyMaker.stale`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine.state import ModuleState

#: The guards in the order a miss is explained: the first that differs names the reason.
GUARDS = ("training", "has_backward", "autocast", "requires_grad", "inputs", "attributes", "shapes")

Shapes = tuple[tuple[int, ...], ...]

#: A call's mode, read before its key: gradient mode, the root module's train flag and
#: autocast's state. The graph last used in a mode serves the mode's next call unchecked
#: (`trust_last`), input shapes earn their static-shape graphs per mode (`HotShapes`), and a
#: miss is explained against the last key used in its mode (`KeyMaker.miss_reason`).
Mode = tuple[bool, bool, amp.State]


class Guards(Protocol):
    """The caller's view of state that a graph bakes in (attribute values forward read)."""

    def values(self) -> tuple[Hashable, ...]:
        """Current guard values; the very same tuple object while none changed."""

    def labels(self) -> list[str]:
        """`Owner.attribute` for each value, to name a changed one in a rebuild reason."""

    def paths(self) -> list[str]:
        """Dotted attribute paths from the root, for the persistent cache."""

    def adopt(self, root: Any, paths: list[str]) -> None:
        """Guard these paths from now on (a graph loaded from disk was not exported here)."""


@dataclass(frozen=True)
class CallKey:
    """Everything a graph depends on besides the tensors it is fed."""

    has_backward: bool  # a training graph (forward + backward) or an inference graph
    training: tuple[bool, ...]  # the train flag of the root and of every submodule
    requires_grad: tuple[bool, ...]  # which parameters require grad (training graphs only)
    inputs: Hashable  # the input signature; sizes are dynamic dimensions
    attributes: tuple[Hashable, ...]  # guard values of the attributes forward read
    shapes: Shapes | None = None  # per-shape graphs only
    autocast: amp.State = None  # torch.autocast's state for the module's device type
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hashed once: a key lives as long as its graph and is looked up on every call.
        fields = (
            self.has_backward,
            self.training,
            self.requires_grad,
            self.inputs,
            self.attributes,
        )
        object.__setattr__(self, "_hash", hash((*fields, self.shapes, self.autocast)))

    def __hash__(self) -> int:
        return self._hash

    def diff(self, before: CallKey | None, labels: Sequence[str] = ()) -> str | None:
        """Why this key misses where `before` (the last key used) would not have: the exact
        rebuild reason, or None when the two are equal. `labels` name the attributes."""
        if before is None:
            return "first call"
        for name in GUARDS:
            if getattr(self, name) != getattr(before, name):
                return _REASONS[name](self, before, labels)
        return None

    def persistent(self) -> dict[str, Any]:
        """The part of the key the persistent graph cache hashes (the attribute values are
        stored by path beside it, so a graph loaded from disk still guards them)."""
        return {
            "has_backward": self.has_backward,
            "training": list(self.training),
            "requires_grad": list(self.requires_grad),
            "signature": repr(self.inputs),
            "shapes": None if self.shapes is None else [list(s) for s in self.shapes],
            "autocast": None if self.autocast is None else repr(self.autocast),
        }


class KeyMaker:
    """Computes each call's key for one module tree, and says why a key misses.

    Nothing announces every change a key guards (a submodule's `.eval()`, `requires_grad_()`,
    a write to a config object), so each call reads every guard; it does so in C-level passes
    over the snapshot's columns and compares with the previous call's raw readings, and hands
    back the previous key object when all agree.
    """

    def __init__(self, state: ModuleState, guards: Guards | None) -> None:
        self.state = state
        self._guards = guards
        # the last key computed, with the raw train and requires_grad flags it was made from
        self._recent: tuple[CallKey, list[bool], list[bool]] | None = None
        self._used: CallKey | None = None  # the last key a call ran with
        self._used_in_mode: dict[Mode, CallKey] = {}
        self._built: set[CallKey] = set()
        self._event: str | None = "first call"

    def key(
        self,
        grad: bool,
        inputs: Hashable,
        shapes: Shapes | None,
        requires: list[bool],
        autocast: amp.State = None,
    ) -> CallKey:
        """The key of a call; `requires` are the parameters' requires_grad flags in a training
        call (`ModuleState.requires_grad_flags`), empty otherwise; `autocast` the call's
        `autocast.state`."""
        training = self.state.training_flags()
        attributes = self._guards.values() if self._guards is not None else ()
        recent = self._recent  # one read: another thread may replace it meanwhile
        if recent is not None:
            key, recent_training, recent_requires = recent
            if (
                key.has_backward is grad
                and key.attributes is attributes
                and training == recent_training
                and requires == recent_requires
                and key.inputs == inputs
                and key.shapes == shapes
                and key.autocast == autocast
            ):
                return key
        key = CallKey(grad, tuple(training), tuple(requires), inputs, attributes, shapes, autocast)
        self._recent = (key, training, requires)
        return key

    def stale(self) -> str | None:
        """Why the graphs no longer fit the module tree (a parameter or submodule replaced,
        a dtype or device changed), or None; checked before every key."""
        return None if self.state.unchanged() else self.state.describe_change()

    def forget(self, state: ModuleState, reason: str) -> None:
        """The graphs were dropped (structure change, `mark_stale`): the next build says why."""
        self.state = state
        self._recent = None
        self._used = None
        self._used_in_mode.clear()
        self._built.clear()
        # Before the first build (parameters swapped in by a pre-forward hook, as FSDP2's
        # unshard does) the build is still the first call's.
        if self._event != "first call":
            self._event = reason

    def note(self, reason: str) -> None:
        """An event the key cannot show (sizes change a traced value) explains the next miss."""
        self._event = reason

    def miss_reason(self, key: CallKey, mode: Mode) -> str:
        """Why `key` (a call in `mode`) has no graph: an event, an eviction, or the guard that
        moved since the last key used in that mode (or, in a mode's first call, since the
        last key used at all)."""
        event, self._event = self._event, None
        if event is not None:
            return event
        if key in self._built:
            return "cache evicted"
        before = self._used_in_mode.get(mode, self._used)
        labels = self._guards.labels() if self._guards is not None else []
        return key.diff(before, labels) or "cache evicted"

    def built(self, key: CallKey) -> None:
        self._built.add(key)

    def used(self, key: CallKey, mode: Mode) -> None:
        self._used = key
        self._used_in_mode[mode] = key


def _attributes(new: CallKey, old: CallKey, labels: Sequence[str]) -> str:
    if len(new.attributes) != len(old.attributes):
        return "attributes forward reads changed"
    changed = [
        label for label, a, b in zip(labels, new.attributes, old.attributes, strict=False) if a != b
    ]
    if not changed:
        return "attributes forward reads changed"
    return f"attribute {', '.join(changed)} written"


_REASONS = {
    "training": lambda new, old, labels: "train/eval mode changed",
    "has_backward": lambda new, old, labels: "gradient mode changed",
    "autocast": lambda new, old, labels: (
        f"autocast changed ({amp.describe(old.autocast)} -> {amp.describe(new.autocast)})"
    ),
    "requires_grad": lambda new, old, labels: "requires_grad changed",
    "inputs": lambda new, old, labels: "new input signature",
    "attributes": _attributes,
    "shapes": lambda new, old, labels: "new input shape",
}


class HotShapes:
    """Which input shapes get a static-shape graph of their own, beside the dynamic one.

    A graph exported for one set of input shapes is faster on CPU than the dynamic-axes graph
    (ORT's gradient builder then knows which `Add`s broadcast, so no full-size `ReduceSum`
    copies, and the trace's constant sizes give `Split` instead of `Gather` + padded `Concat`:
    about 10 % of a transformer layer's step) and faster to build (a smaller graph to
    differentiate and optimise: a transformer layer's first call 0.21 s against 0.26 s). So,
    as torch.compile does, the first call of each gradient/train mode gets a graph for its
    shapes at once (`first`); when another shape comes, the dynamic graph serves it. Every
    later static-shape graph costs one more export and gradient build, so only a shape that
    comes back `after` calls in a row earns one, and at most `limit` shapes per mode (the
    first included) do: a loop of fixed batches builds once, a loop of random lengths twice
    (its first shape's graph, then the dynamic one), anything in between at most `limit` + 1
    times. A shape stays hot when the graphs are dropped (a replaced parameter): its next
    graph is static. `after` 0: no static-shape graphs at all.
    """

    def __init__(self, after: int, limit: int, first: bool = False) -> None:
        self.after = after
        self.limit = limit
        self.first = first
        self._hot: dict[Mode, set[Shapes]] = {}
        self._streak: dict[Mode, tuple[Shapes, int]] = {}
        self._refused: set[tuple[Mode, Shapes]] = set()

    def pick(self, mode: Mode, shapes: Callable[[], Shapes]) -> tuple[Shapes | None, bool]:
        """The shapes a call's key carries (None: the dynamic graph serves it), and whether
        they earned their graph by coming back (False for a mode's first call, whose shapes
        have their graph at once)."""
        if self.after <= 0:
            return None, False
        current = shapes()
        hot = self._hot.get(mode)
        if hot is not None and current in hot:
            return current, False
        last, streak = self._streak.get(mode, ((), 0))
        first = self.first and streak == 0 and (mode, current) not in self._refused
        streak = streak + 1 if current == last else 1
        self._streak[mode] = (current, streak)
        if first:
            self._hot.setdefault(mode, set()).add(current)
            return current, False
        if streak < self.after or (hot is not None and len(hot) >= self.limit):
            return None, False
        if (mode, current) in self._refused:
            return None, False
        self._hot.setdefault(mode, set()).add(current)
        return current, True

    def refuse(self, mode: Mode, shapes: Shapes) -> None:
        """No static-shape graph could be built for these shapes: never pick them again."""
        self._refused.add((mode, shapes))
        self._hot.get(mode, set()).discard(shapes)
