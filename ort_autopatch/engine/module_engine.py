"""One module instance's way through ONNX Runtime, on every call: key the call, find its
graph in the cache (building it on a miss, `build.py`), run it (`entry.py`).

This is the hot path; keep build-time work out of it (torch's dynamo keeps the same rule
between its eval_frame and convert_frame).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine import (
    budget,
    persist,
    session,
    signature,
    verify,
)
from ort_autopatch.engine.backend import choose
from ort_autopatch.engine.build import Builder
from ort_autopatch.engine.cache import GraphCache
from ort_autopatch.engine.callkey import CallKey, Guards, KeyMaker, Mode, Shapes
from ort_autopatch.engine.entry import Entry, Specialises
from ort_autopatch.engine.errors import (
    BuildOverBudget,
    EngineError,
    ExecutionError,
    GradientBuildError,
    MixedDevicesError,
    SessionError,
)
from ort_autopatch.engine.events import BuildListener, Unheard
from ort_autopatch.engine.recipe import BuildRecord, EngineOptions, Miss, Recipe
from ort_autopatch.engine.state import ModuleState

__all__ = ["BuildRecord", "EngineOptions", "ModuleEngine", "Recipe"]

log = logging.getLogger("ort_autopatch")

#: Failures of ONNX Runtime over a static-shape graph that its dynamic graph may not have
_STATIC_GRAPH_FAILURES = (GradientBuildError, SessionError)

_any_autocast = torch._C._is_any_autocast_enabled


def _default_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module.forward(*args, **kwargs)


class ModuleEngine:
    """Runs calls of one module instance through cached ONNX Runtime graphs.

    `forward(module, *args, **kwargs)` is what gets exported (default: `module.forward`).
    Buffers forward updates in place are graph outputs copied back after each call; attribute
    writes are the caller's to handle (the patcher's recording forward undoes and replays them,
    `recording.py`): with the default forward, a graph does not repeat them.
    With `weak=True` the engine holds its module only weakly, so an engine cached per instance
    (in a WeakKeyDictionary, as the patcher does) never keeps a model alive. `listener` is told
    of every build, trace hazard and `--verify` comparison as it happens (`events.py`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        options: EngineOptions | None = None,
        forward: Callable[..., Any] | None = None,
        guards: Guards | None = None,
        weak: bool = False,
        backward_failed: Callable[[ExecutionError], None] | None = None,
        listener: BuildListener | None = None,
    ) -> None:
        self.options = options or EngineOptions()
        self._listener = listener or Unheard()
        self._backward_failed = backward_failed
        # a training graph's backward failed: its forward had run in ORT, so that step could
        # not run in PyTorch instead, but every later training call does
        self.backward_failure: ExecutionError | None = None
        self._module = weakref.ref(module)
        self._strong = None if weak else module
        self._cls = type(module).__qualname__
        self._forward = forward or _default_forward
        self._guards = guards
        self._cache: GraphCache[Entry] = GraphCache(self.options.cache_size)
        self._state = ModuleState(module)
        self._keys = KeyMaker(self._state, guards)
        self._lock = threading.Lock()
        self._build_lock = threading.RLock()  # one build at a time per module
        self._verified: dict[CallKey, int] = {}  # key -> calls verified
        self._trusted: dict[Mode, CallKey] = {}  # the key last used in each mode
        self._calls = 0  # calls taken, for the rebuild budget (budget.too_many_rebuilds)
        backend = choose(self.options.backend)
        self._backend = backend(self._cls, self.options, self._forward)
        # which input shapes each graph serves, and how a call finds its graph
        self._shapes = self._backend.shape_policy()
        self._holds = self._cache.holds  # bound once: every call's key may ask it
        self._builder = Builder(
            self._cls,
            self.options,
            self._backend,
            self._keys,
            persist.Persistence(
                self._cls,
                backend,
                persist.store_for(self.options.cache_dir),
                self.options.save_onnx,
                self.options.opset,
                guards,
            ),
            session.SessionSettings(self.options.threads),
            self._listener,
            self._on_backward_failure,
        )
        self.records: list[BuildRecord] = self._builder.records
        # comparisons with eager: the backend's first-call checks and --verify's
        self.verifications: list[verify.Verification] = self._builder.verifications

    @property
    def settings(self) -> session.SessionSettings:
        """How the sessions of graphs built from now on are made (the builder's)."""
        return self._builder.settings

    @settings.setter
    def settings(self, settings: session.SessionSettings) -> None:
        self._builder.settings = settings

    def _on_backward_failure(self, error: ExecutionError) -> None:
        """A training graph's backward failed: no training call runs in ORT from now on (each
        raises `error`, which the caller's fallback policy turns into a PyTorch call), and the
        caller hears of it now, since this step's own backward raises it to the user."""
        with self._lock:
            if self.backward_failure is None:
                self.backward_failure = error
                self._trusted = {m: k for m, k in self._trusted.items() if not k.has_backward}
        if self._backward_failed is not None:
            self._backward_failed(error)

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

    def has_submodules(self) -> bool:
        """Whether the module has submodules (a global module hook would run on them)."""
        return bool(self._state.modules)

    def invalidate(self, reason: str = "marked stale") -> None:
        """Forget every graph; the next call re-exports."""
        module = self._module()
        with self._lock:
            if module is not None:
                self._state = ModuleState(module)
            self._cache.clear()
            self._shapes.clear()
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
        aside: bool = False,
    ) -> Any:
        """Run one call.

        `trust_last` reuses the graph last used in the same grad/train mode without checking
        structure, guards or signature (SKIP_CHECK_BUILD_GRADIENT): faster, and stale when the
        module or the inputs changed in a way the graph cannot absorb. `recompute` keeps nothing
        of a training forward and runs it again in backward, for parameters whose memory is
        freed in between (FSDP2 resharding after forward). With `aside`, a graph the call
        misses may be built by a helper process (`aside.py`): the call raises `BuildingAside`
        then, for the caller to run it in PyTorch, until the graph is there.
        """
        module = self._module()
        if module is None:  # pragma: no cover - the caller holds the module
            raise ReferenceError("the module was garbage collected")
        try:
            return self._run(module, args, kwargs, trust_last, check_devices, recompute, aside)
        except Specialises as exc:
            # The graph recomputed a value its trace took from sizes and got another one: from
            # now on one graph per input shape (this call included).
            log.debug("%s: %s differs for this call; one graph per shape", self._cls, exc)
            with self._lock:
                self._shapes.specialises()
                self._keys.note(f"sizes change a traced value ({exc.where})")
            return self._run(module, args, kwargs, False, check_devices, recompute, aside)

    def _run(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        trust_last: bool,
        check_devices: bool,
        recompute: bool,
        aside: bool,
    ) -> Any:
        self._calls += 1  # not atomic; it only weighs builds against calls
        call = signature.flatten_call(self._cls, args, kwargs, check_devices)
        autocast = None
        if _any_autocast():  # one C call while autocast is off
            autocast = amp.state(self._device_type(call))
        mode: Mode = (torch.is_grad_enabled(), module.training, autocast)
        shapes = self._shapes  # `ShapePolicy.pick`, inlined: every call asks
        hot, earned = (None, False) if shapes.per_shape else shapes.hot.pick(mode, call.shapes)
        if trust_last and not earned and mode in self._trusted:
            last = self._trusted[mode]
            # even unchecked, a graph never takes sizes it was not built for
            if self._shapes.fits(last, call, hot):
                trusted = self._cache.get(last)  # None once evicted
                if trusted is not None:
                    return trusted.run(self._state, call, recompute)
        stale = self._keys.stale()
        if stale is not None:
            self.invalidate(stale)
            if autocast is not None:  # the module may have moved to another device type
                autocast = amp.state(self._device_type(call))
        state = self._state
        requires = state.requires_grad_flags() if torch.is_grad_enabled() else []
        grad = any(requires) or (
            torch.is_grad_enabled() and any(t.requires_grad for t in call.tensors)
        )
        if grad:
            if self.backward_failure is not None:
                raise self.backward_failure.with_traceback(None)
            self._backend.refuse(call)
        else:
            requires = []
        if earned and self._shapes.earned_new(
            self._key(grad, call, requires, hot, autocast), self._cache.holds
        ):
            self._keys.note(
                f"input shape repeated {self._shapes.hot.after} calls: a static-shape graph for it"
            )
        checked = len(self.verifications)
        try:
            key, entry = self._entry(
                module, state, call, mode, grad, requires, hot, autocast, aside, recompute
            )
        except EngineError as exc:
            if hot is None or self._shapes.per_shape:
                raise
            dynamic = self._key(grad, call, requires, None, autocast)
            if not (self._cache.holds(dynamic) or isinstance(exc, _STATIC_GRAPH_FAILURES)):
                # The trace refused the call (a mode's first call, whose static-shape graph
                # comes before the dynamic one): the dynamic trace would refuse it as well, so
                # the failure stands for both, and the shape keeps its claim on a static graph.
                self._cache.fail(dynamic, exc)
                raise
            # ONNX Runtime refused the static-shape graph itself, or the dynamic graph is
            # there: the dynamic graph serves these shapes.
            log.debug("%s: no static-shape graph for %s (%s)", self._cls, hot, exc)
            self._shapes.hot.refuse(mode, hot)
            key, entry = self._entry(
                module, state, call, mode, grad, requires, None, autocast, aside, recompute
            )
        # the build's check ran the graph on this very call (`verify.Kept`)
        made, result = entry.take_first(call)
        if len(self.verifications) > checked:
            # the build compared this very call with eager (`Backend.verifies_first_call`):
            # one of the key's --verify calls, not run twice
            self._verified[key] = self._verified.get(key, 0) + 1
        elif self.options.verify and self._verified.get(key, 0) < self.options.verify:
            self._verified[key] = self._verified.get(key, 0) + 1
            self._verify(module, entry, state, call, grad, key)
        self._keys.used(key, mode)
        self._trusted[mode] = key
        if made:
            return result
        return entry.run(state, call, recompute)

    def _entry(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        call: signature.FlatCall,
        mode: Mode,
        grad: bool,
        requires: list[bool],
        hot: Shapes | None,
        autocast: amp.State,
        aside: bool,
        recompute: bool,
    ) -> tuple[CallKey, Entry]:
        """The call's key and its graph, built on a miss (explained against the last key
        used in `mode`)."""
        key = self._key(grad, call, requires, hot, autocast)
        entry = self._cache.get(key)
        if entry is not None:
            return key, entry
        with self._build_lock:
            # Another thread may have built it meanwhile, under a key its build settled.
            key = self._key(grad, call, requires, hot, autocast)
            entry = self._cache.get(key)
            if entry is not None:
                return key, entry
            refused = budget.too_many_rebuilds(
                self._cls, self._cache.builds + self._cache.refusals, self._calls
            )
            if refused is not None:
                raise refused
            base = dataclasses.replace(key, shapes=None)
            reason = self._shapes.miss_reason(base, call, self._keys.miss_reason(key, mode))
            try:
                entry = self._cache.get_or_build(
                    key,
                    lambda: self._build(
                        module,
                        state,
                        call,
                        grad,
                        reason,
                        hot,
                        autocast,
                        base,
                        requires,
                        aside,
                        recompute,
                    ),
                )
            except BuildOverBudget as exc:
                self._cache.refuse(key, exc)  # trying again would cost as much again
                raise
            # The build may have switched to static shapes or taught the guards new
            # attributes: file the graph under the key later calls will compute.
            base = self._base(grad, call, requires, autocast)
            settled = self._shapes.settled(
                self._keys, grad, call, requires, hot, autocast, base, entry.recipe.size_guards
            )
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
        autocast: amp.State = None,
    ) -> CallKey:
        """`hot`: the call's shapes when they earned a static-shape graph (`HotShapes`);
        `autocast`: the call's autocast state."""
        if requires is None:
            requires = self._state.requires_grad_flags() if grad else []
        return self._shapes.key(self._keys, grad, call, requires, hot, autocast, self._holds)

    def _base(
        self, grad: bool, call: signature.FlatCall, requires: list[bool], autocast: amp.State
    ) -> CallKey:
        """The call's key without its sizes, under the guards known now (a build may have
        taught them attributes forward reads: the key before it lacks them)."""
        key = self._keys.key(grad, call.signature, None, requires, autocast)
        return dataclasses.replace(key, shapes=None)

    def _device_type(self, call: signature.FlatCall) -> str:
        """The device type whose autocast state applies: the module's tensors', else the
        inputs' (a module without parameters)."""
        device_type = self._state.device_type
        if device_type is None:
            device_type = call.tensors[0].device.type if call.tensors else "cpu"
        return device_type

    def _build(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        call: signature.FlatCall,
        grad: bool,
        reason: str,
        hot: Shapes | None,
        autocast: amp.State,
        base: CallKey,
        requires: list[bool],
        aside: bool,
        recompute: bool,
    ) -> Entry:
        devices = state.devices() | {t.device for t in call.tensors}
        if len(devices) > 1:
            raise MixedDevicesError(
                self._cls,
                f"inputs, parameters and buffers span {', '.join(sorted(map(str, devices)))}",
                "Move the module and its inputs to one device (model.to(device))",
            )
        device = next(iter(devices), torch.device("cpu"))
        request = self._shapes.request(base, call, hot)
        miss = Miss(
            module,
            state,
            call,
            grad,
            device,
            hot,
            request.shapes,
            request.per_shape,
            autocast,
            request.dynamic,
            recompute,
        )
        try:
            entry = self._builder.build(miss, reason, aside)
        finally:
            # what the build learned holds even when it failed: the model specialises on sizes
            # (the key without sizes again: the build may have taught the guards attributes)
            learned = self._builder.learned
            self._shapes.learned(
                self._base(grad, call, requires, autocast),
                request.per_shape or learned.per_shape,
                learned.cause,
            )
        self._shapes.built(
            self._base(grad, call, requires, autocast), entry.recipe.size_guards, call
        )
        return entry

    def _verify(
        self,
        module: torch.nn.Module,
        entry: Entry,
        state: ModuleState,
        call: signature.FlatCall,
        grad: bool,
        key: CallKey,
    ) -> None:
        """Run this call also through the graph and eagerly and compare (`--verify`); a
        mismatch remembers this key as failed, so its calls run in PyTorch."""
        try:
            result = verify.verify_entry(self._cls, module, entry, state, call, grad, self._forward)
        except verify.VerificationError as exc:
            if exc.verification is not None:
                self._builder.verified(exc.verification)
            self._cache.fail(key, exc)
            raise
        except EngineError:
            raise  # the graph's own failure: the caller's fallback policy takes the call
        except Exception as exc:
            # The comparison itself failed (the user's state restored): the call still runs,
            # and the report says why it was not verified, instead of an error in their run.
            why = f"verification failed: {type(exc).__name__}: {exc}"
            log.warning("%s: %s", self._cls, why)
            self._builder.verified(verify.Verification(unverified=why))
            return
        self._builder.verified(result)
