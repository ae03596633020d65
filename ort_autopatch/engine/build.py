"""Building a graph for a call that missed the cache: the cold path, for every backend.

A build loads the graph from the persistent cache when it holds one, else asks the backend to
capture the call (`Backend.build`, `backends/`); either way the backend makes its sessions
(`Backend.instantiate`) and the result is bound to the module's tensors as an `Entry`.
Around that: the on-disk key, saving what was built, the build's record for reports and a
warning while a slow build runs. `ModuleEngine` (the hot path) calls `Builder.build` under
its build lock and files the entry in its cache.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ort_autopatch.engine import aside, budget, eager_child, gc_freeze, heap, session, verify
from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine.backend import Backend, RunHooks
from ort_autopatch.engine.callkey import KeyMaker, Shapes
from ort_autopatch.engine.entry import Entry
from ort_autopatch.engine.errors import (
    BUILDING,
    WAITING,
    AutocastUnsupportedError,
    BuildingAside,
    BuildOverBudget,
    EngineError,
    ExecutionError,
    SessionError,
    UnsupportedModelError,
)
from ort_autopatch.engine.events import BuildListener
from ort_autopatch.engine.persist import Persistence
from ort_autopatch.engine.recipe import BuildRecord, EngineOptions, Miss, Recipe

log = logging.getLogger("ort_autopatch")

#: After this many seconds a build says, while it runs, that it is still working.
SLOW_BUILD_SECONDS = 2.0

#: ORT's refusal of a node it has no kernel for (the operator's name is group 1)
_MISSING_KERNEL = re.compile(r"Could not find an implementation for (\w+)\(")


class Builder:
    """Builds the graphs of one module instance through its backend; `records` says what
    each build cost and why it happened, and `listener` hears of each record and of each
    hazard the backend's traces find."""

    def __init__(
        self,
        cls: str,
        options: EngineOptions,
        backend: Backend,
        keys: KeyMaker,
        persistence: Persistence,
        settings: session.SessionSettings,
        listener: BuildListener,
        backward_failed: Callable[[ExecutionError], None] | None = None,
    ) -> None:
        self._cls = cls
        self._backward_failed = backward_failed  # told when a graph's backward fails
        self.options = options
        self.backend = backend
        self._keys = keys
        self._persistence = persistence
        self.settings = settings
        self._listener = listener
        self.records: list[BuildRecord] = []
        #: comparisons with eager: first calls (`Backend.verifies_first_call`) and --verify's
        self.verifications: list[verify.Verification] = []
        self.learned = Learned()  # what the last build found (`build`)
        self._arena_shapes: tuple[tuple[int, ...], ...] | None = None  # see `_uses_arena`
        self._pending: dict[str, aside.Pending] = {}  # store key -> the child building it
        #: the child making the build's eager side of the first-call check, if any
        self._eager: eager_child.EagerChild | None = None

    def build(self, miss: Miss, reason: str, aside: bool = False) -> Entry:
        """Build the graph of one key, for the shapes `miss.shapes` asks. The export runs
        under the call's autocast state (this thread's), so it traces autocast's casts.
        What the build learned, failed or not, is `learned` afterwards. With `aside`, where
        the backend allows (`Backend.builds_aside`), a child builds it while the call runs in
        PyTorch (`_aside`: raises `BuildingAside` until the graph is there)."""
        self.learned = Learned()
        try:
            with _outside_saved_tensor_hooks() as hooked:
                if aside and self.backend.builds_aside:
                    entry = self._aside(miss, reason)
                    if entry is not None:
                        return entry
                try:
                    with gc_freeze.frozen_heap():
                        # the check's run of the graph is the call's own, unless the call
                        # saves through hooks or recomputes forward in backward
                        return self._build(miss, reason, keep=not (hooked or miss.recompute))
                finally:
                    if self._eager is not None:  # taken by the check, or not needed
                        self._eager.close()
                        self._eager = None
                    heap.release_freed()
        except SessionError as exc:
            missing = _MISSING_KERNEL.search(exc.cause)
            if miss.autocast is None or missing is None:
                raise
            raise AutocastUnsupportedError(
                self._cls,
                f"ONNX Runtime's {miss.autocast[0]} build has no "
                f"{amp.describe(miss.autocast).split()[-1]} kernel for {missing.group(1)}, "
                "which autocast's casts ask for",
                amp.REMEDY,
            ) from None

    def _build(self, miss: Miss, reason: str, keep: bool = False) -> Entry:
        limits = budget.Limits(self.options.max_build_seconds, self.options.max_graph_nodes)
        with _progress(self._cls, self.learned) as progress, budget.limited(self._cls, limits):
            start = time.perf_counter()
            persisted = self._persistent_key(miss)
            if persisted is not None:
                entry = self._load(persisted, miss, progress)
                if entry is not None:
                    guards = entry.recipe.size_guards
                    self._record(
                        BuildRecord(
                            reason,
                            0.0,
                            time.perf_counter() - start,
                            entry.recipe.has_backward,
                            from_disk=True,
                            dynamic=guards is not None and guards.is_dynamic,
                        ),
                        entry,
                    )
                    return entry
            known = len(self.backend.hazards)
            if self.backend.verifies_first_call:
                progress.on_core_free = lambda: self._fork_eager(miss)
            try:
                recipe, export_seconds = self.backend.build(miss, progress)
            finally:  # a refused trace (data-dependent, say) found hazards too
                progress.on_core_free = None
                for hazard in self.backend.hazards[known:]:
                    self._listener.found(hazard)
            budget.check("before creating its ONNX Runtime session")
            progress.phase = "session"
            entry = self._instantiate(recipe, miss, progress)
            if self.backend.verifies_first_call:
                # A stored graph is not checked again: these very bytes passed when they were
                # built, for a call of the same key; `--verify N` still compares.
                progress.phase = "checking the first call against eager"
                self._check_first_call(entry, miss, keep)
            guards = entry.recipe.size_guards
            per_shape = miss.per_shape or self.learned.per_shape
            self._record(
                BuildRecord(
                    reason,
                    export_seconds,
                    time.perf_counter() - start - export_seconds,
                    entry.recipe.has_backward,
                    per_shape=per_shape,
                    hot_shape=miss.hot is not None and not per_shape,
                    dynamic=guards is not None and guards.is_dynamic,
                ),
                entry,
            )
        # Recomputed: the build may have switched to the call's own shapes.
        self._persistence.save(
            miss.module,
            entry.recipe,
            entry.program.saved_graphs,
            miss.call,
            self._persistent_key(miss, miss.call.shapes() if self.learned.per_shape else None),
            base_key=persisted,
        )
        return entry

    def _load(self, persisted: str, miss: Miss, progress: _Progress) -> Entry | None:
        """The graph stored under `persisted` made runnable for `miss`, or None: none is
        stored, its size guards exclude this call, or ONNX Runtime refuses it."""
        stored = self._persistence.load(persisted, miss.module)
        guards = None if stored is None else stored.size_guards
        if guards is not None and not guards.admits(miss.call.shapes()):
            # a graph of these dimensions whose guards exclude this call (a branch on a
            # size): built again, and stored in its place
            log.debug("%s: stored graph's %s", self._cls, guards.first_failure(miss.call.shapes()))
            stored = None
        if stored is None:
            return None
        progress.phase = "session"
        try:
            return self._instantiate(stored, miss, progress)
        except SessionError as exc:  # a stored graph ONNX Runtime refuses: rebuilt
            log.warning(
                "ort_autopatch: %s: ignoring a cached graph (%s); rebuilding", self._cls, exc.cause
            )
            return None

    # -- building in a helper process (aside.py) ------------------------------------------
    def _aside(self, miss: Miss, reason: str) -> Entry | None:
        """The key's graph as built by a child (`aside.py`): loaded once the child is done;
        `BuildingAside` while it builds, or waits for another graph's child; None where this
        process builds it after all (no child may fork here, no key to store it under, or
        the child stored nothing)."""
        persistence = self._with_store()
        static = None if persistence is None else self._persistent_key(miss)
        if static is None:
            return None
        pending = self._pending.get(static)
        if pending is not None and not pending.ours():  # inherited by a forked process
            del self._pending[static]
            pending = None
        if pending is None:
            entry = self._load(static, miss, _Progress(self.learned))
            if entry is not None:  # built aside before (the LRU let it go since)
                self._record(BuildRecord(reason, 0.0, 0.0, entry.recipe.has_backward, True), entry)
                return entry
            why = aside.refusal(miss.device)
            if why is not None:
                log.debug("%s: built in this process: %s", self._cls, why)
                return None
            pending = aside.start(lambda: self._build_in_child(miss, reason))
            if pending is None:
                raise BuildingAside(WAITING)
            self._pending[static] = pending
            raise BuildingAside(BUILDING)
        outcome = pending.poll()
        if outcome is None:
            raise BuildingAside(BUILDING)
        del self._pending[static]
        self.learned = Learned(outcome.per_shape, outcome.cause)
        if outcome.over_budget is not None:
            raise outcome.over_budget
        entry = None
        if outcome.stored is not None:
            entry = self._load(outcome.stored, miss, _Progress(self.learned))
        if entry is None:
            log.debug(
                "%s: built in this process: the helper %s",
                self._cls,
                outcome.failure or "stored no graph it could load",
            )
            return None
        # what the child told its listener, told here (a build here would tell it itself)
        for hazard in outcome.hazards:
            self._listener.found(hazard)
        for record in outcome.records:
            record.aside = True
            self.records.append(record)
            self._listener.built(record)
        for verification in outcome.verifications:
            self.verified(verification)
        return entry

    def _with_store(self) -> Persistence | None:
        """This builder's persistence, given the process's private store (`handoff_store`)
        where the user keeps no persistent cache: a child's graph comes back through it."""
        if self._persistence.store is None:
            store = aside.handoff_store()
            if store is None:
                return None
            self._persistence = self._persistence.with_store(store)
        return self._persistence

    def _build_in_child(self, miss: Miss, reason: str) -> aside.Outcome:
        """In a build child: the build this process would run, stored; what it told and
        learned go back in the outcome."""
        heard = aside.Collected()
        self._listener = heard
        # its sessions only check the graph: none of this process's shared arena
        self.options = dataclasses.replace(self.options, memory_arena=False)
        outcome = aside.Outcome()
        try:
            self.build(miss, reason)
            shapes = miss.call.shapes() if self.learned.per_shape else None
            outcome.stored = self._persistent_key(miss, shapes)
        except BuildOverBudget as exc:
            outcome.over_budget = exc
        except Exception as exc:
            outcome.failure = f"failed ({type(exc).__name__}: {exc})"
        outcome.records = heard.records
        outcome.verifications = heard.verifications
        outcome.hazards = heard.hazards
        outcome.per_shape, outcome.cause = self.learned.per_shape, self.learned.cause
        return outcome

    def _fork_eager(self, miss: Miss) -> None:
        """A child making `miss`'s eager side of the first-call check on the core the backend
        found spare (`eager_child`), where one may be forked."""
        if self._eager is None:
            self._eager = eager_child.EagerChild.start(miss, self.backend.forward)

    def _check_first_call(self, entry: Entry, miss: Miss, keep: bool) -> None:
        """The call that built the graph, through the graph and eagerly (`verify`; eager's
        side from the child that made it meanwhile, where it did); raises
        `verify.VerificationError` when they differ beyond eager's own spread. With `keep`,
        the graph's run is the call's own where it can be (`verify.Kept`): `entry.first`."""
        random = self.backend.random_operators(entry.recipe)
        kept = verify.Kept() if keep else None
        made = self._eager if self._eager is not None and self._eager.miss is miss else None
        try:
            result = verify.verify_entry(
                self._cls,
                miss.module,
                entry,
                miss.state,
                miss.call,
                miss.has_backward,
                self.backend.forward,
                random,
                made if made is not None and made.fresh() else None,
                kept,
            )
        except verify.VerificationError as exc:
            if exc.verification is not None:
                self.verified(exc.verification)
            raise
        except EngineError:
            raise  # the graph's own failure: the caller's fallback policy takes the call
        except Exception as exc:
            # the comparison itself failed (eager raised on the copies): the graph is used,
            # and the report says why it was not verified
            why = f"verification failed: {type(exc).__name__}: {exc}"
            log.warning(
                "%s: the first call's check against eager could not be made (%s)", self._cls, why
            )
            result = verify.Verification(unverified=why)
        self.verified(result)
        if kept is not None and kept.made:
            entry.first = (miss.call, kept)

    def verified(self, result: verify.Verification) -> None:
        """File a comparison with eager (a first call's, or --verify's), and tell it."""
        self.verifications.append(result)
        self._listener.verified(result)

    def _persistent_key(self, miss: Miss, shapes: Shapes | None = None) -> str | None:
        """The on-disk key of the graph built for `miss` (for `shapes`, when the build found
        it serves only those)."""
        if not self._persistence.enabled:
            return None
        requires = miss.state.requires_grad_flags() if miss.has_backward else []
        shapes = miss.shapes if shapes is None else shapes
        key = self._keys.key(
            miss.has_backward, miss.call.signature, shapes, requires, miss.autocast
        )
        return self._persistence.key(miss.module, miss.state, key, miss.device)

    def _record(self, record: BuildRecord, entry: Entry) -> None:
        """Keep `record` of the build of `entry` (with its torch-calling nodes), and tell it."""
        record.torch_nodes = dict(entry.program.torch_nodes)
        self.records.append(record)
        self._listener.built(record)
        log.debug(
            "%s: %s %s graph (%s) in %.3fs export + %.3fs build",
            self._cls,
            "loaded" if record.from_disk else "built",
            "training" if record.has_backward else "inference",
            record.reason,
            record.export_seconds,
            record.build_seconds,
        )

    def _uses_arena(self, miss: Miss) -> bool:
        """Whether the graph allocates from the shared arena (`memory_arena`): one that serves
        input shapes that repeat, whose steps ask for the same sizes every time. A static-shape
        graph (`Miss.hot`: the first call's shapes, or a shape that came back) does; of the
        other graphs that serve one shape (`Miss.one_shape`: sizes a trace froze, a
        plain-backend graph of exact sizes) only those of the module's first shape do, since
        its shapes may vary every step: an arena grown for each new size keeps every size's
        buffers (1.4 GiB over 4 sizes of 64 MiB inputs), where plain allocations are freed
        with the step's tensors."""
        if not self.options.memory_arena or not miss.one_shape():
            return False
        shapes = miss.call.shapes()
        if self._arena_shapes is None:
            self._arena_shapes = shapes
        return miss.hot is not None or self._arena_shapes == shapes

    def _instantiate(self, recipe: Recipe, miss: Miss, progress: _Progress) -> Entry:
        """Sessions for a recipe, bound to this module's tensors (`_uses_arena` says where
        they allocate)."""
        state = miss.state
        settings = self.settings
        if not settings.arena and self._uses_arena(miss):
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

        hooks = RunHooks(self._cls, self._backward_failed)
        program = self.backend.instantiate(recipe, miss, hooks, settings, progress)
        feeds = [locate(n) for n in program.feed_names]
        return Entry(recipe, program, feeds)


@dataclass
class Learned:
    """What a build found that outlasts it, failed or not (`Progress.specialises`)."""

    per_shape: bool = False  # the model's graphs serve one input shape each
    cause: str = ""  # where the model's code fixed the sizes, when known


class _Progress:
    """A build as it goes (`backend.Progress`)."""

    def __init__(self, learned: Learned) -> None:
        self.phase = "export"
        self._learned = learned
        #: what the builder does with a spare core (`core_free`), while the backend builds
        self.on_core_free: Callable[[], None] | None = None

    def specialises(self, cause: str = "") -> None:
        self._learned.per_shape = True
        self._learned.cause = self._learned.cause or cause

    def core_free(self) -> None:
        if self.on_core_free is not None:
            self.on_core_free()


@contextmanager
def _outside_saved_tensor_hooks() -> Iterator[bool]:
    """Take the caller's saved-tensor hooks off this thread while a build runs, and put them
    back after. A call under activation checkpointing (`checkpoint_wrapper`) builds inside the
    checkpoint's hooks: the plain backend's trace and its first-call check run autograd, whose
    saved tensors the checkpoint would take as the call's own (and rerun the call, mid-build,
    to get them back). Yields whether it took any."""
    hooks = torch._C._autograd
    taken = []
    while (top := hooks._top_saved_tensors_default_hooks(True)) is not None:
        hooks._pop_saved_tensors_default_hooks()
        taken.append(top)
    try:
        yield bool(taken)
    finally:
        for pack, unpack in reversed(taken):
            hooks._push_saved_tensors_default_hooks(pack, unpack)


@contextmanager
def _progress(cls: str, learned: Learned) -> Iterator[_Progress]:
    """Say while it runs that a slow build is still working, so nobody thinks training hung."""
    progress = _Progress(learned)
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
