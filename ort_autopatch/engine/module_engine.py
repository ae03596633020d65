"""One module instance's way through ONNX Runtime: key the call, build on a miss, run."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine import bridge, export, graph, session, signature
from ort_autopatch.engine.cache import GraphCache
from ort_autopatch.engine.errors import (
    ExportError,
    GradientBuildError,
    MixedDevicesError,
    UnsupportedModelError,
)
from ort_autopatch.engine.state import ModuleState

log = logging.getLogger("ort_autopatch")

#: Operators whose gradients need static shapes in ORT 1.19.2 (see ModuleEngine._build).
_STATIC_SHAPE_OPS = ("MaxPool", "AveragePool", "LpPool")


class _NeedsStaticShapes(Exception):
    pass


@dataclass(frozen=True)
class EngineOptions:
    """Plain settings; the engine never reads configuration files or the environment."""

    opset: int = 17
    threads: int | None = None  # None: follow torch.get_num_threads()
    spinning: bool = False
    cache_size: int = 8


@dataclass
class BuildRecord:
    """What one build cost and why it happened, for reports."""

    reason: str
    export_seconds: float
    build_seconds: float
    training: bool


@dataclass
class _Entry:
    training: bool
    program: Any
    step: bridge.Step
    # per feed: (True, user tensor index) or (False, index into ModuleState.tensors)
    feeds: list[tuple[bool, int]]
    saved: tuple[int, ...]
    output_spec: export.OutputSpec
    exported: bytes
    gradient_model: bytes | None = None
    passes: dict[str, int] = field(default_factory=dict)

    def run(self, state: ModuleState, call: signature.FlatCall) -> Any:
        user, tensors = call.tensors, state.tensors
        feeds = [user[i] if is_user else tensors[i] for is_user, i in self.feeds]
        if self.training:
            outputs = bridge.TrainingCall.apply(self.program, self.step, self.saved, *feeds)
        else:
            outputs = bridge.run_inference(self.program, self.step, feeds)
        return self.output_spec.rebuild(outputs)


def _default_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module.forward(*args, **kwargs)


class ModuleEngine:
    """Runs calls of one module instance through cached ONNX Runtime graphs.

    Holds the module weakly, so caching an engine per instance never keeps a model alive.
    `forward(module, *args, **kwargs)` is what gets exported (default: `module.forward`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        options: EngineOptions | None = None,
        forward: Callable[..., Any] | None = None,
    ) -> None:
        self.options = options or EngineOptions()
        self._module = weakref.ref(module)
        self._cls = type(module).__qualname__
        self._forward = forward or _default_forward
        self._cache: GraphCache[_Entry] = GraphCache(self.options.cache_size)
        self._state = ModuleState(module)
        self._static_shapes = False
        self._lock = threading.Lock()
        self.records: list[BuildRecord] = []
        self._pending_reason = "first call"
        self._trusted: dict[tuple[bool, bool], _Entry] = {}
        self.settings = session.SessionSettings(self.options.threads, self.options.spinning)

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

    @property
    def submodules(self) -> list[torch.nn.Module]:
        """Every module of the tree as of the last structural check, the root first."""
        return self._state.modules

    def invalidate(self, reason: str = "marked stale") -> None:
        """Forget every graph; the next call re-exports."""
        module = self._module()
        with self._lock:
            if module is not None:
                self._state = ModuleState(module)
            self._cache.clear()
            self._trusted.clear()
            self._pending_reason = reason

    # -- the call ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(args, kwargs)

    def note_build_reason(self, reason: str) -> None:
        """Say why the next build (if the next call misses) happens, for reports."""
        self._pending_reason = reason

    def run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        guard: Callable[[], Hashable] | None = None,
        *,
        trust_last: bool = False,
        check_devices: bool = True,
    ) -> Any:
        """Run one call. `guard()` joins the cache key: the caller's view of state the graph
        baked in (it is asked again after a build, since the build may teach it more).

        `trust_last` reuses the graph last used in the same grad/train mode without checking
        structure, guards or signature (SKIP_CHECK_BUILD_GRADIENT): faster, and stale when the
        module or the inputs changed in a way the graph cannot absorb.
        """
        module = self._module()
        if module is None:  # pragma: no cover - the caller holds the module
            raise ReferenceError("the module was garbage collected")
        mode = (torch.is_grad_enabled(), module.training)
        if trust_last:
            trusted = self._trusted.get(mode)
            if trusted is not None:
                call = signature.flatten_call(self._cls, args, kwargs, check_devices)
                return trusted.run(self._state, call)
        state = self._state
        if not state.unchanged():
            self.invalidate("module structure changed")
            state = self._state
        call = signature.flatten_call(self._cls, args, kwargs, check_devices)
        grad = torch.is_grad_enabled() and (
            any(t.requires_grad for t in call.tensors) or any(p.requires_grad for p in state.params)
        )
        base: Hashable = (
            grad,
            state.training_flags(),
            state.requires_grad_flags() if grad else (),
            call.signature,
        )
        key = self._key(base, guard, call)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache.get_or_build(key, lambda: self._build(module, state, call, grad))
            # The build may have switched to static shapes or taught the guard new attributes.
            settled = self._key(base, guard, call)
            if settled != key:
                self._cache.rekey(key, settled)
        self._trusted[mode] = entry
        return entry.run(state, call)

    def _key(
        self, base: Hashable, guard: Callable[[], Hashable] | None, call: signature.FlatCall
    ) -> Hashable:
        key = (base, guard() if guard is not None else ())
        return (key, call.shapes()) if self._static_shapes else key

    # -- building ------------------------------------------------------------------------
    def _build(
        self, module: torch.nn.Module, state: ModuleState, call: signature.FlatCall, grad: bool
    ) -> _Entry:
        devices = state.devices() | {t.device for t in call.tensors}
        if len(devices) > 1:
            raise MixedDevicesError(
                self._cls,
                f"inputs, parameters and buffers span {', '.join(sorted(map(str, devices)))}",
                "Move the module and its inputs to one device (model.to(device))",
            )
        device = next(iter(devices), torch.device("cpu"))
        reason, self._pending_reason = self._pending_reason, "new input signature"
        dynamic = not self._static_shapes

        def finish(exported: export.ExportedGraph, model: Any) -> _Entry:
            start = time.perf_counter()
            entry = self._prepare(module, state, call, exported, model, grad, device)
            record = BuildRecord(reason, exported.seconds, time.perf_counter() - start, grad)
            self.records.append(record)
            log.debug(
                "%s: built %s graph (%s) in %.3fs export + %.3fs build",
                self._cls,
                "training" if grad else "inference",
                reason,
                record.export_seconds,
                record.build_seconds,
            )
            return entry

        try:
            exported = self._export(module, call, dynamic=dynamic)
            model = _load(exported.model_bytes)
            if dynamic and grad and any(graph.has_op(model, op) for op in _STATIC_SHAPE_OPS):
                raise _NeedsStaticShapes
            return finish(exported, model)
        except (_NeedsStaticShapes, ExportError, GradientBuildError) as exc:
            if not dynamic:
                raise
            # Pooling gradients in ORT 1.19.2 crash the process on dynamic shapes (MaxPoolGrad
            # SIGSEGV, AveragePoolGrad SIGFPE) and adaptive pooling only exports with known
            # sizes: such modules get one graph per input shape instead.
            log.debug("%s: building with static shapes (%s)", self._cls, type(exc).__name__)
            exported = self._export(module, call, dynamic=False)
            model = _load(exported.model_bytes)
            entry = finish(exported, model)
            self._static_shapes = True
            return entry

    def _export(
        self, module: torch.nn.Module, call: signature.FlatCall, dynamic: bool
    ) -> export.ExportedGraph:
        forward = self._forward
        return export.export_call(
            module,
            lambda *a, **k: forward(module, *a, **k),
            call.spec(),
            call.tensors,
            opset=self.options.opset,
            dynamic=dynamic,
        )

    def _prepare(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        call: signature.FlatCall,
        exported: export.ExportedGraph,
        model: Any,
        grad: bool,
        device: torch.device,
    ) -> _Entry:
        passes: dict[str, int] = {}
        graph.name_outputs(model)
        num_user_outputs = len(model.graph.output)
        graph.relax_shapes(model)
        passes["layer_norm_outputs"] = graph.layer_norm_outputs(model)
        passes["attention_dropout"] = graph.attention_dropout(model)
        padding = _embedding_padding(state, exported.state_names)
        frozen = graph.embedding_padding(model, padding) if grad and padding else []
        passes["embedding_padding"] = len(frozen)
        if grad:
            passes["eval_batch_norm_arithmetic"] = graph.eval_batch_norm_arithmetic(model)
        stats = graph.batch_norm_statistics(model)
        passes["batch_norm_statistics"] = len(stats)

        user_index = {name: k for k, name in enumerate(exported.user_input_names)}

        def locate(name: str) -> tuple[bool, int]:
            if name in user_index:
                return True, user_index[name]
            base = name[: -len("__frozen")] if name in frozen else name
            qualified = exported.state_names.get(base)
            if qualified is None or qualified not in state.index:
                raise UnsupportedModelError(
                    self._cls,
                    f"graph input {name!r} is neither an argument nor a parameter or buffer",
                    "Report the model; run it eagerly meanwhile",
                )
            return False, state.index[qualified]

        outputs = [o.name for o in model.graph.output]
        seeds = any(n.op_type == "Dropout" and len(n.input) >= 3 for n in model.graph.node)
        model_bytes = model.SerializeToString()
        feeds_for_graph = [i.name for i in model.graph.input]
        batch_norms: list[bridge.BatchNormUpdate] = []
        for s in stats:
            qualified = exported.state_names[s.running_mean]
            bn = state.owner_of(qualified)
            if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm):
                batch_norms.append(
                    bridge.BatchNormUpdate(
                        bn,
                        outputs.index(s.mean_output),
                        outputs.index(s.var_output),
                    )
                )
        step = bridge.Step(self._cls, num_user_outputs, batch_norms, seeds)
        if grad:
            user_names = exported.user_input_names
            requiring = [
                n
                for n in user_names
                if n in feeds_for_graph and call.tensors[user_index[n]].requires_grad
            ]
            trainable = [
                n
                for n in feeds_for_graph
                if n not in user_index
                and n not in frozen
                and state.is_param[locate(n)[1]]
                and state.tensors[locate(n)[1]].requires_grad
            ]
            program: Any = session.build_training(
                model_bytes,
                feed_names=feeds_for_graph,
                trainable=trainable + requiring,
                inputs_requiring_grad=requiring,
                user_inputs=user_names,
                extra_outputs=[n for s in stats for n in (s.mean_output, s.var_output)],
                device=device,
                settings=self.settings,
                cls=self._cls,
            )
            feeds = [locate(n) for n in program.feed_names]
            saved = tuple(
                k
                for k, (is_user, i) in enumerate(feeds)
                if program.grad_index[k] >= 0 and not is_user and state.is_param[i]
            )
            return _Entry(
                True,
                program,
                step,
                feeds,
                saved,
                exported.output_spec,
                model_bytes,
                program.gradient_model,
                passes,
            )
        program = session.build_inference(model_bytes, device, self.settings, self._cls)
        feeds = [locate(n) for n in program.feed_names]
        return _Entry(
            False, program, step, feeds, (), exported.output_spec, model_bytes, None, passes
        )


def _load(model_bytes: bytes) -> Any:
    import onnx

    return onnx.load_from_string(model_bytes)


def _embedding_padding(state: ModuleState, state_names: dict[str, str]) -> dict[str, int]:
    """Graph input name of each nn.Embedding weight with a padding_idx -> that index."""
    by_qualified = {q: g for g, q in state_names.items()}
    found: dict[str, int] = {}
    for name, module in state.by_name.items():
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
