"""Building a graph for a call that missed the cache: the cold path.

From the persistent cache when it holds one, else: export `forward` (TorchScript exporter,
with the trace's hazards judged), fall back to static shapes where ORT needs them, send
operators ORT cannot differentiate to torch and export again, apply the graph passes, build
the gradient graph, and instantiate the sessions. `ModuleEngine` (the hot path) calls
`Builder.build` under its build lock and files the entry in its cache.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine import bridge, budget, export, graph, hazards, rng, session, torch_nodes
from ort_autopatch.engine.callkey import KeyMaker
from ort_autopatch.engine.entry import Entry
from ort_autopatch.engine.errors import (
    AutocastUnsupportedError,
    DataDependentError,
    ExecutionError,
    ExportError,
    GradientBuildError,
    SessionError,
    UnsupportedInputError,
    UnsupportedModelError,
)
from ort_autopatch.engine.persist import Persistence
from ort_autopatch.engine.recipe import BuildRecord, EngineOptions, Miss, Recipe
from ort_autopatch.engine.state import ModuleState

log = logging.getLogger("ort_autopatch")

#: Operators whose gradients need static shapes in ORT 1.19.2 (see Builder._export_recipe).
_STATIC_SHAPE_OPS = ("MaxPool", "AveragePool", "LpPool")
#: After this many seconds a build says, while it runs, that it is still working.
SLOW_BUILD_SECONDS = 2.0


#: ORT's refusal of a node it has no kernel for (the operator's name is group 1)
_MISSING_KERNEL = re.compile(r"Could not find an implementation for (\w+)\(")
_AUTOCAST_REMEDY = (
    "A known limitation: these calls run in PyTorch under this autocast, and calls outside it "
    "in ONNX Runtime"
)


class _NeedsStaticShapes(Exception):
    pass


def load_model(model_bytes: bytes) -> Any:
    import onnx

    return onnx.load_from_string(model_bytes)


class Builder:
    """Builds the graphs of one module instance; remembers what its builds learned (which
    operators run in torch, the trace hazards found) and what they cost (`records`)."""

    def __init__(
        self,
        cls: str,
        options: EngineOptions,
        forward: Callable[..., Any],
        keys: KeyMaker,
        persistence: Persistence,
        settings: session.SessionSettings,
        backward_failed: Callable[[ExecutionError], None] | None = None,
    ) -> None:
        self._cls = cls
        self._backward_failed = backward_failed  # told when a graph's backward fails
        self.options = options
        self._forward = forward
        self._keys = keys
        self._persistence = persistence
        self.settings = settings
        self.records: list[BuildRecord] = []
        self.hazards: list[hazards.Hazard] = []  # every trace hazard found, for reports
        # operators learned to need torch-calling nodes, so later exports start with them
        self._routed: frozenset[str] = frozenset(options.torch_ops)

    def build(self, miss: Miss, reason: str) -> Entry:
        """Build the graph of one key: for the call's shapes only when the model specialises
        on sizes (`miss.per_shape`, which the build may turn on) or the shapes earned a
        static-shape graph (`miss.hot`). The export runs under the call's autocast state (this
        thread's), so it traces autocast's casts."""
        try:
            return self._build(miss, reason)
        except SessionError as exc:
            missing = _MISSING_KERNEL.search(exc.cause)
            if miss.autocast is None or missing is None:
                raise
            raise AutocastUnsupportedError(
                self._cls,
                f"ONNX Runtime's {miss.autocast[0]} build has no "
                f"{amp.describe(miss.autocast).split()[-1]} kernel for {missing.group(1)}, "
                "which autocast's casts ask for",
                _AUTOCAST_REMEDY,
            ) from None

    def _build(self, miss: Miss, reason: str) -> Entry:
        limits = budget.Limits(self.options.max_build_seconds, self.options.max_graph_nodes)
        with _progress(self._cls) as progress, budget.limited(self._cls, limits):
            start = time.perf_counter()
            persisted = self._persistent_key(miss)
            if persisted is not None:
                stored = self._persistence.load(persisted, miss.module)
                if stored is not None:
                    progress.phase = "session"
                    entry = self._instantiate(stored, miss, progress)
                    self._record(
                        reason,
                        0.0,
                        time.perf_counter() - start,
                        miss.grad,
                        from_disk=True,
                        torch_nodes=entry.torch_nodes,
                    )
                    return entry
            if miss.grad:
                _refuse_untrainable(self._cls, miss)
            recipe, export_seconds = self._export_recipe(miss, progress)
            budget.check("before creating its ONNX Runtime session")
            progress.phase = "session"
            entry = self._instantiate(recipe, miss, progress)
            self._record(
                reason,
                export_seconds,
                time.perf_counter() - start - export_seconds,
                miss.grad,
                torch_nodes=entry.torch_nodes,
            )
            self.records[-1].per_shape = miss.per_shape
            self.records[-1].hot_shape = miss.hot is not None and not miss.per_shape
        # Recomputed: the build may have switched every graph to static shapes.
        self._persistence.save(
            miss.module,
            entry.recipe,
            entry.gradient,
            miss.call,
            miss.grad,
            self._persistent_key(miss),
            base_key=persisted,
        )
        return entry

    def _persistent_key(self, miss: Miss) -> str | None:
        if not self._persistence.enabled:
            return None
        requires = miss.state.requires_grad_flags() if miss.grad else []
        key = self._keys.key(miss.grad, miss.call.signature, miss.shapes(), requires, miss.autocast)
        return self._persistence.key(miss.module, miss.state, key, miss.device)

    def _record(
        self,
        reason: str,
        export_s: float,
        build_s: float,
        grad: bool,
        from_disk: bool = False,
        torch_nodes: dict[str, int] | None = None,
    ) -> None:
        record = BuildRecord(reason, export_s, build_s, grad, from_disk, dict(torch_nodes or {}))
        self.records.append(record)
        log.debug(
            "%s: %s %s graph (%s) in %.3fs export + %.3fs build",
            self._cls,
            "loaded" if from_disk else "built",
            "training" if grad else "inference",
            reason,
            export_s,
            build_s,
        )

    def _export_recipe(self, miss: Miss, progress: _Progress) -> tuple[Recipe, float]:
        dynamic = miss.shapes() is None
        grad = miss.grad
        try:
            exported = self._export(miss, dynamic=dynamic)
            if dynamic and miss.per_shape:
                # The trace froze sizes: this graph serves one input shape, and ORT gets it with
                # static shapes (its gradient builder can abort on a dynamic graph whose
                # structure was sized for one example, e.g. a Split unrolled over time).
                dynamic = False
                exported = self._export(miss, dynamic=False)
            model = load_model(exported.model_bytes)
            if dynamic and grad and any(graph.has_op(model, op) for op in _STATIC_SHAPE_OPS):
                raise _NeedsStaticShapes
            budget.check("before its gradient build")
            progress.phase = "gradient build"
            recipe, exported = self._routed_recipe(miss, exported, model, dynamic)
            return recipe, exported.seconds
        except (_NeedsStaticShapes, ExportError, GradientBuildError) as exc:
            if not dynamic:
                raise
            # Pooling gradients in ORT 1.19.2 crash the process on dynamic shapes (MaxPoolGrad
            # SIGSEGV, AveragePoolGrad SIGFPE) and adaptive pooling only exports with known
            # sizes: such modules get one graph per input shape instead.
            log.debug("%s: building with static shapes (%s)", self._cls, type(exc).__name__)
            progress.phase = "export"
            exported = self._export(miss, dynamic=False)
            model = load_model(exported.model_bytes)
            progress.phase = "gradient build"
            recipe, exported = self._routed_recipe(miss, exported, model, dynamic=False)
            miss.per_shape = True
            return recipe, exported.seconds

    def may_route(self, name: str) -> bool:
        return not any(fnmatch.fnmatchcase(name, p) for p in self.options.no_torch_ops)

    def _routed_recipe(
        self, miss: Miss, exported: export.ExportedGraph, model: Any, dynamic: bool
    ) -> tuple[Recipe, export.ExportedGraph]:
        """The recipe; when ORT cannot differentiate an operator, the ATen operators whose
        export produced it become torch-calling nodes and the call is exported again."""
        from ort_autopatch.engine import torch_ops

        device = miss.device
        while True:
            try:
                recipe = self._recipe(miss, exported, model)
                missing = set()
                if recipe.gradient is not None:
                    missing = torch_ops.unrunnable_gradients(recipe.gradient.model, device)
                if not missing:
                    self._routed = self._routed | exported.routed
                    return recipe, exported
                culprits = set().union(
                    *(torch_ops.producers(op, exported.provenance) for op in missing)
                )
                failure: Exception = GradientBuildError(
                    self._cls,
                    f"ONNX Runtime has no {device.type} kernel for the gradient of "
                    + ", ".join(sorted(missing)),
                    "Allow the operators producing it to run as torch-calling nodes, or run "
                    "this class eagerly",
                )
            except GradientBuildError as exc:
                culprits = torch_ops.culprits(exc.cause, exported.provenance)
                failure = exc
            more = {c for c in culprits if self.may_route(c)} - exported.routed
            if not more:
                raise failure
            log.debug("%s: %s become torch-calling nodes", self._cls, ", ".join(sorted(more)))
            exported = self._export(miss, dynamic=dynamic, routed=exported.routed | more)
            model = load_model(exported.model_bytes)

    def _export(
        self, miss: Miss, dynamic: bool, routed: frozenset[str] | None = None
    ) -> export.ExportedGraph:
        from ort_autopatch.engine import torch_ops

        forward, module, call = self._forward, miss.module, miss.call
        chosen = self._routed if routed is None else routed
        chosen = chosen | {r for r in torch_ops.default_routes(miss.device) if self.may_route(r)}
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
        self._judge(miss, exported.findings)
        return exported

    def _judge(self, miss: Miss, findings: hazards.Findings) -> None:
        """Decide what a trace's hazards allow: none at all when forward decided something
        from tensor values; a graph per input shape when the graph's structure follows the
        sizes; otherwise one graph that recomputes the size-derived values it froze (checks)."""
        found = findings.hazards
        known = set(self.hazards)
        self.hazards.extend(h for h in found if h not in known)
        worst = hazards.worst(found)
        if worst == hazards.VALUE:
            places = "; ".join(h.describe() for h in found if h.kind == hazards.VALUE)
            raise DataDependentError(
                self._cls,
                f"forward decides from tensor values, which a graph would freeze ({places})",
                "It runs in PyTorch; compute such decisions outside the selected module, or "
                "exclude the class (ORT_AUTOPATCH_EXCLUDE) to silence this",
            )
        if findings.static and not miss.per_shape:
            log.debug(
                "%s: the trace froze sizes (%s); one graph per input shape",
                self._cls,
                "; ".join(h.describe() for h in found),
            )
            miss.per_shape = True

    def _recipe(self, miss: Miss, exported: export.ExportedGraph, model: Any) -> Recipe:
        """Apply the graph passes (and the gradient build) to a fresh export."""
        state, call, grad = miss.state, miss.call, miss.grad
        refusal = amp.cpu_refusal(model, miss.autocast)
        if refusal is not None:
            raise AutocastUnsupportedError(self._cls, refusal, _AUTOCAST_REMEDY)
        graph.name_outputs(model)
        num_user_outputs = len(model.graph.output)
        graph.relax_shapes(model)
        graph.torch_node_mode(model, grad)
        graph.layer_norm_outputs(model)
        graph.cross_entropy_log_prob(model)
        graph.attention_dropout(model)
        graph.gather_without_axis_move(model)
        padding = _embedding_padding(state, exported.state_names)
        frozen = graph.embedding_padding(model, padding) if grad and padding else []
        if grad:
            graph.eval_batch_norm_arithmetic(model)
        graph.torch_node_shapes_unknown(model, grad)
        stats = graph.batch_norm_statistics(model)

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
                    self._cls,
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
            gradient = session.build_gradient(
                model_bytes,
                feed_names=list(sources),
                trainable=trainable + requiring,
                inputs_requiring_grad=requiring,
                user_inputs=exported.user_input_names,
                extra_outputs=[n for s in stats for n in (s.mean_output, s.var_output)],
                cls=self._cls,
                # ORT's cast propagation would undo autocast's casts (float32 out again)
                propagate_casts=miss.autocast is None,
            )
        return Recipe(
            training=grad,
            forward_model=model_bytes,
            gradient=gradient,
            feed_sources=sources,
            num_user_outputs=num_user_outputs,
            output_spec=exported.output_spec,
            batch_norms=batch_norms,
            seeds_dropout=rng.draws_per_run(model),
            torch_nodes=torch_nodes.Inventory.of(model).counts,
            checks=exported.checks,
            traced_shapes=call.shapes(),
        )

    def _instantiate(self, recipe: Recipe, miss: Miss, progress: _Progress) -> Entry:
        """Sessions for a recipe, bound to this module's tensors; a graph that serves one input
        shape (`Miss.one_shape`) allocates from the shared arena (`memory_arena`), as its steps
        ask for the same sizes every time."""
        state, device = miss.state, miss.device
        settings = self.settings
        if miss.one_shape() and self.options.memory_arena and not settings.arena:
            settings = dataclasses.replace(settings, arena=True)

        def locate(name: str) -> tuple[bool, int]:
            kind, where = recipe.feed_sources[name]
            if kind == "input":
                return True, int(where)
            if where not in state.index:
                raise UnsupportedModelError(
                    self._cls,
                    f"the graph needs {where!r}, which the module no longer has",
                    "Report the model; run it eagerly meanwhile",
                )
            return False, state.index[where]

        batch_norms = []
        for name, mean_index, var_index in recipe.batch_norms:
            bn = state.module_named(name)
            if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm):
                batch_norms.append(bridge.BatchNormUpdate(weakref.ref(bn), mean_index, var_index))
        step = bridge.Step(
            self._cls,
            recipe.num_user_outputs,
            batch_norms,
            recipe.seeds_dropout,
            self._backward_failed,
        )
        capture = self._persistence.store is not None and recipe.optimized is None
        if recipe.gradient is not None:
            swapped = self._for_device(recipe, miss, progress)
            program: Any = None
            if swapped is not None:
                # ORT's optimised graph would name this process's callables: never stored
                try:
                    program = session.build_training(
                        swapped, device, settings, self._cls, None, False
                    )
                except SessionError as exc:
                    # ORT's own shape inference disagrees with the swapped nodes: its kernels
                    log.debug("%s: gradient nodes stay ORT's (%s)", self._cls, exc)
                    swapped = None
            if program is None:
                program = session.build_training(
                    recipe.gradient, device, settings, self._cls, recipe.optimized, capture
                )
                recipe.optimized = recipe.optimized or program.optimized
            feeds = [locate(n) for n in program.feed_names]
            counts = recipe.torch_nodes
            if swapped is not None:
                counts = torch_nodes.Inventory.of(load_model(swapped.model)).counts
            return Entry(True, program, step, feeds, recipe.output_spec, recipe, swapped, counts)
        program = session.build_inference(
            recipe.optimized or recipe.forward_model,
            device,
            settings,
            self._cls,
            optimized=recipe.optimized is not None,
            capture=capture,
        )
        recipe.optimized = recipe.optimized or program.optimized
        feeds = [locate(n) for n in program.feed_names]
        return Entry(
            False, program, step, feeds, recipe.output_spec, recipe, None, recipe.torch_nodes
        )

    def _for_device(
        self, recipe: Recipe, miss: Miss, progress: _Progress
    ) -> session.GradientGraph | None:
        """The gradient graph as this device's session would rather run it, or None for the
        recipe's own: on CPU, ORT's slow gradient kernels become torch-calling nodes
        (`gradient_nodes`). Done here, not in the recipe, so the persistent cache keeps a graph
        that names no process's callables and asks for no compiled executor."""
        gradient = recipe.gradient
        if miss.device.type != "cpu" or gradient is None:
            return None
        from ort_autopatch.engine import aten_nodes, gradient_nodes

        shapes = {
            name: tuple(miss.call.tensors[where].shape)
            for name, (kind, where) in recipe.feed_sources.items()
            if kind == "input"
        }

        def aten() -> bool:
            folder = aten_nodes.default_folder() if self.options.compile_executor else None
            progress.phase = "loading the ATen executor"
            try:
                return aten_nodes.executor(folder) is None
            finally:
                progress.phase = "session"

        model = gradient_nodes.gradients_in_torch(gradient.model, shapes, self.may_route, aten)
        return None if model is gradient.model else dataclasses.replace(gradient, model=model)


#: dtypes ORT 1.19.2 has too few gradient kernels for (session._refuse_dtypes reads graphs).
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
        what = "; ".join(
            f"{dtype} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
            for dtype, names in found.items()
        )
        raise UnsupportedInputError(
            cls,
            f"training with {what}: ONNX Runtime 1.19.2 lacks {'/'.join(found)} gradient "
            "kernels for common operators (Concat's SplitTraining, ReluGrad)",
            "Train in float32, or keep the default fallback policy (PyTorch runs this dtype)",
        )


class _Progress:
    def __init__(self) -> None:
        self.phase = "export"


@contextmanager
def _progress(cls: str) -> Iterator[_Progress]:
    """Say while it runs that a slow build is still working, so nobody thinks training hung."""
    progress = _Progress()
    done = threading.Event()
    start = time.perf_counter()

    def watch() -> None:
        wait = SLOW_BUILD_SECONDS
        while not done.wait(wait):
            log.warning(
                "%s: still building its ONNX Runtime graph (%s, %.0fs so far)",
                cls,
                progress.phase,
                time.perf_counter() - start,
            )
            wait = 5 * SLOW_BUILD_SECONDS

    watcher = threading.Thread(target=watch, name="ort_autopatch-progress", daemon=True)
    watcher.start()
    try:
        yield progress
    finally:
        done.set()


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
