"""What the persistent cache keeps of a training build's recipe: its payload and the version
that keys it.

`OrtTrainingPayload` is the training build's part of a `Recipe` (the gradient graph with its
facts, ORT's optimised graph), written as JSON and bytes and read back by
`OrtTrainingPayload.from_stored`. `graph_version` digests the sources that decide the stored
graphs, read from files so that a cache hit imports neither the passes nor `onnx`.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ort_autopatch.engine.backends.ort_training import agent
from ort_autopatch.engine.recipe import Recipe


@dataclass
class OrtTrainingPayload:
    """The training build's part of a recipe."""

    gradient: agent.GradientGraph | None  # None: an inference recipe
    optimized: bytes | None = None  # ORT's optimised form of the graph that runs
    #: the graphs' torch-calling nodes as `stored.restore` takes them, by name; None when one
    #: cannot be stored (a custom Function's): then neither can the recipe
    nodes: dict[str, dict[str, Any]] | None = field(default_factory=dict)

    def restores_torch_nodes(self) -> bool:
        return self.nodes is not None

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
            "nodes": self.nodes or {},
            "gradient": None
            if g is None
            else {
                "num_forward_outputs": g.num_forward_outputs,
                "num_outputs": g.num_outputs,
                "non_differentiable": g.non_differentiable,
                "full_shape_grads": g.full_shape_grads,
                "grad_of": g.grad_of,
            },
        }

    @classmethod
    def from_stored(cls, meta: dict[str, Any], graphs: dict[str, bytes]) -> OrtTrainingPayload:
        """The payload `meta()` and `graphs()` wrote, its torch-calling nodes registered in
        this process (ValueError where one cannot be: the graph is built again)."""
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import nodes as torch_nodes

        nodes = {str(name): dict(node) for name, node in meta.get("nodes", {}).items()}
        for name, node in nodes.items():
            torch_nodes.restore(name, node)
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
        return cls(gradient, graphs.get("optimized"), nodes)


def payload_of(recipe: Recipe) -> OrtTrainingPayload:
    """A training build's recipe's payload (typed)."""
    payload = recipe.payload
    assert isinstance(payload, OrtTrainingPayload), f"a {recipe.backend} recipe"
    return payload


#: besides the declared passes (`passes.version`): the sources that decide what the exporter
#: writes (its call protocol, the extra symbolics, which operators become torch-calling nodes)
_EXPORT_SOURCES = (
    "export.py",
    "symbolics.py",
    "torch_in_graph/routing.py",
    "torch_in_graph/stored.py",
)


@functools.cache
def graph_version() -> str:
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
