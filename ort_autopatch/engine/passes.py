"""A declared graph pass: one line of a backend's ordered pass list.

Each backend declares its rewrites once, in run order, each named and with when it applies
(`backends/ort/passes.py` over FX graphs, `backends/ort_training/passes.py` over ONNX
graphs); the names and the sources make the backend's cache version, so adding, reordering
or editing a pass retires the graphs stored before. The entry type and the loop that runs a
stage are the same for both, so they live here, below both backends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

G = TypeVar("G")


@dataclass(frozen=True)
class Pass(Generic[G]):
    """A rewrite of the graphs in `G` (the state a stage passes along), and when it runs."""

    name: str
    run: Callable[[G], object]
    applies: Callable[[G], bool] = lambda g: True


def apply(stage: Sequence[Pass[G]], g: G) -> G:
    """Run `stage`'s passes that apply to `g`, in order, in place."""
    for step in stage:
        if step.applies(g):
            step.run(g)
    return g
