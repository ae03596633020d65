"""Patching a selected class in place: its `__call__` goes through ONNX Runtime, its
`__setattr__` notices writes, and the fallback policy decides what a failed call does.

The only module that rebinds a class's methods. It calls on three helpers, one job each: the
attributes a graph depends on are guarded by `attribute_guards` (what forward read and wrote while
exported, recorded by `recording`, which swaps `__class__` of user objects for the length of an
export); the forward and backward hooks of a call served by ORT are run by `module_hooks`; calls
that torch.compile runs are counted by `compiled_calls`.

No wrapper object exists, so attributes, custom methods calling `self(...)`, `state_dict`,
`isinstance`, pickling and `deepcopy` are those of the unpatched class. Per-instance state lives
in a WeakKeyDictionary, never in the instance's `__dict__`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch import compiled_calls, distributed, report
from ort_autopatch.attribute_guards import AttributeGuards, SideEffectError
from ort_autopatch.compiled_calls import compiled_call, compiled_trace, count_compiled_calls
from ort_autopatch.config import BY_NAME, Config
from ort_autopatch.engine import (
    EngineError,
    EngineOptions,
    FailureKind,
    ModuleEngine,
    is_exporting,
)
from ort_autopatch.engine.errors import BuildingAside, ExecutionError
from ort_autopatch.errors import NotPatchableError
from ort_autopatch.hook import PATCHED_MARKER
from ort_autopatch.module_hooks import (
    backward_hooked,
    forward_hooked,
    forward_without_hooks,
    global_backward_hooks,
    global_forward_hooks,
    non_full_backward_hooks,
    run_post_hooks,
    run_pre_hooks,
    setup_backward_hooks,
)
from ort_autopatch.policy import (
    DEFAULT_FALLBACK,
    DEFAULT_SKIP_CHECK,
    Fallback,
    SkipCheck,
    falls_back,
    skips,
)
from ort_autopatch.recording import Replay, is_recorder

log = logging.getLogger("ort_autopatch")

_WRAPPER = "__ort_autopatch_wrapper__"
_FALLBACK_FOR_KIND = {
    FailureKind.UNSUPPORTED_DEVICE: Fallback.FALLBACK_UNSUPPORTED_DEVICE,
    FailureKind.UNSUPPORTED_DATA: Fallback.FALLBACK_UNSUPPORTED_DATA,
    FailureKind.UNSUPPORTED_TORCH_MODEL: Fallback.FALLBACK_UNSUPPORTED_TORCH_MODEL,
    FailureKind.UNSUPPORTED_ONNX_MODEL: Fallback.FALLBACK_UNSUPPORTED_ONNX_MODEL,
    FailureKind.BAD_INITIALIZATION: Fallback.FALLBACK_BAD_INITIALIZATION,
    FailureKind.RUNTIME: Fallback.FALLBACK_UNSUPPORTED_ONNX_MODEL,
}


@dataclass(frozen=True)
class Settings:
    """What patched calls need from the configuration; each patched class holds its own."""

    skip_check: SkipCheck = DEFAULT_SKIP_CHECK
    fallback: Fallback = DEFAULT_FALLBACK
    engine: EngineOptions = field(default_factory=EngineOptions)
    #: a helper process builds each graph while its calls run in PyTorch (engine/aside.py);
    #: off unless the configuration says so (`Config.background_builds`, on by default)
    background_builds: bool = False

    @classmethod
    def from_config(cls, config: Config) -> Settings:
        return cls(
            config.skip_check,
            config.fallback,
            EngineOptions(**config.engine_values()),
            config.background_builds,
        )


@dataclass(frozen=True)
class _Patched:
    """What patching changed on one class (to restore it) and the settings its calls use."""

    own_call: Any  # the class's own __call__ and __setattr__, or _MISSING
    own_setattr: Any
    settings: Settings


_patched: dict[type, _Patched] = {}
_instances: weakref.WeakKeyDictionary[torch.nn.Module, _Instance] = weakref.WeakKeyDictionary()
_warned: set[tuple[str, str]] = set()
_lock = threading.RLock()
_MISSING = object()


def class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# -- patching -----------------------------------------------------------------------------------


def is_patched(cls: type) -> bool:
    return cls in _patched


_prepared: list[str] = []  # backend options told the process will build (`prepare`)


def prepare(settings: Settings) -> None:
    """The import hook patched a selected class: its backend may start, once per process,
    what overlaps the user's setup with the first build (`Backend.prepare`). Never raises:
    the user's import goes on whatever the backend makes of it."""
    from ort_autopatch.engine import backend

    with _lock:
        if settings.engine.backend in _prepared:
            return
        _prepared.append(settings.engine.backend)
    try:
        chosen = backend.backend_class(backend.resolve(settings.engine.backend))
        if settings.background_builds and chosen.builds_aside:
            return  # its builds run in helper processes, which need nothing of this one's
        chosen.prepare(settings.engine)
    except Exception as exc:  # pragma: no cover - a backend's preparation is optional
        log.debug("backend preparation failed: %s", exc)


def patch(cls: type, settings: Settings | None = None) -> bool:
    """Patch `cls` in place, its calls using `settings` (defaults when None; the public
    `ort_autopatch.patch` passes the configuration `install()` would use); False if it already
    was. Subclasses inherit the patch and its settings."""
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise NotPatchableError(cls)
    if is_recorder(cls):
        return False  # our own export-time subclass, caught by the class-creation hook
    with _lock:
        if cls in _patched:
            log.debug("%s is already patched", class_name(cls))
            return False
        _patched[cls] = _Patched(
            cls.__dict__.get("__call__", _MISSING),
            cls.__dict__.get("__setattr__", _MISSING),
            settings or Settings(),
        )
        eager_call = _eager_call_of(cls)
        eager_setattr = cls.__setattr__
        name = class_name(cls)

        def traced(context: Any) -> None:
            compiled_trace(name)  # dynamo runs this while it traces a call (comptime)

        def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if _is_compiling():
                # torch.compile traces this call: it runs as compiled. When this is the frame
                # torch.compile compiles (torch.compile(model)), dynamo runs `compiled_call`
                # after its graph on every call (`count_compiled_calls`); it drops such calls
                # in the frames it inlines (a selected class inside a compiled module), where
                # only `traced` runs, once per trace. Before torch.compile has loaded nothing
                # is made (dynamo would break its graph on the call). torch.export (which runs
                # this code in Python when not strict) is no call.
                comptime = compiled_calls.dynamo_comptime
                if comptime is not None and not torch.compiler.is_exporting():
                    compiled_call(name)
                    comptime(traced)
                return eager_call(self, *args, **kwargs)
            return _dispatch(self, eager_call, args, kwargs, name)

        def __setattr__(self: torch.nn.Module, name: str, value: Any) -> None:
            eager_setattr(self, name, value)
            instance = _instances.get(self)
            if instance is not None:
                instance.written(self, name)

        for fn in (__call__, __setattr__):
            setattr(fn, _WRAPPER, True)
            fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
        cls.__call__ = __call__  # type: ignore[method-assign]
        cls.__setattr__ = __setattr__  # type: ignore[method-assign]
        setattr(cls, PATCHED_MARKER, True)
        report.stats_for(name)
        count_compiled_calls()
        log.debug("patched %s", name)
        return True


def unpatch(cls: type) -> bool:
    """Restore `cls` exactly; False if it was not patched."""
    with _lock:
        patched = _patched.pop(cls, None)
        if patched is None:
            return False
        originals = (patched.own_call, patched.own_setattr)
        for name, original in zip(("__call__", "__setattr__"), originals, strict=True):
            if original is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        delattr(cls, PATCHED_MARKER)
        name = class_name(cls)
        _warned.difference_update([key for key in _warned if key[0] == name])  # warn anew
        compiled_calls.forget(name)
        return True


def unpatch_all() -> None:
    for cls in list(_patched):
        unpatch(cls)


def _settings_of(cls: type) -> Settings:
    """The settings of the nearest patched class in `cls`'s MRO."""
    for klass in cls.__mro__:
        patched = _patched.get(klass)
        if patched is not None:
            return patched.settings
    return Settings()  # unpatched while a call was on its way


def _eager_call_of(cls: type) -> Callable[..., Any]:
    """The `__call__` the class would have without us (skipping our wrappers up the MRO)."""
    for klass in cls.__mro__:
        candidate = klass.__dict__.get("__call__")
        if candidate is not None and not getattr(candidate, _WRAPPER, False):
            return candidate
    return torch.nn.Module.__call__


def mark_stale(module: torch.nn.Module) -> None:
    """Forget the graphs of `module`: for writes no mechanism can see."""
    instance = _instances.get(module)
    if instance is not None and instance.engine is not None:
        instance.engine.invalidate("marked stale")


# -- calls --------------------------------------------------------------------------------------


_is_compiling = torch.compiler.is_compiling


def _step_aside() -> bool:
    """Inside someone else's tracer or exporter, or our own export, the original code must run
    (torch.compile's tracing is told apart by the patched call: those calls are counted)."""
    # torch.onnx.is_in_onnx_export() is a process-wide flag: it would send other threads'
    # calls to PyTorch while any export runs. The TorchScript exporter traces, and the tracing
    # state is per thread, so is_tracing() covers a user's torch.onnx.export.
    return is_exporting() or torch.jit.is_tracing() or torch.compiler.is_exporting()


def _dispatch(
    module: torch.nn.Module,
    eager: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str,
) -> Any:
    if _step_aside():
        return eager(module, *args, **kwargs)
    if module.__dict__.get("_compiled_call_impl") is not None:
        # model.compile() compiled the module in place: its calls run as compiled
        compiled_call(name)
        return eager(module, *args, **kwargs)
    instance = _instances.get(module)
    if instance is None:
        instance = _new_instance(module)
    return instance.call(module, eager, args, kwargs)


def _new_instance(module: torch.nn.Module) -> _Instance:
    with _lock:
        instance = _instances.get(module)
        if instance is None:
            instance = _Instance(_patched_class(type(module)))
            _instances[module] = instance
            with instance.stats.lock:
                instance.stats.instances += 1
    return instance


def _patched_class(cls: type) -> type:
    """The selected class a call belongs to: FSDP2's `fully_shard` swaps an instance to a
    dynamic subclass (`FSDPBlock`), whose calls count for `Block`."""
    for klass in cls.__mro__:
        if klass in _patched:
            return klass
    return cls


class _Instance:
    """Per-instance state: the engine, the attributes forward read, the counters."""

    def __init__(self, cls: type) -> None:
        self.name = class_name(cls)
        self.settings = _settings_of(cls)
        self.stats = report.stats_for(self.name)
        self.engine: ModuleEngine | None = None
        self.guards = AttributeGuards(self.name)

    # the call --------------------------------------------------------------------------------
    def call(
        self,
        module: torch.nn.Module,
        eager: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        settings = self.settings
        if self.engine is None:
            self.engine = ModuleEngine(
                module,
                settings.engine,
                forward=self.guards.recording_forward,
                guards=self.guards,
                weak=True,
                backward_failed=self._backward_failed,
                listener=self.stats,  # the class's counters hear of builds, hazards, checks
            )
        engine = self.engine
        reason = _needs_eager(module, engine)
        if reason is not None:
            with self.stats.lock:
                self.stats.eager_calls[reason] += 1
            if (self.name, reason) not in _warned and reason.startswith("DataParallel"):
                _warned.add((self.name, reason))
                log.warning(
                    "%s runs in PyTorch under nn.DataParallel, which rebuilds the module on "
                    "every step; wrap it in DistributedDataParallel to train through ORT",
                    self.name,
                )
            elif (self.name, reason) not in _warned and reason.startswith("FSDP"):
                _warned.add((self.name, reason))
                log.warning("%s runs in PyTorch: %s", self.name, reason)
            return eager(module, *args, **kwargs)
        hooked = forward_hooked(module)
        if hooked:
            # FSDP2's pre-forward hook gathers the full parameters here; its post-forward hook
            # (below) frees them, and the backward hooks it puts on inputs and outputs fire
            # around ORT's backward as around eager autograd.
            args, kwargs = run_pre_hooks(module, args, kwargs)
        backward_hook = None
        if backward_hooked(module):
            # torch's BackwardHook around the inputs and the output: ORT's backward computes
            # the gradients the hooks see, and their results replace them as in eager
            backward_hook, args = setup_backward_hooks(module, args)

        def in_pytorch() -> Any:
            if hooked or backward_hook is not None:  # this call runs them already
                return forward_without_hooks(module, args, kwargs)
            return eager(module, *args, **kwargs)

        unreplayable = self.guards.unreplayable
        if unreplayable is not None:
            # forward changes state on every call: no graph, and no more traces to learn it
            output = self._eager_after(unreplayable, module, in_pytorch)
        else:
            output = self._ort_call(module, args, kwargs, in_pytorch)
        if hooked:
            output = run_post_hooks(module, args, kwargs, output)
        if backward_hook is not None:
            output = backward_hook.setup_output_hook(output)
        return output

    def _ort_call(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_pytorch: Callable[[], Any],
    ) -> Any:
        settings, engine = self.settings, self.engine
        assert engine is not None
        try:
            output = engine.run(
                args,
                kwargs,
                trust_last=skips(settings.skip_check, SkipCheck.SKIP_CHECK_BUILD_GRADIENT),
                check_devices=not skips(settings.skip_check, SkipCheck.SKIP_CHECK_DEVICE),
                recompute=torch.is_grad_enabled()
                and distributed.frees_parameters_after_forward(module),
                aside=settings.background_builds,
            )
        except BuildingAside as building:
            with self.stats.lock:
                self.stats.eager_calls[str(building)] += 1
            return in_pytorch()
        except Exception as exc:
            return self._eager_after(exc, module, in_pytorch)
        if type(output) is Replay:  # forward assigns tensors to attributes: do it again
            output = self.guards.replay(output, module)
        with self.stats.lock:
            self.stats.ort_calls += 1
        return output

    def _eager_after(
        self, exc: Exception, module: torch.nn.Module, in_pytorch: Callable[[], Any]
    ) -> Any:
        """Run the call in PyTorch after `exc`, as the fallback policy says (or raise)."""
        if isinstance(exc, SideEffectError) and exc.once:
            # forward wrote state once (transformers sets `config.problem_type` on its first
            # call): this call runs eagerly and writes it, and the next call is traced again.
            exc.once = False  # the same error remembered for this key is not once any more
            with self.stats.lock:
                self.stats.eager_calls["forward changed state: traced again next call"] += 1
        else:
            if not _falls_back(self.settings.fallback, exc):
                # a remembered error is raised again on later calls: no growing traceback
                raise exc.with_traceback(None)
            self._fallback(exc, distributed.mixed_precision(module))
        return in_pytorch()

    def _backward_failed(self, exc: ExecutionError) -> None:
        """A graph's backward failed in the user's backward (its forward ran in ORT, so that
        step cannot run in PyTorch instead): recorded and warned now, as the engine runs the
        class's later training calls in PyTorch."""
        self._fallback(exc, eager=False)

    def _fallback(self, exc: Exception, context: str | None = None, eager: bool = True) -> None:
        if isinstance(exc, EngineError):
            reason, cause, remedy = exc.reason, exc.cause, exc.remedy
        else:
            reason, cause, remedy = "unexpected error", f"{type(exc).__name__}: {exc}", ""
        if context is not None:  # e.g. the FSDP2 mixed-precision policy that made the dtypes
            reason = f"{reason} under {context}"
        with self.stats.lock:
            self.stats.fallbacks[(reason, cause)] += 1
            if eager:
                self.stats.eager_calls[f"fallback: {reason}"] += 1
        key = (self.name, reason)
        if key not in _warned and getattr(exc, "known_limitation", False):
            _warned.add(key)
            log.info("%s runs in PyTorch (%s): %s. %s", self.name, reason, cause, remedy)
        elif key not in _warned:
            _warned.add(key)
            log.warning(
                "%s runs in PyTorch (%s): %s. %s%s",
                self.name,
                reason,
                cause,
                remedy,
                _fallback_remedies(self.name),
            )

    def written(self, module: torch.nn.Module, name: str) -> None:
        """A write on the patched instance itself: counted when no graph notices it."""
        if self.engine is not None and self.guards.ignores(module, name):
            with self.stats.lock:
                self.stats.ignored_writes += 1


def _fallback_remedies(name: str) -> str:
    """What the user can do about any fallback, with the option names of this tool."""
    exclude, fallback, save = (BY_NAME[n] for n in ("exclude", "fallback", "save_onnx"))
    return (
        f"\n  to run {name} in PyTorch without this warning: {exclude.flag} '{name}' "
        f"({exclude.env})"
        f"\n  to stop at this error instead of running in PyTorch: {fallback.flag} "
        f"FALLBACK_DISABLE ({fallback.env})"
        f"\n  to report it: attach the graphs {save.flag} DIR ({save.env}) writes, and the "
        "message above"
    )


def _falls_back(policy: Fallback, exc: Exception) -> bool:
    """ORTModule's rule: each UNSUPPORTED_*/BAD_INITIALIZATION flag covers its kind of engine
    failure; FORCE_TORCH_FORWARD/BACKWARD cover every failure, unexpected ones included."""
    if any(
        falls_back(policy, flag)
        for flag in (Fallback.FALLBACK_FORCE_TORCH_FORWARD, Fallback.FALLBACK_FORCE_TORCH_BACKWARD)
    ):
        return True
    return isinstance(exc, EngineError) and falls_back(policy, _FALLBACK_FOR_KIND[exc.kind])


# -- calls ORT cannot take ---------------------------------------------------------------------


def _needs_eager(module: torch.nn.Module, engine: ModuleEngine) -> str | None:
    """Why this call cannot go to ORT at all, or None."""
    # DataParallel's replicate() sets it as a plain attribute; reading it through getattr
    # would cost every call Module.__getattr__'s AttributeError (~3 us on this host)
    if module.__dict__.get("_is_replica", False):
        # nn.DataParallel replicates the module on every forward: each replica would be a
        # new instance with a new export per step.
        return "DataParallel replica (use DistributedDataParallel)"
    if non_full_backward_hooks(module):
        # they hang on the last autograd node of the output, which is ORT's own
        return "non-full backward hooks (register_backward_hook)"
    if global_forward_hooks():
        # they would also run on the export's own modules, and on every submodule
        return "global forward hooks"
    if global_backward_hooks() and engine.has_submodules():
        return "global backward hooks (they run on every submodule, inside the graph)"
    reason = distributed.fsdp1_reason(module)
    if reason is not None:
        return reason
    if engine.submodule_hooks():
        sharded = distributed.sharded_submodules(module)
        if sharded:
            return (
                f"FSDP2 fully_shard on submodules ({', '.join(sharded[:3])}"
                f"{', ...' if len(sharded) > 3 else ''}): their hooks gather and free parameters "
                "inside this forward, which one graph cannot do; select the sharded classes"
            )
        return "hooks on submodules"
    return None
