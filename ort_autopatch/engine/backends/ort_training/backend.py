"""The training build's backend (`onnxruntime-training`): ORT's gradient builder and TrainingAgent.

A build exports `forward` once with the TorchScript exporter (`export.py`; the trace's hazards
judged), falls back to static shapes where ORT 1.19.2 needs them, sends operators ORT cannot
differentiate to torch (`PythonOp`/`ATen` nodes) and exports again, applies the graph passes,
and lets ORT's `OrtModuleGraphBuilder` build the gradient graph (`agent.build_gradient`). A
training program is a `TrainingAgent` over that graph (`run.TrainingGraph`, through the
shared `graph_function.apply`); an
inference program an `InferenceSession` over the forward graph. On CPU, ORT's slow gradient
kernels are swapped for torch-calling nodes when the session is made
(`torch_in_graph/gradients.py`), so the stored recipe names no process's callables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import hashlib
import logging
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine import (
    budget,
    hazards,
    persist,
    random_ops,
    rng,
    runtime,
    session,
)
from ort_autopatch.engine.backend import Backend, Progress, RunHooks
from ort_autopatch.engine.backends.ort_training import agent, heap
from ort_autopatch.engine.backends.ort_training.run import (
    AgentProgram,
    ExecutorUpgrade,
    SessionProgram,
    program_feeds_kept,
    run_effects,
)
from ort_autopatch.engine.backends.ort_training.torch_in_graph import nodes
from ort_autopatch.engine.errors import (
    AutocastUnsupportedError,
    ExportError,
    GradientBuildError,
    SessionError,
    UnsupportedInputError,
    UnsupportedModelError,
)
from ort_autopatch.engine.recipe import EngineOptions, Miss, Recipe
from ort_autopatch.engine.shape_policy import DynamicGraphs, ShapePolicy
from ort_autopatch.engine.signature import FlatCall
from ort_autopatch.engine.state import ModuleState
from ort_autopatch.engine.store import DERIVED, StoredEntry, digest, digest_bytes

if TYPE_CHECKING:
    from ort_autopatch.engine.backends.ort_training import export

log = logging.getLogger("ort_autopatch")

#: Operators whose gradients need static shapes in ORT 1.19.2 (see OrtTrainingBackend._capture).
_STATIC_SHAPE_OPS = ("MaxPool", "AveragePool", "LpPool")


class _NeedsStaticShapes(Exception):
    pass


@dataclass
class OrtTrainingPayload:
    """The training build's part of a recipe."""

    gradient: agent.GradientGraph | None  # None: an inference recipe
    optimized: bytes | None = None  # ORT's optimised form of the graph that runs

    def graphs(self) -> dict[str, bytes]:
        graphs = {}
        if self.gradient is not None:
            graphs["gradient"] = self.gradient.model
        if self.optimized is not None:
            graphs["optimized"] = self.optimized
        return graphs

    def meta(self) -> dict[str, Any]:
        g = self.gradient
        return {
            "gradient": None
            if g is None
            else {
                "num_forward_outputs": g.num_forward_outputs,
                "num_outputs": g.num_outputs,
                "non_differentiable": g.non_differentiable,
                "full_shape_grads": g.full_shape_grads,
                "grad_of": g.grad_of,
            }
        }


def _require_training_build() -> None:
    """Raise RuntimeUnavailableError (naming what to install) without a training build."""
    runtime.load(training=True)


class OrtTrainingBackend(Backend):
    """ORT's gradient builder and TrainingAgent (`onnxruntime-training` 1.19.2)."""

    name: ClassVar[str] = "ort-training"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._derived = _Derived(self.options.cache_dir)
        # operators learned to need torch-calling nodes, so later exports start with them
        self._routed: frozenset[str] = frozenset(self.options.torch_ops)

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
        g = meta["gradient"]
        gradient = None
        if g is not None:
            gradient = agent.GradientGraph(
                model=graphs["gradient"],
                num_forward_outputs=int(g["num_forward_outputs"]),
                num_outputs=int(g["num_outputs"]),
                non_differentiable=[int(i) for i in g["non_differentiable"]],
                full_shape_grads=[int(i) for i in g["full_shape_grads"]],
                grad_of={str(k): str(v) for k, v in g["grad_of"].items()},
            )
        # No `onnx.checker` (its import alone costs half a second): the store's checksums say
        # these are the bytes this tool wrote, and ONNX Runtime refuses an invalid graph as it
        # loads it, which the engine then builds again.
        return OrtTrainingPayload(gradient, graphs.get("optimized"))

    # -- building ----------------------------------------------------------------------------
    def build(self, miss: Miss, progress: Progress) -> tuple[Recipe, float]:
        _require_training_build()
        if miss.has_backward:
            _refuse_untrainable(self.module_class, miss)
        return self._build(miss, progress)

    def _build(self, miss: Miss, progress: Progress) -> tuple[Recipe, float]:
        from ort_autopatch.engine.backends.ort_training import graph

        dynamic = miss.shapes is None
        try:
            exported = self._export(miss, progress, dynamic=dynamic)
            if dynamic and exported.findings.static:
                # The trace froze sizes: this graph serves one input shape, and ORT gets it with
                # static shapes (its gradient builder can abort on a dynamic graph whose
                # structure was sized for one example, e.g. a Split unrolled over time).
                dynamic = False
                exported = self._export(miss, progress, dynamic=False)
            model = graph.load(exported.model_bytes)
            if (
                dynamic
                and miss.has_backward
                and any(graph.has_op(model, op) for op in _STATIC_SHAPE_OPS)
            ):
                raise _NeedsStaticShapes
            budget.check("before its gradient build")
            progress.phase = "gradient build"
            recipe, exported = self._routed_recipe(miss, progress, exported, model, dynamic)
            return recipe, exported.seconds
        except (_NeedsStaticShapes, ExportError, GradientBuildError) as exc:
            if not dynamic:
                raise
            # Pooling gradients in ORT 1.19.2 crash the process on dynamic shapes (MaxPoolGrad
            # SIGSEGV, AveragePoolGrad SIGFPE) and adaptive pooling only exports with known
            # sizes: such modules get one graph per input shape instead.
            log.debug("%s: building with static shapes (%s)", self.module_class, type(exc).__name__)
            progress.phase = "export"
            exported = self._export(miss, progress, dynamic=False)
            model = graph.load(exported.model_bytes)
            progress.phase = "gradient build"
            recipe, exported = self._routed_recipe(miss, progress, exported, model, dynamic=False)
            progress.specialises()
            return recipe, exported.seconds

    def may_route(self, name: str) -> bool:
        return not any(fnmatch.fnmatchcase(name, p) for p in self.options.no_torch_ops)

    def _routed_recipe(
        self,
        miss: Miss,
        progress: Progress,
        exported: export.ExportedGraph,
        model: Any,
        dynamic: bool,
    ) -> tuple[Recipe, export.ExportedGraph]:
        """The recipe; when ORT cannot differentiate an operator, the ATen operators whose
        export produced it become torch-calling nodes and the call is exported again."""
        from ort_autopatch.engine.backends.ort_training import graph
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import routing

        device = miss.device
        while True:
            try:
                recipe = self._recipe(miss, exported, model)
                gradient = _payload(recipe).gradient
                missing = set()
                if gradient is not None:
                    missing = routing.unrunnable_gradients(gradient.model, device)
                if not missing:
                    self._routed = self._routed | exported.routed
                    return recipe, exported
                culprits = set().union(
                    *(routing.producers(op, exported.provenance) for op in missing)
                )
                failure: Exception = GradientBuildError(
                    self.module_class,
                    f"ONNX Runtime has no {device.type} kernel for the gradient of "
                    + ", ".join(sorted(missing)),
                    "Allow the operators producing it to run as torch-calling nodes, or run "
                    "this class eagerly",
                )
            except GradientBuildError as exc:
                culprits = routing.culprits(exc.cause, exported.provenance)
                failure = exc
            more = {c for c in culprits if self.may_route(c)} - exported.routed
            if not more:
                raise failure
            log.debug(
                "%s: %s become torch-calling nodes", self.module_class, ", ".join(sorted(more))
            )
            routed = exported.routed | more
            exported = self._export(miss, progress, dynamic=dynamic, routed=routed)
            model = graph.load(exported.model_bytes)

    def _export(
        self,
        miss: Miss,
        progress: Progress,
        dynamic: bool,
        routed: frozenset[str] | None = None,
    ) -> export.ExportedGraph:
        from ort_autopatch.engine.backends.ort_training import export
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import routing

        forward, module, call = self.forward, miss.module, miss.call
        chosen = self._routed if routed is None else routed
        chosen = chosen | {r for r in routing.default_routes(miss.device) if self.may_route(r)}
        exported = export.export_call(
            module,
            lambda *a, **k: forward(module, *a, **k),
            call.spec(),
            call.tensors,
            opset=self.options.opset,
            dynamic=dynamic,
            routed=chosen,
            may_route=self.may_route,
        )
        self._judge(progress, exported.findings)
        return exported

    def _judge(self, progress: Progress, findings: hazards.Findings) -> None:
        """Decide what a trace's hazards allow: none at all when forward decided something
        from tensor values; a graph per input shape when the graph's structure follows the
        sizes; otherwise one graph that recomputes the size-derived values it froze (checks)."""
        found = findings.hazards
        self.found(found)
        if hazards.worst(found) == hazards.VALUE:
            raise self.data_dependent([h for h in found if h.kind == hazards.VALUE])
        if findings.static:
            log.debug(
                "%s: the trace froze sizes (%s); one graph per input shape",
                self.module_class,
                "; ".join(h.describe() for h in found),
            )
            progress.specialises()

    def _recipe(self, miss: Miss, exported: export.ExportedGraph, model: Any) -> Recipe:
        """Apply the graph passes (and the gradient build) to a fresh export."""
        from ort_autopatch.engine.backends.ort_training import graph, passes

        state, call, grad = miss.state, miss.call, miss.has_backward
        refusal = amp.cpu_refusal(model, miss.autocast)
        if refusal is not None:
            raise AutocastUnsupportedError(self.module_class, refusal, amp.REMEDY)
        padding = _embedding_padding(state, exported.state_names)
        passed = passes.apply_forward(model, grad, padding)
        frozen, stats = passed.frozen, passed.batch_norms

        user_index = {name: k for k, name in enumerate(exported.user_input_names)}
        sources: dict[str, tuple[str, Any]] = {}
        for graph_input in model.graph.input:
            name = graph_input.name
            if name in user_index:
                sources[name] = ("input", user_index[name])
                continue
            base = name[: -len("__frozen")] if name in frozen else name
            qualified = exported.state_names.get(base)
            if qualified is None or qualified not in state.index:
                raise UnsupportedModelError(
                    self.module_class,
                    f"graph input {name!r} is neither an argument nor a parameter or buffer",
                    "Report the model; run it eagerly meanwhile",
                )
            sources[name] = ("state", qualified)
        outputs = [o.name for o in model.graph.output]
        batch_norms = [
            (
                exported.state_names[s.running_mean].rsplit(".", 1)[0],
                outputs.index(s.mean_output),
                outputs.index(s.var_output),
            )
            for s in stats
        ]
        model_bytes = model.SerializeToString()
        gradient = None
        if grad:
            requiring = [
                n
                for n, (kind, where) in sources.items()
                if kind == "input" and call.tensors[where].requires_grad
            ]
            trainable = [
                n
                for n, (kind, where) in sources.items()
                if kind == "state"
                and n not in frozen
                and state.is_param[state.index[where]]
                and state.tensors[state.index[where]].requires_grad
            ]
            from ort_autopatch.engine.backends.ort_training.torch_in_graph import gradients

            extra = [n for s in stats for n in (s.mean_output, s.var_output)]
            cpu = miss.device.type == "cpu"
            # the first step's activations land in heap pages faulted in while the child builds
            with heap.FirstStepPages() if cpu else contextlib.nullcontext() as pages:
                built = agent.build_gradient(
                    model_bytes,
                    feed_names=list(sources),
                    trainable=trainable + requiring,
                    inputs_requiring_grad=requiring,
                    user_inputs=exported.user_input_names,
                    extra_outputs=extra,
                    cls=self.module_class,
                    # ORT's cast propagation would undo autocast's casts (float32 out again)
                    propagate_casts=miss.autocast is None,
                    meanwhile=gradients.warm_up if cpu else None,
                    while_waiting=pages.more if pages is not None else None,
                )
            done = passes.apply_gradient(graph.load(built.model), extra, built.num_forward_outputs)
            gradient = dataclasses.replace(
                built,
                model=done.model.SerializeToString(),
                num_forward_outputs=done.num_forward_outputs,
            )
        return Recipe(
            backend=self.name,
            has_backward=grad,
            forward_model=model_bytes,
            payload=OrtTrainingPayload(gradient),
            feed_sources=sources,
            num_user_outputs=passed.num_user_outputs,
            output_spec=exported.output_spec,
            batch_norms=batch_norms,
            seeds_dropout=rng.draws_per_run(model),
            redraws=bool(random_ops.per_session(model)),
            torch_nodes=nodes.Inventory.of(model).counts,
            checks=exported.checks,
            traced_shapes=call.shapes(),
        )

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
        payload = _payload(recipe)
        device, cls = miss.device, self.module_class
        effects = run_effects(recipe, miss.state)
        capture = self.options.cache_dir is not None and payload.optimized is None
        if payload.gradient is not None:
            shapes = _input_shapes(recipe, miss.call)
            swapped, compiling = self._for_device(payload.gradient, shapes, miss.device, progress)
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
                payload.optimized = payload.optimized or program.optimized
            ran = swapped or payload.gradient
            kept = program_feeds_kept(recipe, program.feed_names)
            upgrade = None
            if compiling:
                gradient = payload.gradient

                def with_executor() -> agent.GradientGraph | None:
                    if not self._executor_ready():  # it failed, or another build still runs
                        return None
                    made, _ = self._for_device(gradient, shapes, device, _Quiet())
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

    def _executor_folder(self) -> Path | None:
        """Where the ATen executor is cached; None: it is never compiled (the option is off)."""
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

        return aten_executor.default_folder() if self.options.compile_executor else None

    def _executor_ready(self) -> bool:
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

        return aten_executor.executor(self._executor_folder()) is None

    def _for_device(
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
        routes = {label: self.may_route(label) for label in labels}
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
        model = gradients.gradients_in_torch(gradient.model, shapes, self.may_route, asking)
        if not asked or asked[-1]:  # no PythonOp node (they name this process's callables)
            made = {} if model is gradient.model else {"model": model}
            self._derived.save(parts, {"executor": bool(asked)}, made)
        swapped = None if model is gradient.model else dataclasses.replace(gradient, model=model)
        return swapped, compiling


class _Quiet:
    """A build's progress that nobody watches (a session made again at a later call: no
    trace, so nothing to learn)."""

    phase = ""

    def specialises(self, cause: str = "") -> None:
        pass


def _input_shapes(recipe: Recipe, call: FlatCall) -> dict[str, tuple[int, ...]]:
    """The shapes of the call's inputs by graph input name (what the gradient-node swap
    weighs)."""
    return {
        name: tuple(call.tensors[where].shape)
        for name, (kind, where) in recipe.feed_sources.items()
        if kind == "input"
    }


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


#: besides the declared passes (`passes.version`): the sources that decide what the exporter
#: writes (its call protocol, the extra symbolics, which operators become torch-calling nodes)
_EXPORT_SOURCES = ("export.py", "symbolics.py", "torch_in_graph/routing.py")


def _payload(recipe: Recipe) -> OrtTrainingPayload:
    payload = recipe.payload
    assert isinstance(payload, OrtTrainingPayload), f"a {recipe.backend} recipe"
    return payload


@functools.cache
def _graph_version() -> str:
    """The passes' declared order and source (`passes.py`, `graph.py`), the exporter's sources
    and onnx's version, read from files and metadata (a cache hit imports neither the passes
    nor `onnx`): a change to any of them gives the persistent cache new keys."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for name in ("passes.py", "graph.py", *_EXPORT_SOURCES):
        digest.update((package / name).read_bytes())
    try:
        digest.update(f"onnx={metadata.version('onnx')}".encode())
    except metadata.PackageNotFoundError:
        digest.update(b"onnx=none")
    return digest.hexdigest()[:16]


@functools.cache
def _derived_version() -> str:
    """A digest of the code that derives from a stored graph what `_Derived` keeps."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for name in ("agent.py", "graph.py", "torch_in_graph/gradients.py", "torch_in_graph/nodes.py"):
        digest.update((package / name).read_bytes())
    return digest.hexdigest()[:16]


class _Derived:
    """What a session over a stored graph needs that is read from the graph's ONNX (its
    agent's facts, the CPU swap of gradient nodes), kept in the graph cache (`--cache-dir`)
    beside the entries, keyed by a digest of the graph's bytes: a process that loads a stored
    graph then parses no ONNX and never imports `onnx`. Only what names no process's
    callables is kept (PythonOp nodes do)."""

    FOLDER = DERIVED

    def __init__(self, cache_dir: Path | str | None) -> None:
        self._store = None if cache_dir is None else persist.store_for(Path(cache_dir))

    def _key(self, parts: list[Any]) -> str:
        from ort_autopatch.versions import __version__

        return digest([__version__, _derived_version(), *parts])

    def load(self, parts: list[Any]) -> StoredEntry | None:
        if self._store is None:
            return None
        return self._store.load(self.FOLDER, self._key(parts))

    def save(self, parts: list[Any], meta: dict[str, Any], graphs: dict[str, bytes]) -> None:
        if self._store is not None:
            self._store.save(self.FOLDER, self._key(parts), meta, graphs, [])

    def facts(self, gradient: agent.GradientGraph) -> agent.GraphFacts:
        """The agent's facts of a gradient graph (`agent.graph_facts`)."""
        if self._store is None:
            return agent.graph_facts(gradient.model, gradient.num_outputs)
        parts = ["facts", digest_bytes(gradient.model), gradient.num_outputs]
        stored = self.load(parts)
        if stored is not None:
            try:
                return agent.GraphFacts.from_meta(stored.meta)
            except (KeyError, TypeError, ValueError):
                pass
        facts = agent.graph_facts(gradient.model, gradient.num_outputs)
        if not facts.python_nodes:
            self.save(parts, facts.meta(), {})
        return facts


def _embedding_padding(state: ModuleState, state_names: dict[str, str]) -> dict[str, int]:
    """Graph input name of each nn.Embedding weight with a padding_idx -> that index."""
    by_qualified = {q: g for g, q in state_names.items()}
    found: dict[str, int] = {}
    for name, module in state.named_modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            weight = f"{name}.weight" if name else "weight"
            index = state.index.get(weight)
            if index is None:  # tied: find the tensor's first name
                matches = [
                    n for n, t in zip(state.names, state.tensors, strict=True) if t is module.weight
                ]
                if not matches:
                    continue
                weight = matches[0]
            graph_name = by_qualified.get(weight)
            if graph_name is not None:
                padding = module.padding_idx
                found[graph_name] = padding if padding >= 0 else padding + module.num_embeddings
    return found
