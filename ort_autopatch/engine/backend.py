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
   (`miss.module`, `miss.call.tensors`, `miss.call.spec()`) through torch's autograd. Set
   `miss.per_shape` when the graph only fits the call's input shapes (the engine then keys
   every later graph of the module by shape), or, for a backend with size guards
   (`guarded`), trace `miss.dynamic` as symbols and say in `Recipe.size_guards` which sizes
   the graph serves; raise an `EngineError` subclass (with a cause and a remedy) when the
   call cannot run: the engine falls back to eager.
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

A new backend is one module beside `ort_training.py` and one line in `BACKENDS`. The same
seed, the same run: random operators draw from `rng`'s stream, never from torch's generator.
Which backend an engine uses is `choose(EngineOptions.backend)`'s answer ("auto": the first
available in `BACKENDS`); its recipes are stored under keys that name it.
"""

from __future__ import annotations

import functools
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from ort_autopatch.engine import hazards
    from ort_autopatch.engine.errors import ExecutionError
    from ort_autopatch.engine.recipe import EngineOptions, Miss, Payload, Recipe
    from ort_autopatch.engine.session import SessionSettings
    from ort_autopatch.engine.signature import FlatCall

#: name -> "module:class", in the order `choose(None)` tries them (the first available wins).
BACKENDS: dict[str, str] = {
    "ort-training": "ort_autopatch.engine.backends.ort_training.backend:OrtTrainingBackend",
    "ort": "ort_autopatch.engine.backends.ort.backend:OrtBackend",
}

#: what gets exported or traced: `forward(module, *args, **kwargs)`
Forward = Callable[..., Any]


class Progress(Protocol):
    """What a build is doing now; the engine's watchdog names it when a build is slow."""

    phase: str


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
    #: every graph serves only the input shapes it was traced for, from the first one on (so
    #: the first call's key, and its on-disk key, already name the shapes)
    per_shape: ClassVar[bool] = False
    #: every graph carries the input sizes it serves (`Recipe.size_guards`): the engine admits
    #: a call to the first graph whose guards hold, and asks for symbolic dimensions
    #: (`Miss.dynamic`) once a key has seen a second input shape
    guarded: ClassVar[bool] = False

    def __init__(self, module_class: str, options: EngineOptions, forward: Forward) -> None:
        self.module_class = module_class
        self.options = options
        self.forward = forward
        self.hazards: list[hazards.Hazard] = []  # trace hazards its captures found, for reports

    @staticmethod
    @abstractmethod
    def unavailable() -> str | None:
        """Why this backend cannot run in this interpreter (which package to install), or
        None. Cheap: reads package metadata, never imports onnxruntime."""

    @staticmethod
    @abstractmethod
    def graph_version() -> str:
        """What decides this backend's graphs besides the tool's, torch's and ONNX Runtime's
        versions (its passes, its sources, the exporter's packages): part of every persistent
        cache key. Cheap: a cache hit calls it before anything else is loaded."""

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
    module, _, attribute = BACKENDS[name].partition(":")
    found: type[Backend] = getattr(importlib.import_module(module), attribute)
    return found


@functools.cache
def choose(name: str | None = None) -> type[Backend]:
    """The backend named, or (None, "auto") the first declared one that is available here,
    else the first declared (whose build then says what is missing). Decided once per process
    and name: reading package metadata costs milliseconds, and engines are made per instance."""
    if name not in (None, "auto"):
        return backend_class(name)
    for candidate in BACKENDS:
        backend = backend_class(candidate)
        if backend.unavailable() is None:
            return backend
    return backend_class(next(iter(BACKENDS)))
