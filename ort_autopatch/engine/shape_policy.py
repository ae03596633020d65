"""Which input shapes a module's graphs serve, and how a call finds the graph for its shapes:
what differs between backends in the engine's keying, behind one interface.

The engine asks its policy (chosen by the backend, `Backend.shape_policy`) on every call for
the call's key and whether the graph it last used still fits, and on a miss what to build and
under which key to file the result; it never branches on the backend. Two policies:

- `DynamicGraphs` (the training build): a mode's first graph is traced for its call's shapes;
  the next shape gets one graph with dynamic axes for every size, and a shape that keeps
  coming back earns a static-shape graph of its own (`callkey.HotShapes`). Once a trace froze
  sizes (the model specialises on them), every graph serves one input shape.
- `GuardedSizes` (the plain backend): every graph says which sizes it serves (size guards,
  `sizes.SizeGuards`); a key's first graph is traced for its shapes, and from the second
  shape on the dimensions that varied are traced as symbols (`sizes.SizeClasses`).

What a build learns (the model specialises on sizes, and where) comes back through the
build's progress (`Progress.specialises`), never by mutating the request.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine.callkey import CallKey, HotShapes, KeyMaker, Shapes
from ort_autopatch.engine.signature import FlatCall
from ort_autopatch.engine.sizes import Dims, SizeClasses, SizeGuards

#: input shapes per gradient/train mode that may earn a static-shape graph (`HotShapes`)
HOT_SHAPES_PER_MODE = 2


@dataclass(frozen=True)
class Request:
    """What shapes a graph is built for, as the policy decides it for one miss."""

    #: the input shapes the graph is built and keyed for (-1 for a dimension traced as a
    #: symbol), or None for a graph of every size (dynamic axes)
    shapes: Shapes | None
    #: the dimensions to trace as symbols (a policy with size guards), or None
    dynamic: Dims | None = None
    #: every graph of the module serves one input shape (the model specialises on sizes)
    per_shape: bool = False


class ShapePolicy(ABC):
    """How one module instance's graphs are keyed by input shape."""

    #: a mode's first call gets a graph traced for its shapes by the policy's hot shapes
    first_call_static: ClassVar[bool] = True

    def __init__(self, static_after: int) -> None:
        self.hot = HotShapes(static_after, HOT_SHAPES_PER_MODE, first=self.first_call_static)
        self.per_shape = False  # every graph serves one input shape (sizes were traced)

    # -- every call (the engine reads `per_shape` and asks `hot` itself: no call layer) ----
    @abstractmethod
    def key(
        self,
        keys: KeyMaker,
        grad: bool,
        call: FlatCall,
        requires: list[bool],
        hot: Shapes | None,
        autocast: amp.State,
        held: Callable[[CallKey], bool],
    ) -> CallKey:
        """The call's key (`hot`: its shapes earned a static-shape graph; `held`: whether the
        cache holds a key)."""

    @abstractmethod
    def fits(self, last: CallKey, call: FlatCall, hot: Shapes | None) -> bool:
        """Whether the graph last used in this mode serves this call's shapes (the unchecked
        fast path: even then a graph never takes sizes it was not built for)."""

    def earned_new(self, key: CallKey, held: Callable[[CallKey], bool]) -> bool:
        """Whether shapes that just earned a static-shape graph (keyed `key`) need a build."""
        return True

    # -- a miss --------------------------------------------------------------------------
    def miss_reason(self, base: CallKey, call: FlatCall, reason: str) -> str:
        """The rebuild reason the report gives (`reason`: the key's first difference)."""
        return reason

    @abstractmethod
    def request(self, base: CallKey, call: FlatCall, hot: Shapes | None) -> Request:
        """What to build for a call that missed (`base`: its key without sizes)."""

    @abstractmethod
    def learned(self, base: CallKey, per_shape: bool, cause: str) -> None:
        """A build (done or failed) found that the model specialises on sizes (`cause`:
        where its code froze them, or "")."""

    def built(self, base: CallKey, guards: SizeGuards | None, call: FlatCall) -> None:  # noqa: B027
        """A graph was built for `base` (with the sizes it serves, when it says)."""

    @abstractmethod
    def settled(
        self,
        keys: KeyMaker,
        grad: bool,
        call: FlatCall,
        requires: list[bool],
        hot: Shapes | None,
        autocast: amp.State,
        base: CallKey,
        guards: SizeGuards | None,
    ) -> CallKey:
        """The key later calls compute for the graph just built (the build may have
        switched to static shapes, or taught the guards new attributes)."""

    def specialises(self) -> None:
        """A graph's size check failed for a call: from now on one graph per input shape."""
        self.per_shape = True

    def clear(self) -> None:  # noqa: B027  (what the module's graphs taught; most keep nothing)
        """Forget what the module's graphs taught (every graph was dropped)."""


class DynamicGraphs(ShapePolicy):
    """The training build's: a graph for every size (dynamic axes), static-shape graphs for
    the first shape and for shapes that keep coming back."""

    def key(
        self,
        keys: KeyMaker,
        grad: bool,
        call: FlatCall,
        requires: list[bool],
        hot: Shapes | None,
        autocast: amp.State,
        held: Callable[[CallKey], bool],
    ) -> CallKey:
        shapes = call.shapes() if self.per_shape else hot  # `_shapes`, inlined: every call asks
        return keys.key(grad, call.signature, shapes, requires, autocast)

    def fits(self, last: CallKey, call: FlatCall, hot: Shapes | None) -> bool:
        return last.shapes == self._shapes(call, hot)

    def request(self, base: CallKey, call: FlatCall, hot: Shapes | None) -> Request:
        return Request(self._shapes(call, hot), None, self.per_shape)

    def learned(self, base: CallKey, per_shape: bool, cause: str) -> None:
        if per_shape:
            self.per_shape = True

    def settled(
        self,
        keys: KeyMaker,
        grad: bool,
        call: FlatCall,
        requires: list[bool],
        hot: Shapes | None,
        autocast: amp.State,
        base: CallKey,
        guards: SizeGuards | None,
    ) -> CallKey:
        return self.key(keys, grad, call, requires, hot, autocast, lambda key: False)

    def _shapes(self, call: FlatCall, hot: Shapes | None) -> Shapes | None:
        """All of the call's shapes once the model specialises on sizes, the earned
        static-shape graph's (`hot`), or None (one graph for every size)."""
        return call.shapes() if self.per_shape else hot


class GuardedSizes(ShapePolicy):
    """The plain backend's: every graph carries the sizes it serves; a call is admitted to
    the first graph whose guards hold, and sizes that varied are traced as symbols."""

    first_call_static = False  # a key's first graph is traced for its shapes anyway

    def __init__(self, static_after: int) -> None:
        super().__init__(static_after)
        self.sizes = SizeClasses()

    def key(
        self,
        keys: KeyMaker,
        grad: bool,
        call: FlatCall,
        requires: list[bool],
        hot: Shapes | None,
        autocast: amp.State,
        held: Callable[[CallKey], bool],
    ) -> CallKey:
        key = keys.key(grad, call.signature, None, requires, autocast)
        if hot is not None:  # the graph traced for exactly these shapes
            return self.sizes.exact(key, hot)
        # the graph whose size guards admit the call, else (a miss) the call's shapes
        found = self.sizes.classify(key, call.shapes(), held)
        return found if found is not None else dataclasses.replace(key, shapes=call.shapes())

    def fits(self, last: CallKey, call: FlatCall, hot: Shapes | None) -> bool:
        return self.sizes.admits(last, call.shapes())

    def earned_new(self, key: CallKey, held: Callable[[CallKey], bool]) -> bool:
        return not held(key)  # a graph traced for exactly these shapes may serve them already

    def miss_reason(self, base: CallKey, call: FlatCall, reason: str) -> str:
        if reason == "new input shape":
            return self.sizes.reason(base, call.shapes()) or reason
        return reason

    def request(self, base: CallKey, call: FlatCall, hot: Shapes | None) -> Request:
        shapes = call.shapes()
        dynamic = None if hot is not None else self.sizes.dynamic_dims(base, shapes)
        # the key's symbolic traces failed: this graph is one per shape for that reason
        per_shape = hot is None and self.sizes.per_shape(base)
        pattern = shapes if dynamic is None else SizeGuards(shapes, dynamic).pattern()
        return Request(pattern, dynamic, per_shape)

    def learned(self, base: CallKey, per_shape: bool, cause: str) -> None:
        if per_shape:
            self.sizes.static_only(base, cause)

    def built(self, base: CallKey, guards: SizeGuards | None, call: FlatCall) -> None:
        self.sizes.add(base, guards if guards is not None else SizeGuards(call.shapes()))

    def settled(
        self,
        keys: KeyMaker,
        grad: bool,
        call: FlatCall,
        requires: list[bool],
        hot: Shapes | None,
        autocast: amp.State,
        base: CallKey,
        guards: SizeGuards | None,
    ) -> CallKey:
        # filed by its guards (`built` made them known)
        return self.sizes.key_of(base, guards if guards is not None else SizeGuards(call.shapes()))

    def clear(self) -> None:
        self.sizes.clear()
