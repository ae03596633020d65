"""One module instance's way through ONNX Runtime: key the call, build on a miss, run."""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ort_autopatch.engine import (
    bridge,
    export,
    graph,
    hazards,
    rng,
    session,
    signature,
    torch_nodes,
    verify,
)
from ort_autopatch.engine.cache import GraphCache
from ort_autopatch.engine.callkey import CallKey, Guards, HotShapes, KeyMaker, Shapes
from ort_autopatch.engine.errors import (
    DataDependentError,
    EngineError,
    ExecutionError,
    ExportError,
    GradientBuildError,
    MixedDevicesError,
    SessionError,
    UnsupportedInputError,
    UnsupportedModelError,
)
from ort_autopatch.engine.state import ModuleState
from ort_autopatch.engine.store import GraphStore

log = logging.getLogger("ort_autopatch")

#: input shapes per gradient/train mode that may earn a static-shape graph (`HotShapes`)
HOT_SHAPES_PER_MODE = 2

#: Operators whose gradients need static shapes in ORT 1.19.2 (see ModuleEngine._build).
_STATIC_SHAPE_OPS = ("MaxPool", "AveragePool", "LpPool")
#: After this many seconds a build says, while it runs, that it is still working.
SLOW_BUILD_SECONDS = 2.0


class _NeedsStaticShapes(Exception):
    pass


@dataclass(frozen=True)
class EngineOptions:
    """Plain settings; the engine never reads configuration files or the environment."""

    opset: int = 17
    threads: int | None = None  # None: follow torch.get_num_threads()
    cache_size: int = 8
    cache_dir: Path | None = None  # persistent graph cache
    save_onnx: Path | None = None  # folder to write exported and gradient graphs
    # ATen operators ("aten::einsum") that always run as torch-calling nodes, and those that
    # never do (fnmatch patterns); any other operator becomes one only when ORT cannot export
    # or differentiate it.
    torch_ops: tuple[str, ...] = ()
    no_torch_ops: tuple[str, ...] = ()
    verify: int = 0  # calls of each new graph key also run eagerly and compared (verify.py)
    # calls in a row with one input shape after which that shape gets a static-shape graph of
    # its own (callkey.HotShapes; 0: never)
    static_after: int = 8
    # gradient nodes may call torch through the compiled ATen executor (aten_nodes.py)
    compile_executor: bool = True
    # graphs serving one input shape allocate from the shared CPU arena (session.shared_arena)
    memory_arena: bool = True


@dataclass
class BuildRecord:
    """What one build cost and why it happened, for reports."""

    reason: str
    export_seconds: float
    build_seconds: float
    training: bool
    from_disk: bool = False
    # operators running as torch-calling nodes in the graph built ("aten::cummax": 2)
    torch_nodes: dict[str, int] = field(default_factory=dict)
    per_shape: bool = False  # keyed by its input shapes (the model specialises on sizes)
    hot_shape: bool = False  # a static-shape graph for an input shape that kept coming back


@dataclass
class Recipe:
    """A graph and how to feed and read it, as plain data (what the persistent cache stores)."""

    training: bool
    forward_model: bytes  # the exported graph after the passes
    gradient: session.GradientGraph | None
    # graph input name -> ("input", flat tensor index) or ("state", qualified tensor name)
    feed_sources: dict[str, tuple[str, Any]]
    num_user_outputs: int
    output_spec: export.OutputSpec
    batch_norms: list[tuple[str, int, int]]  # module name, mean output, variance output
    seeds_dropout: bool
    optimized: bytes | None = None  # ORT's optimised form of the graph that runs
    torch_nodes: dict[str, int] = field(default_factory=dict)  # label -> nodes calling torch
    checks: list[hazards.Check] = field(default_factory=list)  # the last user outputs
    traced_shapes: tuple[tuple[int, ...], ...] | None = None  # the example's input shapes


@dataclass
class _Entry:
    training: bool
    program: Any
    step: bridge.Step
    # per feed: (True, user tensor index) or (False, index into ModuleState.tensors)
    feeds: list[tuple[bool, int]]
    output_spec: export.OutputSpec
    recipe: Recipe
    # the gradient graph the session runs when it is not the recipe's (`_for_device`)
    gradient: session.GradientGraph | None = None
    torch_nodes: dict[str, int] = field(default_factory=dict)  # label -> nodes calling torch
    kept: bridge.KeptValues = field(init=False)  # ORT's values of the module's tensors
    graph: bridge.TrainingGraph = field(init=False)  # what a training call's Function takes

    def __post_init__(self) -> None:
        self.kept = bridge.KeptValues([k for k, (user, _) in enumerate(self.feeds) if not user])
        self.graph = bridge.TrainingGraph(self.program, self.step, self.kept)

    def run(self, state: ModuleState, call: signature.FlatCall, recompute: bool = False) -> Any:
        user, tensors = call.tensors, state.tensors
        feeds = [user[i] if is_user else tensors[i] for is_user, i in self.feeds]
        checks = self.recipe.checks
        before = _Undo(self.step) if checks else None
        outputs: Sequence[torch.Tensor]
        try:
            if self.training:
                outputs = bridge.train(self.graph, feeds, recompute)
            else:
                outputs = bridge.run_inference(self.program, self.step, feeds, self.kept)
        except ExecutionError as exc:
            if before is None or call.shapes() == self.recipe.traced_shapes:
                raise  # a failure of the graph itself, not of sizes it was not traced for
            # A graph that froze sizes (checks) and fails on other sizes: its structure
            # follows them (a split over time), so it is one graph per shape from now on.
            before.undo()
            raise _Specialises(checks[0].hazard.where) from exc
        if checks:
            computed, at = outputs[-1].tolist(), 0
            for check in checks:
                width = check.width
                got = computed[at : at + width] if check.is_list else computed[at]
                at += width
                if not check.holds(got):
                    assert before is not None
                    before.undo()
                    raise _Specialises(check.hazard.where)
        result = self.output_spec.rebuild(outputs)
        if type(result) is export.BufferUpdates:
            with torch.no_grad():
                for name, value in result.buffers.items():
                    tensors[state.index[name]].copy_(value)
            result = result.output
        return result


class _Specialises(Exception):
    """A graph's check failed for this call: the model specialises on sizes after all."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


class _Undo:
    """What a graph run changes besides its outputs (the RNG draw that seeds dropout, BatchNorm
    running statistics), saved so a run whose checks fail leaves no trace."""

    def __init__(self, step: bridge.Step) -> None:
        self.rng = torch.random.get_rng_state() if step.seeds_dropout else None
        self.buffers = [
            (b, b.detach().clone())
            for update in step.batch_norms
            if (bn := update.module()) is not None
            for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
            if b is not None
        ]

    def undo(self) -> None:
        if self.rng is not None:
            torch.random.set_rng_state(self.rng)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)


def _default_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module.forward(*args, **kwargs)


class ModuleEngine:
    """Runs calls of one module instance through cached ONNX Runtime graphs.

    `forward(module, *args, **kwargs)` is what gets exported (default: `module.forward`).
    Buffers forward updates in place are graph outputs copied back after each call; attribute
    writes are the caller's to handle (the patcher's recording forward undoes and replays them,
    `recording.py`): with the default forward, a graph does not repeat them.
    With `weak=True` the engine holds its module only weakly, so an engine cached per instance
    (in a WeakKeyDictionary, as the patcher does) never keeps a model alive.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        options: EngineOptions | None = None,
        forward: Callable[..., Any] | None = None,
        guards: Guards | None = None,
        weak: bool = False,
    ) -> None:
        self.options = options or EngineOptions()
        self._module = weakref.ref(module)
        self._strong = None if weak else module
        self._cls = type(module).__qualname__
        self._forward = forward or _default_forward
        self._guards = guards
        self._cache: GraphCache[_Entry] = GraphCache(self.options.cache_size)
        self._state = ModuleState(module)
        self._keys = KeyMaker(self._state, guards)
        self._static_shapes = False  # every graph serves one input shape (sizes were traced)
        self._hot = HotShapes(self.options.static_after, HOT_SHAPES_PER_MODE)
        self._lock = threading.Lock()
        self._build_lock = threading.RLock()  # one build at a time per module
        self.records: list[BuildRecord] = []
        self.hazards: list[hazards.Hazard] = []  # every trace hazard found, for reports
        self.verifications: list[verify.Verification] = []  # --verify's comparisons
        self._verified: dict[CallKey, int] = {}  # key -> calls verified
        self._trusted: dict[tuple[bool, bool], CallKey] = {}  # mode -> key last used
        self.settings = session.SessionSettings(self.options.threads)
        self._store = _store_for(self.options.cache_dir)
        # operators learned to need torch-calling nodes, so later exports start with them
        self._routed: frozenset[str] = frozenset(self.options.torch_ops)

    # -- introspection -------------------------------------------------------------------
    @property
    def builds(self) -> int:
        return self._cache.builds

    @property
    def cached_graphs(self) -> int:
        return len(self._cache)

    @property
    def evictions(self) -> int:
        return self._cache.evictions

    def submodule_hooks(self) -> bool:
        """Whether a module below the root carries hooks (which cannot run inside ORT)."""
        return self._state.submodule_hooks()

    def invalidate(self, reason: str = "marked stale") -> None:
        """Forget every graph; the next call re-exports."""
        module = self._module()
        with self._lock:
            if module is not None:
                self._state = ModuleState(module)
            self._cache.clear()
            self._trusted.clear()
            self._verified.clear()
            self._keys.forget(self._state, reason)

    # -- the call ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(args, kwargs)

    def run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        trust_last: bool = False,
        check_devices: bool = True,
        recompute: bool = False,
    ) -> Any:
        """Run one call.

        `trust_last` reuses the graph last used in the same grad/train mode without checking
        structure, guards or signature (SKIP_CHECK_BUILD_GRADIENT): faster, and stale when the
        module or the inputs changed in a way the graph cannot absorb. `recompute` keeps nothing
        of a training forward and runs it again in backward, for parameters whose memory is
        freed in between (FSDP2 resharding after forward).
        """
        module = self._module()
        if module is None:  # pragma: no cover - the caller holds the module
            raise ReferenceError("the module was garbage collected")
        try:
            return self._run(module, args, kwargs, trust_last, check_devices, recompute)
        except _Specialises as exc:
            # The graph recomputed a value its trace took from sizes and got another one: from
            # now on one graph per input shape (this call included).
            log.debug("%s: %s differs for this call; one graph per shape", self._cls, exc)
            with self._lock:
                self._static_shapes = True
                self._keys.note(f"sizes change a traced value ({exc.where})")
            return self._run(module, args, kwargs, False, check_devices, recompute)

    def _run(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        trust_last: bool,
        check_devices: bool,
        recompute: bool,
    ) -> Any:
        mode = (torch.is_grad_enabled(), module.training)
        call = signature.flatten_call(self._cls, args, kwargs, check_devices)
        hot: Shapes | None = None
        earned = False
        if not self._static_shapes:
            hot, earned = self._hot.pick(mode, call.shapes)
        if trust_last and not earned and mode in self._trusted:
            last = self._trusted[mode]
            # even unchecked, a static-shape graph never takes another shape
            if last.shapes == (call.shapes() if self._static_shapes else hot):
                trusted = self._cache.get(last)  # None once evicted
                if trusted is not None:
                    return trusted.run(self._state, call, recompute)
        stale = self._keys.stale()
        if stale is not None:
            self.invalidate(stale)
        state = self._state
        requires = state.requires_grad_flags() if torch.is_grad_enabled() else []
        grad = any(requires) or (
            torch.is_grad_enabled() and any(t.requires_grad for t in call.tensors)
        )
        if grad:
            _refuse_empty(self._cls, call)
        else:
            requires = []
        if earned:
            self._keys.note(
                f"input shape repeated {self._hot.after} calls: a static-shape graph for it"
            )
        try:
            key, entry = self._entry(module, state, call, grad, requires, hot)
        except EngineError as exc:
            if hot is None or self._static_shapes:
                raise
            # The static-shape graph this shape earned cannot be built (ORT rejects it): the
            # dynamic graph keeps serving the shape.
            log.debug("%s: no static-shape graph for %s (%s)", self._cls, hot, exc)
            self._hot.refuse(mode, hot)
            key, entry = self._entry(module, state, call, grad, requires, None)
        if self.options.verify and self._verified.get(key, 0) < self.options.verify:
            self._verified[key] = self._verified.get(key, 0) + 1
            self._verify(module, entry, state, call, grad, key)
        self._keys.used(key)
        self._trusted[mode] = key
        return entry.run(state, call, recompute)

    def _entry(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        call: signature.FlatCall,
        grad: bool,
        requires: list[bool],
        hot: Shapes | None,
    ) -> tuple[CallKey, _Entry]:
        """The call's key and its graph, built on a miss."""
        key = self._key(grad, call, requires, hot)
        entry = self._cache.get(key)
        if entry is not None:
            return key, entry
        with self._build_lock:
            # Another thread may have built it meanwhile, under a key its build settled.
            key = self._key(grad, call, requires, hot)
            entry = self._cache.get(key)
            if entry is not None:
                return key, entry
            reason = self._keys.miss_reason(key)
            entry = self._cache.get_or_build(
                key, lambda: self._build(module, state, call, grad, reason, hot)
            )
            # The build may have switched to static shapes or taught the guards new
            # attributes: file the graph under the key later calls will compute.
            settled = self._key(grad, call, requires, hot)
            if settled != key:
                self._cache.rekey(key, settled)
                key = settled
            self._keys.built(key)
            return key, entry

    def _key(
        self,
        grad: bool,
        call: signature.FlatCall,
        requires: list[bool] | None = None,
        hot: Shapes | None = None,
    ) -> CallKey:
        """`hot`: the call's shapes when they earned a static-shape graph (`HotShapes`)."""
        if requires is None:
            requires = self._state.requires_grad_flags() if grad else []
        shapes = call.shapes() if self._static_shapes else hot
        return self._keys.key(grad, call.signature, shapes, requires)

    def _verify(
        self,
        module: torch.nn.Module,
        entry: _Entry,
        state: ModuleState,
        call: signature.FlatCall,
        grad: bool,
        key: CallKey,
    ) -> None:
        """Run this call also through the graph and eagerly and compare (`--verify`); a
        mismatch remembers this key as failed, so its calls run in PyTorch."""
        random = verify.random_ops(_load(entry.recipe.forward_model))
        if random:
            self.verifications.append(
                verify.Verification(unverified=f"random operators ({', '.join(random)})")
            )
            return
        spec = call.spec()
        forward = self._forward

        def run_graph(tensors: list[torch.Tensor]) -> Any:
            copy = signature.FlatCall(tensors, call.signature, spec, call.args, call.kwargs)
            return entry.run(state, copy)

        def run_eager(tensors: list[torch.Tensor]) -> Any:
            args, kwargs = spec.rebuild(tensors)
            with export.stepping_aside():  # selected submodules run their eager code too
                return forward(module, *args, **kwargs)

        trainable = [p for p in state.params if p.requires_grad] if grad else []
        try:
            result = verify.verify_call(
                self._cls, module, run_graph, run_eager, call.tensors, trainable, grad
            )
        except verify.VerificationError as exc:
            if exc.verification is not None:
                self.verifications.append(exc.verification)
            self._cache.fail(key, exc)
            raise
        self.verifications.append(result)

    # -- building ------------------------------------------------------------------------
    def _build(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        call: signature.FlatCall,
        grad: bool,
        reason: str,
        hot: Shapes | None,
    ) -> _Entry:
        """Build the graph of one key: for the call's shapes only when the model specialises
        on sizes or `hot` (the shapes that earned a static-shape graph) is given."""
        shapes = call.shapes() if self._static_shapes else hot
        devices = state.devices() | {t.device for t in call.tensors}
        if len(devices) > 1:
            raise MixedDevicesError(
                self._cls,
                f"inputs, parameters and buffers span {', '.join(sorted(map(str, devices)))}",
                "Move the module and its inputs to one device (model.to(device))",
            )
        device = next(iter(devices), torch.device("cpu"))
        with _progress(self._cls) as progress:
            start = time.perf_counter()
            persisted = self._persistent_key(module, state, call, grad, device, shapes)
            if persisted is not None:
                stored = self._load(persisted, state)
                if stored is not None:
                    progress.phase = "session"
                    entry = self._instantiate(
                        stored, state, call, device, progress, self._one_shape(hot)
                    )
                    self._record(
                        reason,
                        0.0,
                        time.perf_counter() - start,
                        grad,
                        from_disk=True,
                        torch_nodes=entry.torch_nodes,
                    )
                    return entry
            recipe, export_seconds = self._export_recipe(
                module, state, call, grad, progress, static=shapes is not None
            )
            progress.phase = "session"
            entry = self._instantiate(recipe, state, call, device, progress, self._one_shape(hot))
            self._record(
                reason,
                export_seconds,
                time.perf_counter() - start - export_seconds,
                grad,
                torch_nodes=entry.torch_nodes,
            )
            self.records[-1].per_shape = self._static_shapes
            self.records[-1].hot_shape = hot is not None and not self._static_shapes
        # the build may have switched every graph to static shapes
        shapes = call.shapes() if self._static_shapes else hot
        self._save(module, entry, state, call, grad, device, shapes, base_key=persisted)
        return entry

    def _one_shape(self, hot: Shapes | None) -> bool:
        """Whether the graph just built serves one input shape: earned by a shape that kept
        coming back (`hot`), or one of a model that specialises on sizes (which the build
        itself may have found out)."""
        return hot is not None or self._static_shapes

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

    def _export_recipe(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        call: signature.FlatCall,
        grad: bool,
        progress: _Progress,
        static: bool,
    ) -> tuple[Recipe, float]:
        dynamic = not static
        try:
            exported = self._export(module, call, dynamic=dynamic)
            if dynamic and self._static_shapes:
                # The trace froze sizes: this graph serves one input shape, and ORT gets it with
                # static shapes (its gradient builder can abort on a dynamic graph whose
                # structure was sized for one example, e.g. a Split unrolled over time).
                dynamic = False
                exported = self._export(module, call, dynamic=False)
            model = _load(exported.model_bytes)
            if dynamic and grad and any(graph.has_op(model, op) for op in _STATIC_SHAPE_OPS):
                raise _NeedsStaticShapes
            progress.phase = "gradient build"
            recipe, exported = self._routed_recipe(
                module, state, call, exported, model, grad, dynamic
            )
            return recipe, exported.seconds
        except (_NeedsStaticShapes, ExportError, GradientBuildError) as exc:
            if not dynamic:
                raise
            # Pooling gradients in ORT 1.19.2 crash the process on dynamic shapes (MaxPoolGrad
            # SIGSEGV, AveragePoolGrad SIGFPE) and adaptive pooling only exports with known
            # sizes: such modules get one graph per input shape instead.
            log.debug("%s: building with static shapes (%s)", self._cls, type(exc).__name__)
            progress.phase = "export"
            exported = self._export(module, call, dynamic=False)
            model = _load(exported.model_bytes)
            progress.phase = "gradient build"
            recipe, exported = self._routed_recipe(
                module, state, call, exported, model, grad, dynamic=False
            )
            self._static_shapes = True
            return recipe, exported.seconds

    def _may_route(self, name: str) -> bool:
        return not any(fnmatch.fnmatchcase(name, p) for p in self.options.no_torch_ops)

    def _routed_recipe(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        call: signature.FlatCall,
        exported: export.ExportedGraph,
        model: Any,
        grad: bool,
        dynamic: bool,
    ) -> tuple[Recipe, export.ExportedGraph]:
        """The recipe; when ORT cannot differentiate an operator, the ATen operators whose
        export produced it become torch-calling nodes and the call is exported again."""
        from ort_autopatch.engine import torch_ops

        devices = state.devices() | {t.device for t in call.tensors}
        device = next(iter(devices), torch.device("cpu"))
        while True:
            try:
                recipe = self._recipe(state, call, exported, model, grad)
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
            more = {c for c in culprits if self._may_route(c)} - exported.routed
            if not more:
                raise failure
            log.debug("%s: %s become torch-calling nodes", self._cls, ", ".join(sorted(more)))
            exported = self._export(module, call, dynamic=dynamic, routed=exported.routed | more)
            model = _load(exported.model_bytes)

    def _export(
        self,
        module: torch.nn.Module,
        call: signature.FlatCall,
        dynamic: bool,
        routed: frozenset[str] | None = None,
    ) -> export.ExportedGraph:
        from ort_autopatch.engine import torch_ops

        forward = self._forward
        device = next(
            iter({t.device for t in call.tensors} | self._state.devices()), torch.device("cpu")
        )
        chosen = self._routed if routed is None else routed
        chosen = chosen | {r for r in torch_ops.default_routes(device) if self._may_route(r)}
        exported = export.export_call(
            module,
            lambda *a, **k: forward(module, *a, **k),
            call.spec(),
            call.tensors,
            opset=self.options.opset,
            dynamic=dynamic,
            routed=chosen,
            may_route=self._may_route,
        )
        self._judge(exported.findings)
        return exported

    def _judge(self, findings: hazards.Findings) -> None:
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
        if findings.static and not self._static_shapes:
            log.debug(
                "%s: the trace froze sizes (%s); one graph per input shape",
                self._cls,
                "; ".join(h.describe() for h in found),
            )
            self._static_shapes = True

    def _recipe(
        self,
        state: ModuleState,
        call: signature.FlatCall,
        exported: export.ExportedGraph,
        model: Any,
        grad: bool,
    ) -> Recipe:
        """Apply the graph passes (and the gradient build) to a fresh export."""
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

    def _instantiate(
        self,
        recipe: Recipe,
        state: ModuleState,
        call: signature.FlatCall,
        device: torch.device,
        progress: _Progress,
        one_shape: bool,
    ) -> _Entry:
        """Sessions for a recipe, bound to this module's tensors; a graph that serves one input
        shape (`_one_shape`) allocates from the shared arena (`memory_arena`), as its steps
        ask for the same sizes every time."""
        settings = self.settings
        if one_shape and self.options.memory_arena and not settings.arena:
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
        step = bridge.Step(self._cls, recipe.num_user_outputs, batch_norms, recipe.seeds_dropout)
        capture = self._store is not None and recipe.optimized is None
        if recipe.gradient is not None:
            swapped = self._for_device(recipe.gradient, recipe.feed_sources, call, device, progress)
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
                counts = torch_nodes.Inventory.of(_load(swapped.model)).counts
            return _Entry(True, program, step, feeds, recipe.output_spec, recipe, swapped, counts)
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
        return _Entry(
            False, program, step, feeds, recipe.output_spec, recipe, None, recipe.torch_nodes
        )

    def _for_device(
        self,
        gradient: session.GradientGraph,
        feed_sources: dict[str, tuple[str, Any]],
        call: signature.FlatCall,
        device: torch.device,
        progress: _Progress,
    ) -> session.GradientGraph | None:
        """The gradient graph as this device's session would rather run it, or None for the
        recipe's own: on CPU, ORT's slow gradient kernels become torch-calling nodes
        (`gradient_nodes`). Done here, not in the recipe, so the persistent cache keeps a graph
        that names no process's callables and asks for no compiled executor."""
        if device.type != "cpu":
            return None
        from ort_autopatch.engine import aten_nodes, gradient_nodes

        shapes = {
            name: tuple(call.tensors[where].shape)
            for name, (kind, where) in feed_sources.items()
            if kind == "input"
        }

        def aten() -> bool:
            folder = aten_nodes.default_folder() if self.options.compile_executor else None
            progress.phase = "compiling the ATen executor, once per torch version"
            try:
                return aten_nodes.executor(folder) is None
            finally:
                progress.phase = "session"

        model = gradient_nodes.gradients_in_torch(gradient.model, shapes, self._may_route, aten)
        return None if model is gradient.model else dataclasses.replace(gradient, model=model)

    # -- on disk ---------------------------------------------------------------------------
    def _persistent_key(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        call: signature.FlatCall,
        grad: bool,
        device: torch.device,
        shapes: Shapes | None,
    ) -> str | None:
        """The static part of the on-disk key; None without a store, or when a class of the
        tree has no source file to hash (REPL, exec)."""
        if self._store is None and self.options.save_onnx is None:
            return None
        sources = _source_digest(module)
        if sources is None:
            return None
        from ort_autopatch.engine import persist

        return persist.static_key(
            cls=self._cls,
            sources=sources,
            state=state,
            key=self._key(grad, call, hot=shapes).persistent(),
            device=device,
            opset=self.options.opset,
        )

    def _load(self, static: str, state: ModuleState) -> Recipe | None:
        if self._store is None:
            return None
        from ort_autopatch.engine import persist

        module = self._module()
        paths = self._store.paths(static)
        if module is None:
            return None
        key = persist.full_key(static, module, paths)
        stored = self._store.load(static, key)
        if stored is None:
            return None
        recipe = persist.recipe_from(stored, self._cls)
        if recipe is None:
            return None
        if self._guards is not None:
            self._guards.adopt(module, paths)
        return recipe

    def _save(
        self,
        module: torch.nn.Module,
        entry: _Entry,
        state: ModuleState,
        call: signature.FlatCall,
        grad: bool,
        device: torch.device,
        shapes: Shapes | None,
        base_key: str | None,
    ) -> None:
        from ort_autopatch.engine import persist

        recipe = entry.recipe
        # Recomputed: the build may have switched to static shapes.
        static = self._persistent_key(module, state, call, grad, device, shapes)
        # torch-calling nodes name callables of this process: such graphs cannot be reloaded
        persistable = not recipe.torch_nodes
        if persistable and self._store is not None and static is not None and base_key is not None:
            paths = self._guards.paths() if self._guards is not None else []
            known = self._store.paths(static)
            union = known + [p for p in paths if p not in known]
            meta = persist.meta_of(recipe)
            if meta is not None:
                key = persist.full_key(static, module, union)
                self._store.save(static, key, meta, persist.graphs_of(recipe), union)
        if self.options.save_onnx is not None:
            name = static or persist.digest(repr(call.signature))
            # the graphs the sessions run, torch-calling gradient nodes included
            ran = (
                recipe
                if entry.gradient is None
                else dataclasses.replace(recipe, gradient=entry.gradient)
            )
            persist.save_onnx(self.options.save_onnx, self._cls, grad, module.training, name, ran)


def _refuse_empty(cls: str, call: signature.FlatCall) -> None:
    """ORT 1.19.2's gradient kernels reject zero-size dimensions (GemmGrad: K > 0), so a
    training call with an empty batch is refused before it runs (the default fallback policy
    then runs it in PyTorch); it is not remembered as a failure of its graph."""
    for k, t in enumerate(call.tensors):
        if t.numel() == 0:
            raise UnsupportedInputError(
                cls,
                f"input tensor #{k} is empty (shape {tuple(t.shape)}), which ONNX Runtime's "
                "gradient kernels reject",
                "Skip empty batches, or keep the default fallback policy (PyTorch runs them)",
            )


def _load(model_bytes: bytes) -> Any:
    import onnx

    return onnx.load_from_string(model_bytes)


_stores: dict[Path, GraphStore] = {}


def _store_for(root: Path | None) -> GraphStore | None:
    if root is None:
        return None
    store = _stores.get(root)
    if store is None:
        store = _stores[root] = GraphStore(root)
    return store if store.usable else None


_source_cache: dict[tuple[str, float], str] = {}


def _source_digest(module: torch.nn.Module) -> str | None:
    """Hash of the files defining every class in the tree: an edited model never loads a
    graph exported from its old code. None when a class has no source file (REPL, exec)."""
    files = set()
    for sub in module.modules():
        for klass in type(sub).__mro__:
            if klass.__module__ in ("builtins", "torch.nn.modules.module"):
                continue
            mod = sys.modules.get(klass.__module__)
            path = getattr(mod, "__file__", None)
            if path is None:
                return None
            files.add(path)
    digest = hashlib.sha256()
    for path in sorted(files):
        try:
            stamp = Path(path).stat().st_mtime
            cached = _source_cache.get((path, stamp))
            if cached is None:
                cached = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                _source_cache[(path, stamp)] = cached
        except OSError:
            return None
        digest.update(path.encode() + cached.encode())
    return digest.hexdigest()


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
