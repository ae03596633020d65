"""The gradient graph as this device's session would rather run it: on CPU, ORT's slow
gradient kernels become torch-calling nodes (`torch_in_graph.gradients`), with the ATen
executor when it is compiled.

Done when a session is made, not in the recipe, so the persistent cache keeps a graph that
names no process's callables and asks for no compiled executor; the swap of a stored graph is
kept in the derived cache (`derived.Derived`) when it names none either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from ort_autopatch.engine.backend import Progress
from ort_autopatch.engine.backends.ort_training import agent
from ort_autopatch.engine.backends.ort_training.derived import Derived
from ort_autopatch.engine.recipe import Recipe
from ort_autopatch.engine.signature import FlatCall
from ort_autopatch.engine.store import digest_bytes


class GradientSwap:
    """One backend's swap of gradient nodes: which operators may run in torch
    (`may_route`), whether the ATen executor is compiled, where swaps are kept."""

    def __init__(
        self, derived: Derived, may_route: Callable[[str], bool], compile_executor: bool
    ) -> None:
        self._derived = derived
        self._may_route = may_route
        self._compile_executor = compile_executor

    def _executor_folder(self) -> Path | None:
        """Where the ATen executor is cached; None: it is never compiled (the option is off)."""
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

        return aten_executor.default_folder() if self._compile_executor else None

    def executor_ready(self) -> bool:
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

        return aten_executor.executor(self._executor_folder()) is None

    def for_device(
        self,
        gradient: agent.GradientGraph,
        shapes: dict[str, tuple[int, ...]],
        device: torch.device,
        progress: Progress,
    ) -> tuple[agent.GradientGraph | None, bool]:
        """The gradient graph as this device's session would rather run it (None for the
        recipe's own), and whether the ATen executor it asked for was still compiling: on
        CPU, ORT's slow gradient kernels become torch-calling nodes
        (`torch_in_graph.gradients`). Done here, not in the recipe, so the persistent cache keeps
        a graph that names no process's callables and asks for no compiled executor."""
        if device.type != "cpu":
            return None, False
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import (
            aten_executor,
            gradients,
        )

        compiling = False
        labels = [label for label, _ in gradients.GRADIENTS_IN_TORCH.values()]
        routes = {label: self._may_route(label) for label in labels}
        parts = ["swap", digest_bytes(gradient.model), sorted(shapes.items()), routes]

        def aten() -> bool:
            nonlocal compiling
            progress.phase = "loading the ATen executor"
            try:
                reason = aten_executor.executor(self._executor_folder())
            finally:
                progress.phase = "session"
            compiling = reason == aten_executor.COMPILING
            return reason is None

        asked: list[bool] = []  # what aten() answered, when asked

        def asking() -> bool:
            asked.append(aten())
            return asked[-1]

        # The swap of a stored graph, as a process before this one made it (it parses the
        # graph: `onnx`'s import alone is half a second), when it needed no executor, or
        # needed it and this process has it too.
        stored = self._derived.load(parts)
        if stored is not None and (not stored.meta.get("executor") or aten()):
            model = stored.graphs.get("model")
            if model is None:
                return None, compiling
            return dataclasses.replace(gradient, model=model), compiling
        model = gradients.gradients_in_torch(gradient.model, shapes, self._may_route, asking)
        if not asked or asked[-1]:  # no PythonOp node (they name this process's callables)
            made = {} if model is gradient.model else {"model": model}
            self._derived.save(parts, {"executor": bool(asked)}, made)
        swapped = None if model is gradient.model else dataclasses.replace(gradient, model=model)
        return swapped, compiling


class Quiet:
    """A build's progress that nobody watches (a session made again at a later call: no
    trace, so nothing to learn)."""

    phase = ""

    def specialises(self, cause: str = "") -> None:
        pass

    def core_free(self) -> None:
        pass


def input_shapes(recipe: Recipe, call: FlatCall) -> dict[str, tuple[int, ...]]:
    """The shapes of the call's inputs by graph input name (what the gradient-node swap
    weighs)."""
    return {
        name: tuple(call.tensors[where].shape)
        for name, (kind, where) in recipe.feed_sources.items()
        if kind == "input"
    }
