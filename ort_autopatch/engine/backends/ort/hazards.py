"""Trace hazards of the plain backend's traces, located in the user's code.

aot_autograd traces on fake tensors, so forward's Python code never sees a tensor's data: a
decision from values (`if bool((x > 0).all())`) stops the trace with torch's data-dependent
error, and is a VALUE hazard (no graph can serve it: the class runs in PyTorch with the
place named). Sizes traced as symbols are read freely, except where forward turns one into a
Python value (`len(x)`, `range(x.size(1))`, `int(x.shape[1])`, `torch.split(x, 1, dim=1)`,
`if x.size(1) > 4`): there the trace adds a guard to its `ShapeEnv`, which becomes the
graph's size guard (`plain.symbolic`), and the place is a SHAPE hazard, as the training
build's trace reports it. A first graph traced for the call's exact shapes has no symbols,
hence no guards and no shape hazards: they show from the first symbolic trace on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

import torch

from ort_autopatch.engine import hazards
from ort_autopatch.engine.hazards import Hazard

_TORCH_NN = os.path.join(os.path.dirname(torch.__file__), "nn") + os.sep


Frames = list[tuple[str, int]]  # (file, line), outermost first


def _location(frames: Frames) -> str:
    """file:line of the innermost frame outside torch, this tool and contextlib, followed by
    the innermost frame of torch.nn below it: a model's code inside torch
    (nn.MultiheadAttention's), not the trace's own machinery (decompositions)."""
    inner = None
    for filename, line in reversed(frames):
        if not filename.startswith(hazards._SKIPPED_DIRS) and not filename.startswith("<"):
            where = f"{filename}:{line}"
            return f"{where} (in {inner})" if inner else where
        if inner is None and filename.startswith(_TORCH_NN):
            inner = f"torch/{filename[len(hazards._TORCH_DIR) :]}:{line}"
    return inner or "<unknown>"


def _stack() -> Frames:
    frames = []
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return frames[::-1]


class _LocatedGuards(list[Any]):
    """A `ShapeEnv`'s guard list that notes where in forward each guard was added."""

    def __init__(self) -> None:
        super().__init__()
        self.places: list[str] = []

    def append(self, guard: Any) -> None:
        self.places.append(_location(_stack()))
        super().append(guard)

    def extend(self, guards: Any) -> None:
        for guard in guards:
            self.append(guard)


def locate_guards(env: Any) -> None:
    """Have `env` (a fresh `ShapeEnv`) note the place of every guard its trace adds."""
    env.guards = _LocatedGuards()


def size_hazards(env: Any) -> list[Hazard]:
    """A SHAPE hazard per place where the trace decided something from a symbolic size."""
    guards = env.guards
    if not isinstance(guards, _LocatedGuards) or len(guards) != len(guards.places):
        return []  # another torch keeps its guards otherwise: no places to name
    found: dict[str, Hazard] = {}
    for guard, where in zip(guards, guards.places, strict=True):
        expr = guard.expr
        fixed = getattr(expr, "is_Equality", False) and any(a.is_number for a in expr.args)
        what = (
            "Python int from a size (the graph holds it as a constant)"
            if fixed
            else "Python bool from sizes (a branch the graph's size guards keep)"
        )
        found.setdefault(where, Hazard(hazards.SHAPE, what, where))
    return list(found.values())


def _data_dependent(exc: BaseException) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(exc, (GuardOnDataDependentSymNode, DataDependentOutputException))


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def value_hazard(exc: BaseException) -> Hazard | None:
    """The VALUE hazard a failed trace stopped at (forward read tensor data), or None."""
    found = next((e for e in _causes(exc) if _data_dependent(e)), None)
    if found is None:
        return None
    frames: Frames = []
    names: list[str] = []
    tb: TracebackType | None = found.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    what = next(
        (hazards.CONVERSIONS[name] for name in reversed(names) if name in hazards.CONVERSIONS),
        "Python value from tensor data",
    )
    return Hazard(hazards.VALUE, what, _location(frames))
