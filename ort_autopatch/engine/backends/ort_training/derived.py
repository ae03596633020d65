"""The derived cache: what a session over a stored graph reads from the graph's ONNX, kept
beside the graph cache's entries so that a later process parses no ONNX for it.

Its entries are the agent's facts of a gradient graph (`Derived.facts`) and the CPU swap of
gradient nodes (`swap.GradientSwap`), each keyed by a digest of the graph's bytes and of the
code that derives it.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from ort_autopatch.engine import persist
from ort_autopatch.engine.backends.ort_training import agent
from ort_autopatch.engine.store import DERIVED, StoredEntry, digest, digest_bytes


@functools.cache
def _derived_version() -> str:
    """A digest of the code that derives from a stored graph what `Derived` keeps."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for name in ("agent.py", "graph.py", "torch_in_graph/gradients.py", "torch_in_graph/nodes.py"):
        digest.update((package / name).read_bytes())
    return digest.hexdigest()[:16]


class Derived:
    """What a session over a stored graph needs that is read from the graph's ONNX (its
    agent's facts, the CPU swap of gradient nodes), kept in the graph cache (`--cache-dir`)
    beside the entries, keyed by a digest of the graph's bytes: a process that loads a stored
    graph then parses no ONNX and never imports `onnx`. Only what names no process's
    callables is kept (PythonOp nodes do)."""

    FOLDER = DERIVED

    def __init__(self, cache_dir: Path | str | None) -> None:
        self._store = None if cache_dir is None else persist.store_for(Path(cache_dir))

    def _key(self, parts: list[Any]) -> str:
        from ort_autopatch.versions import __version__

        return digest([__version__, _derived_version(), *parts])

    def load(self, parts: list[Any]) -> StoredEntry | None:
        if self._store is None:
            return None
        return self._store.load(self.FOLDER, self._key(parts))

    def save(self, parts: list[Any], meta: dict[str, Any], graphs: dict[str, bytes]) -> None:
        if self._store is not None:
            self._store.save(self.FOLDER, self._key(parts), meta, graphs, [])

    def facts(self, gradient: agent.GradientGraph) -> agent.GraphFacts:
        """The agent's facts of a gradient graph (`agent.graph_facts`)."""
        if self._store is None:
            return agent.graph_facts(gradient.model, gradient.num_outputs)
        parts = ["facts", digest_bytes(gradient.model), gradient.num_outputs]
        stored = self.load(parts)
        if stored is not None:
            try:
                return agent.GraphFacts.from_meta(stored.meta)
            except (KeyError, TypeError, ValueError):
                pass
        facts = agent.graph_facts(gradient.model, gradient.num_outputs)
        if facts.storable:  # else its labels name this process's callables
            self.save(parts, facts.meta(), {})
        return facts
