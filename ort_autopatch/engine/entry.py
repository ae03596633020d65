"""A cached graph as a call runs it: the hot path below the cache lookup.

An `Entry` is a recipe made runnable: its backend's program (`backends.Program`), where each
feed comes from (an argument of the call or one of the module's tensors) and what the run
changes besides its outputs. Nothing here builds anything; `build.py` makes entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ort_autopatch.engine import calls, signature
from ort_autopatch.engine.backend import Program
from ort_autopatch.engine.errors import ExecutionError
from ort_autopatch.engine.recipe import Recipe
from ort_autopatch.engine.state import ModuleState

if TYPE_CHECKING:
    from ort_autopatch.engine.verify import Kept


@dataclass
class Entry:
    recipe: Recipe
    program: Program
    # per feed of `program.feed_names`: (True, user tensor index) or (False, index into
    # ModuleState.tensors)
    feeds: list[tuple[bool, int]]
    #: the run of the call that built this entry, made by the build's first-call check
    #: (`verify.Kept`): that call's alone, taken once (`take_first`)
    first: tuple[signature.FlatCall, Kept] | None = field(default=None, repr=False, compare=False)

    def take_first(self, call: signature.FlatCall) -> tuple[bool, Any]:
        """(True, its result) where `call` is the one whose run the build kept; else
        (False, None). The kept run is let go of either way: one another call finds was not
        taken, and has changed nothing (`Kept.take`)."""
        first, self.first = self.first, None
        if first is None or first[0] is not call:
            return False, None
        return True, first[1].take()

    def run(self, state: ModuleState, call: signature.FlatCall, recompute: bool = False) -> Any:
        user, tensors = call.tensors, state.tensors
        feeds = [user[i] if is_user else tensors[i] for is_user, i in self.feeds]
        checks = self.recipe.checks
        undo = self.program.undo_point(feeds) if checks else None
        try:
            outputs = self.program.run(feeds, recompute)
        except ExecutionError as exc:
            if undo is None or call.shapes() == self.recipe.traced_shapes:
                raise  # a failure of the graph itself, not of sizes it was not traced for
            # A graph that froze sizes (checks) and fails on other sizes: its structure
            # follows them (a split over time), so it is one graph per shape from now on.
            undo()
            raise Specialises(checks[0].hazard.where) from exc
        if checks:
            computed, at = outputs[-1].tolist(), 0
            for check in checks:
                width = check.width
                got = computed[at : at + width] if check.is_list else computed[at]
                at += width
                if not check.holds(got):
                    assert undo is not None
                    undo()
                    raise Specialises(check.hazard.where)
        result = self.recipe.output_spec.rebuild(outputs)
        if type(result) is calls.BufferUpdates:
            with torch.no_grad():
                for name, value in result.buffers.items():
                    tensors[state.index[name]].copy_(value)
            result = result.output
        return result


class Specialises(Exception):
    """A graph's check failed for this call: the model specialises on sizes after all."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where
