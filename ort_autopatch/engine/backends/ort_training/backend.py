"""The training build's backend (`onnxruntime-training`): the `Backend` interface over ORT's
gradient builder and TrainingAgent, and the refusals it makes before any work.

A build (`recipe_build`) exports `forward` with the TorchScript exporter, falls back to static
shapes where ORT 1.19.2 needs them, sends operators ORT cannot differentiate to torch
(`PythonOp`/`ATen` nodes), applies the graph passes and lets ORT build the gradient graph. A
training program is a `TrainingAgent` over that graph (`run.AgentProgram`, through the shared
`graph_function.apply`); an inference program an `InferenceSession` over the forward graph
(`run.SessionProgram`). On CPU, ORT's slow gradient kernels are swapped for torch-calling nodes
when the session is made (`swap`), so the stored recipe (`payload`) names no process's
callables; what a session reads from a stored graph is kept in the derived cache (`derived`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Any, ClassVar

import torch

from ort_autopatch.engine import runtime, session
from ort_autopatch.engine.backend import Backend, Progress, RunHooks
from ort_autopatch.engine.backends.ort_training import agent, recipe_build
from ort_autopatch.engine.backends.ort_training.derived import Derived
from ort_autopatch.engine.backends.ort_training.payload import (
    OrtTrainingPayload,
    payload_of,
)
from ort_autopatch.engine.backends.ort_training.payload import (
    graph_version as _graph_version,
)
from ort_autopatch.engine.backends.ort_training.run import (
    AgentProgram,
    ExecutorUpgrade,
    SessionProgram,
    program_feeds_kept,
    run_effects,
)
from ort_autopatch.engine.backends.ort_training.swap import GradientSwap, Quiet, input_shapes
from ort_autopatch.engine.errors import SessionError, UnsupportedInputError
from ort_autopatch.engine.recipe import EngineOptions, Miss, Recipe
from ort_autopatch.engine.shape_policy import DynamicGraphs, ShapePolicy
from ort_autopatch.engine.signature import FlatCall

log = logging.getLogger("ort_autopatch")


def _require_training_build() -> None:
    """Raise RuntimeUnavailableError (naming what to install) without a training build."""
    runtime.load(training=True)


class OrtTrainingBackend(Backend):
    """ORT's gradient builder and TrainingAgent (`onnxruntime-training` 1.19.2)."""

    name: ClassVar[str] = "ort-training"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._derived = Derived(self.options.cache_dir)
        self._swap = GradientSwap(self._derived, self.may_route, self.options.compile_executor)
        # operators learned to need torch-calling nodes, so later exports start with them
        # (`recipe_build` reads and extends it)
        self.routed: frozenset[str] = frozenset(self.options.torch_ops)

    @classmethod
    def doctor(cls, options: EngineOptions) -> list[tuple[str, str]]:
        """The ATen executor, compiled now if it is not cached, so that no training run starts
        without it (a run would build it in the background, its first graphs without it)."""
        if not options.compile_executor:
            status = "off (--no-compile-executor): gradient nodes call torch through Python"
            return [("ATen executor", status)]
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

        try:
            status = f"ready ({aten_executor.build(aten_executor.default_folder())})"
        except Exception as exc:  # the training still runs, through Python: not a problem
            why = str(exc)[-300:]
            status = f"cannot be built, gradient nodes call torch through Python: {why}"
        return [("ATen executor", status)]

    def shape_policy(self) -> ShapePolicy:
        """One graph with dynamic axes; static-shape graphs for the first shape of a mode and
        for shapes that keep coming back."""
        return DynamicGraphs(self.options.static_after)

    def refuse(self, call: FlatCall) -> None:
        """ORT 1.19.2's gradient kernels reject zero-size dimensions (GemmGrad: K > 0), so a
        training call with an empty batch is refused before it runs (the default fallback
        policy then runs it in PyTorch)."""
        for k, t in enumerate(call.tensors):
            if t.numel() == 0:
                raise UnsupportedInputError(
                    self.module_class,
                    f"input tensor #{k} is empty (shape {tuple(t.shape)}), which ONNX Runtime's "
                    "gradient kernels reject",
                    "Skip empty batches, or keep the default fallback policy (PyTorch runs them)",
                )

    @staticmethod
    def graph_version() -> str:
        return _graph_version()

    @staticmethod
    def payload_from(meta: dict[str, Any], graphs: dict[str, bytes]) -> OrtTrainingPayload:
        return OrtTrainingPayload.from_stored(meta, graphs)

    # -- building ----------------------------------------------------------------------------
    def build(self, miss: Miss, progress: Progress) -> tuple[Recipe, float]:
        _require_training_build()
        if miss.has_backward:
            _refuse_untrainable(self.module_class, miss)
        return recipe_build.build(self, miss, progress)

    def may_route(self, name: str) -> bool:
        return not any(fnmatch.fnmatchcase(name, p) for p in self.options.no_torch_ops)

    # -- sessions ----------------------------------------------------------------------------
    def instantiate(
        self,
        recipe: Recipe,
        miss: Miss,
        hooks: RunHooks,
        settings: session.SessionSettings,
        progress: Progress,
    ) -> AgentProgram | SessionProgram:
        _require_training_build()
        payload = payload_of(recipe)
        device, cls = miss.device, self.module_class
        effects = run_effects(recipe, miss.state)
        capture = self.options.cache_dir is not None and payload.optimized is None
        if payload.gradient is not None:
            shapes = input_shapes(recipe, miss.call)
            swapped, compiling = self._swap.for_device(
                payload.gradient, shapes, miss.device, progress
            )
            program = None
            counts = recipe.torch_nodes
            if swapped is not None:
                facts = self._derived.facts(swapped)
                # ORT's optimised graph would name this process's callables: never stored
                try:
                    program = agent.build_training(
                        swapped, device, settings, cls, None, False, facts
                    )
                    counts = facts.torch_nodes
                except SessionError as exc:
                    # ORT's own shape inference disagrees with the swapped nodes: its kernels
                    log.debug("%s: gradient nodes stay ORT's (%s)", cls, exc)
                    swapped, compiling = None, False
            if program is None:
                runs = payload.gradient
                if payload.optimized is not None:
                    runs = dataclasses.replace(runs, model=payload.optimized)
                program = agent.build_training(
                    payload.gradient,
                    device,
                    settings,
                    cls,
                    payload.optimized,
                    capture,
                    self._derived.facts(runs),
                )
                if payload.optimized is None and program.optimized is not None:
                    payload.optimized = program.optimized
                    # the facts a warm start of the stored graph reads, kept now: else its
                    # first call parses the optimised graph, importing onnx (half a second)
                    self._derived.facts(dataclasses.replace(runs, model=program.optimized))
            ran = swapped or payload.gradient
            kept = program_feeds_kept(recipe, program.feed_names)
            upgrade = None
            if compiling:
                gradient = payload.gradient

                def with_executor() -> agent.GradientGraph | None:
                    if not self._swap.executor_ready():  # it failed, or another build still runs
                        return None
                    made, _ = self._swap.for_device(gradient, shapes, device, Quiet())
                    return made

                upgrade = ExecutorUpgrade(cls, recipe, with_executor, device, settings)
            saved = {"gradient": ran.model}
            return AgentProgram(program, effects, hooks, kept, counts, saved, upgrade)
        inference = agent.build_inference(
            payload.optimized or recipe.forward_model,
            device,
            settings,
            cls,
            optimized=payload.optimized is not None,
            capture=capture,
        )
        payload.optimized = payload.optimized or inference.optimized
        kept = program_feeds_kept(recipe, inference.feed_names)
        return SessionProgram(inference, effects, hooks, kept, recipe.torch_nodes)


#: dtypes ORT 1.19.2 has too few gradient kernels for (agent._refuse_dtypes reads graphs).
_UNTRAINABLE_DTYPES = {
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}


def _refuse_untrainable(cls: str, miss: Miss) -> None:
    """Refuse a training build whose trainable parameters have a dtype ORT cannot
    differentiate before exporting anything (the gradient build would refuse the graph later,
    after the export's whole cost: minutes for a float64 LSTMCell loop over 1000 steps)."""
    state = miss.state
    found: dict[str, list[str]] = {}
    for name, tensor, is_param in zip(state.names, state.tensors, state.is_param, strict=True):
        dtype = _UNTRAINABLE_DTYPES.get(tensor.dtype)
        if is_param and tensor.requires_grad and dtype is not None:
            found.setdefault(dtype, []).append(name)
    if found:
        raise agent.untrainable(cls, found)
