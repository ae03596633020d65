"""The engine's data: its options, a built graph as plain data (`Recipe`, with its backend's
`Payload`), what a build cost (`BuildRecord`) and what a build is asked for (`Miss`).

Kept apart from the code that runs and builds graphs so that the persistent cache
(`persist.py`) and the backends can name these types without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine import calls, hazards
from ort_autopatch.engine.callkey import Shapes
from ort_autopatch.engine.signature import FlatCall
from ort_autopatch.engine.sizes import Dims, SizeGuards
from ort_autopatch.engine.state import ModuleState


@dataclass(frozen=True)
class EngineOptions:
    """Plain settings; the engine never reads configuration files or the environment."""

    backend: str = "auto"  # "ort", "ort-training", or "auto": whichever is installed
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
    # gradient nodes may call torch through the compiled ATen executor
    # (torch_in_graph/aten_executor.py)
    compile_executor: bool = True
    # graphs serving one input shape allocate from the shared CPU arena (session.shared_arena)
    memory_arena: bool = True
    # the most one build may cost (budget.py; 0: no limit): seconds, and traced graph nodes
    max_build_seconds: int = 300
    max_graph_nodes: int = 10000


@dataclass
class BuildRecord:
    """What one build cost and why it happened, for reports."""

    reason: str
    export_seconds: float
    build_seconds: float
    has_backward: bool  # a training graph (not the train/eval flag)
    from_disk: bool = False
    # operators running as torch-calling nodes in the graph built ("aten::cummax": 2)
    torch_nodes: dict[str, int] = field(default_factory=dict)
    per_shape: bool = False  # keyed by its input shapes (the model specialises on sizes)
    hot_shape: bool = False  # a static-shape graph for an input shape that kept coming back
    dynamic: bool = False  # traced with symbolic sizes: serves every size its guards admit
    aside: bool = False  # built by a helper process while its calls ran in PyTorch (aside.py)


class Payload(Protocol):
    """A backend's own part of a recipe (`backends/`), as the persistent cache stores it."""

    def graphs(self) -> dict[str, bytes]:
        """ONNX graphs by role ("gradient", "backward", ...), stored as files."""
        ...

    def meta(self) -> dict[str, Any]:
        """Everything else, as JSON."""
        ...

    def restores_torch_nodes(self) -> bool:
        """Whether a process loading the recipe can make its torch-calling nodes again (a
        recipe with torch nodes that cannot is never stored)."""
        ...


@dataclass
class Recipe:
    """A graph and how to feed and read it, as plain data (what the persistent cache stores)."""

    backend: str  # the name of the backend that built it (`backends.BACKENDS`)
    has_backward: bool  # a training graph: forward and backward (not the train/eval flag)
    forward_model: bytes  # the exported forward graph after the passes
    payload: Payload  # what only its backend reads
    # graph input name -> ("input", flat tensor index) or ("state", qualified tensor name)
    feed_sources: dict[str, tuple[str, Any]]
    num_user_outputs: int
    output_spec: calls.OutputSpec
    batch_norms: list[tuple[str, int, int]]  # module name, mean output, variance output
    seeds_dropout: bool
    #: the forward graph draws from random operators ORT seeds once per session
    #: (`random_ops.per_session`): no run can repeat another's draws
    redraws: bool = False
    torch_nodes: dict[str, int] = field(default_factory=dict)  # label -> nodes calling torch
    checks: list[hazards.Check] = field(default_factory=list)  # the last user outputs
    traced_shapes: tuple[tuple[int, ...], ...] | None = None  # the example's input shapes
    # the sizes the graph serves, for a backend whose graphs carry guards (`GuardedSizes`)
    size_guards: SizeGuards | None = None


@dataclass(frozen=True)
class Miss:
    """One build request: the call that missed the cache, everything its graph depends on,
    and the shapes the engine's shape policy asks the graph to serve. A build tells what it
    learned (the model specialises on sizes) through its progress, never by changing this."""

    module: torch.nn.Module
    state: ModuleState
    call: FlatCall
    has_backward: bool  # the graph has a backward graph (a training call)
    device: torch.device
    hot: Shapes | None  # the input shapes that earned a static-shape graph of their own
    #: the input shapes the graph is built and keyed for (-1 for a dimension traced as a
    #: symbol), or None for a graph of every size (dynamic axes)
    shapes: Shapes | None
    #: every graph of this module serves one input shape (the model specialises on sizes)
    per_shape: bool = False
    autocast: amp.State = None  # the call's autocast state, which the export runs under
    #: the dimensions to trace as symbols (a backend whose graphs carry size guards), or None
    dynamic: Dims | None = None
    #: the call keeps nothing of its forward for backward (`Program.run`'s `recompute`)
    recompute: bool = False

    def one_shape(self) -> bool:
        """Whether the graph serves one input shape (it may allocate from a shared arena)."""
        return self.shapes is not None and self.dynamic is None
