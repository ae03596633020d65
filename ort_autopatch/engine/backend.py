"""Backends: what differs between ONNX Runtime packages, behind one interface.

The engine is written once for every backend: the call key (`callkey.py`), flattening a call
(`signature.py`), the module's tensors (`state.py`), the caches in memory (`cache.py`) and on
disk (`persist.py`, `store.py`), the entry a call runs (`entry.py`: feeds gathered in the order
`Program.feed_names` asks, size checks, buffer updates written back), `--verify`, reports and
the progress warning. A backend supplies the rest, for one module instance at a time:

1. `build(miss, progress)`: capture the call that missed the cache (`Miss`: module, state,
   call, grad, device, shapes) and return a `Recipe` (and the seconds capture took): plain
   data saying how to feed and read the graph (`feed_sources`, `output_spec`,
   `batch_norms`, ...), the exported forward graph and the backend's own `payload` (graphs
   and facts only this backend reads). How it captures is its business: the training build
   exports `forward` with the TorchScript exporter and lets ORT's gradient builder
   differentiate it; a backend may as well trace the module with the example inputs
   (`miss.module`, `miss.call.tensors`, `miss.call.spec()`) through torch's autograd. Build
   for `miss.shapes` (None: every size); call `progress.specialises()` when the model's
   graphs can only fit one input shape each (the engine then keys every later graph of the
   module by shape); a backend whose graphs carry size guards (its `shape_policy()` is
   `GuardedSizes`) traces `miss.dynamic` as symbols and says in `Recipe.size_guards` which
   sizes the graph serves. Raise an `EngineError` subclass (with a cause and a remedy) when
   the call cannot run: the engine falls back to eager.
2. `instantiate(recipe, miss, hooks, settings, progress)`: sessions for a recipe (built just
   now or loaded from disk) as a `Program`. `Program.run(feeds, recompute)` takes the
   tensors named by `feed_names` and returns the user outputs (then the checks output, when
   the recipe has checks); when `recipe.has_backward`, the outputs are tied into autograd
   through the shared run-time: `graph_function.apply` (the autograd Function, which tells
   `hooks` of a failed backward), `session.RunnableSession` (one session run, its
   `ExecutionError`), `dlpack` (feeds and fetches without copies).
3. `payload_from(meta, graphs)`: the payload again from what `Payload.meta()` and
   `Payload.graphs()` stored (the store's checksums say they are the bytes this tool wrote; a
   backend may check more before any session sees them), and `graph_version()`: what else
   decides the graphs, for the persistent cache keys.

A new backend is a package in `backends/` and one `register` call (the two shipped ones are
declared below, in `BACKENDS`): the configuration's `--backend` choices, `--check`, the report
and the engine all read this registry and nothing else. The same seed, the same run: random
operators draw from `rng`'s stream, never from torch's generator. Which backend a run uses is
decided once, here (`resolve`; "auto": the first available in declaration order, else the
default, whose reason then says what to install); engines take the class `choose` returns, and
their recipes are stored under keys that name it.
"""

from __future__ import annotations

import functools
import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ort_autopatch.engine import runtime

if TYPE_CHECKING:
    import torch

    from ort_autopatch.engine import hazards
    from ort_autopatch.engine.errors import DataDependentError, ExecutionError
    from ort_autopatch.engine.recipe import EngineOptions, Miss, Payload, Recipe
    from ort_autopatch.engine.session import SessionSettings
    from ort_autopatch.engine.shape_policy import ShapePolicy
    from ort_autopatch.engine.signature import FlatCall

log = logging.getLogger("ort_autopatch")


@dataclass(frozen=True)
class Declared:
    """One backend as the registry knows it, without importing it."""

    name: str  # the option value; in cache keys and reports
    implementation: str  # "module:Class" of its `Backend`, imported on first use
    #: why it cannot run in this interpreter (which package to install), or None; reads
    #: package metadata only, never imports onnxruntime
    unavailable: Callable[[], str | None]
    #: the ONNX Runtime distributions it runs on (the report's `onnxruntime` version)
    distributions: tuple[str, ...] = field(default=())


#: name -> declaration, in the order "auto" tries them (the first available wins); more are
#: added with `register`
BACKENDS: dict[str, Declared] = {
    declared.name: declared
    for declared in (
        Declared(
            "ort-training",
            "ort_autopatch.engine.backends.ort_training.backend:OrtTrainingBackend",
            runtime.training_build_missing,
            runtime.TRAINING_DISTRIBUTIONS,
        ),
        Declared(
            "ort",
            "ort_autopatch.engine.backends.ort.backend:OrtBackend",
            runtime.plain_build_missing,
            runtime.INFERENCE_DISTRIBUTIONS,
        ),
    )
}
#: what "auto" falls back to when no backend can run here: the maintained package's, whose
#: reason names what to install on any Python
DEFAULT = "ort"


def register(declared: Declared, first: bool = False) -> None:
    """Declare a backend: "auto" tries it after those declared before it, or, `first`,
    before every other."""
    others = [d for d in BACKENDS.values() if d.name != declared.name]
    BACKENDS.clear()  # in place: whoever holds the dict sees the new order
    for d in [declared, *others] if first else [*others, declared]:
        BACKENDS[d.name] = d
    choose.cache_clear()


def names() -> tuple[str, ...]:
    """The backends' names, in declaration order (the `--backend` choices besides "auto")."""
    return tuple(BACKENDS)


def resolve(name: str | None = "auto") -> str:
    """The backend a run uses: the one named, or for "auto" the first declared one that can
    run here, else `DEFAULT`. The one place "auto" is decided: the engine, `--check` and the
    report ask here."""
    if name not in (None, "auto"):
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; declared: {', '.join(BACKENDS)}")
        return name
    available = (d.name for d in BACKENDS.values() if d.unavailable() is None)
    return next(available, DEFAULT if DEFAULT in BACKENDS else next(iter(BACKENDS)))


def unavailable_reason(name: str | None = "auto") -> str | None:
    """Why the backend `resolve(name)` picks cannot run here (None: it can)."""
    return BACKENDS[resolve(name)].unavailable()


def version(name: str | None = "auto") -> str | None:
    """ONNX Runtime's version as the backend `resolve(name)` picks runs it (metadata only)."""
    return runtime.version(BACKENDS[resolve(name)].distributions)


#: what gets exported or traced: `forward(module, *args, **kwargs)`
Forward = Callable[..., Any]


class Progress(Protocol):
    """A build as it goes: what it is doing now (the engine's watchdog names it when a build
    is slow), and what it learned that outlasts it, failed or not."""

    phase: str

    def specialises(self, cause: str = "") -> None:
        """The model's graphs must serve one input shape each (a trace froze sizes, a
        symbolic trace failed; `cause`: where the model's code fixed them, or "")."""
        ...

    def core_free(self) -> None:
        """A core is spare beside this process for the next seconds (the backend's helper
        has it, idle while this process traces): the engine may use it for the build's
        other work (`eager_child`: the first-call check's eager side)."""
        ...


@dataclass(frozen=True)
class RunHooks:
    """What every program tells the engine while it runs, whatever its backend: given to
    `Backend.instantiate`, honoured by the shared run-time (`graph_function`)."""

    module_class: str
    #: a training graph's backward failed (its forward had run in ORT, so that step cannot
    #: run in PyTorch instead): the engine sends the class's later training calls to PyTorch
    backward_failed: Callable[[ExecutionError], None] | None = None


class Program(Protocol):
    """A recipe made runnable on one device: what a call through the cache runs."""

    @property
    def feed_names(self) -> Sequence[str]:
        """The graph inputs `run` takes, in order."""
        ...

    @property
    def torch_nodes(self) -> dict[str, int]:
        """Operators running as torch-calling nodes ("aten::x": 2)."""
        ...

    @property
    def saved_graphs(self) -> dict[str, bytes]:
        """Role -> the graph as it runs, for --save-onnx."""
        ...

    def run(self, feeds: list[torch.Tensor], recompute: bool) -> Sequence[torch.Tensor]:
        """One call. `recompute`: keep nothing of a training forward and run it again in
        backward (parameters freed in between, FSDP2)."""
        ...

    def undo_point(self, feeds: Sequence[torch.Tensor]) -> Callable[[], None]:
        """What a run over `feeds` changes besides its outputs (buffers it updates, seeds it
        takes), saved now: calling the result puts it back. The engine asks before running a
        graph whose size checks may find that the call does not fit it after all."""
        ...


class Backend(ABC):
    """Builds and runs one module instance's graphs on one ONNX Runtime package."""

    name: ClassVar[str]  # in cache keys, reports and `BACKENDS`
    #: `EngineOptions` fields this backend does not take: setting one is said once, never
    #: silently ignored
    ignores: ClassVar[tuple[str, ...]] = ()
    #: the call that builds a graph (not one loaded from the persistent cache) also runs
    #: eagerly and the two are compared (`verify.verify_entry`) before the graph is trusted;
    #: counted in the report's verifications like `--verify`'s
    verifies_first_call: ClassVar[bool] = False
    #: a graph may be built by a forked child while its calls run in PyTorch (`aside.py`):
    #: where builds cost seconds and a process of this backend's holds nothing a fork breaks
    builds_aside: ClassVar[bool] = False

    def __init__(self, module_class: str, options: EngineOptions, forward: Forward) -> None:
        self.module_class = module_class
        self.options = options
        self.forward = forward
        self.hazards: list[hazards.Hazard] = []  # trace hazards its captures found, for reports
        if self.ignores:
            _say_ignored(self.name, options, self.ignores)

    @staticmethod
    @abstractmethod
    def graph_version() -> str:
        """What decides this backend's graphs besides the tool's, torch's and ONNX Runtime's
        versions (its passes, its sources, the exporter's packages): part of every persistent
        cache key. Cheap: a cache hit calls it before anything else is loaded."""

    @classmethod
    def doctor(cls, options: EngineOptions) -> list[tuple[str, str]]:
        """`--check`'s lines of this backend's own (label, status), made ready now where a
        run would otherwise wait or start without it."""
        return []

    @classmethod
    def prepare(cls, options: EngineOptions) -> None:
        """The import hook patched a selected class: this process will likely build graphs
        soon. Start what can run beside the user's own setup (model, data, optimizer), on
        another core, and never delay or fail the import that patched it."""
        return None

    def random_operators(self, recipe: Recipe) -> list[str] | None:
        """The forward graph's random operators, when the backend knows them without
        reading the graph (None: `verify` reads it); a graph that draws is not compared."""
        return None

    def found(self, found: Sequence[hazards.Hazard]) -> None:
        """Keep the hazards a trace found, each once, for the report."""
        known = set(self.hazards)
        self.hazards.extend(h for h in found if h not in known)

    def data_dependent(self, found: Sequence[hazards.Hazard]) -> DataDependentError:
        """The refusal of a call whose forward decides from tensor values (`found`: where),
        which a graph would freeze: the same words on every backend."""
        from ort_autopatch.engine.errors import DataDependentError

        places = "; ".join(h.describe() for h in found)
        return DataDependentError(
            self.module_class,
            f"forward decides from tensor values, which a graph would freeze ({places})",
            "It runs in PyTorch; compute such decisions outside the selected module, or "
            "exclude the class (ORT_AUTOPATCH_EXCLUDE) to silence this",
        )

    @abstractmethod
    def shape_policy(self) -> ShapePolicy:
        """How the engine keys this backend's graphs by input shape (`shape_policy.py`):
        `DynamicGraphs` (one graph with dynamic axes, static-shape graphs for the first and
        for hot shapes) or `GuardedSizes` (every graph carries the sizes it serves), made
        with `self.options.static_after`."""

    def refuse(self, call: FlatCall) -> None:  # noqa: B027  (optional: most accept every call)
        """Raise UnsupportedInputError for a training call this backend cannot run at all
        (before its key is computed: it is not remembered as a failure of a graph)."""

    @abstractmethod
    def build(self, miss: Miss, progress: Progress) -> tuple[Recipe, float]:
        """A recipe for the call that missed the cache, and the seconds its capture took."""

    @abstractmethod
    def instantiate(
        self,
        recipe: Recipe,
        miss: Miss,
        hooks: RunHooks,
        settings: SessionSettings,
        progress: Progress,
    ) -> Program:
        """Sessions for a recipe on `miss.device`; its runs tell `hooks` what they must."""

    @staticmethod
    @abstractmethod
    def payload_from(meta: dict[str, Any], graphs: dict[str, bytes]) -> Payload:
        """A stored payload read back; raises when it does not fit (the engine rebuilds)."""


def backend_class(name: str) -> type[Backend]:
    """The backend declared under `name` (imported on first use)."""
    module, _, attribute = BACKENDS[name].implementation.partition(":")
    found: type[Backend] = getattr(importlib.import_module(module), attribute)
    return found


def doctor(name: str, options: EngineOptions) -> list[tuple[str, str]]:
    """`--check`'s lines of the backend `name` of its own (`Backend.doctor`)."""
    return backend_class(name).doctor(options)


@functools.cache
def choose(name: str | None = None) -> type[Backend]:
    """The class of the backend `resolve(name)` picks. Decided once per process and name:
    reading package metadata costs milliseconds, and engines are made per instance."""
    chosen = resolve(name)
    if chosen not in _chosen:
        _chosen.append(chosen)
    return backend_class(chosen)


#: the backends engines of this process run on, in the order first chosen (for the report)
_chosen: list[str] = []


def chosen() -> list[str]:
    """The backends this process's engines run on (the report names what ran)."""
    return list(_chosen)


_said: set[tuple[str, str]] = set()


def _say_ignored(backend: str, options: EngineOptions, ignored: tuple[str, ...]) -> None:
    """Say once per process and option that a set option does not apply to this backend."""
    defaults = type(options)()
    for f in fields(options):
        if f.name not in ignored or getattr(options, f.name) == getattr(defaults, f.name):
            continue
        if (backend, f.name) not in _said:
            _said.add((backend, f.name))
            log.warning(
                "ort_autopatch: the %s option does not apply to the %s backend and is ignored",
                f.name,
                backend,
            )
