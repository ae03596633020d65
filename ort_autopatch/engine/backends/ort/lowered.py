"""The plain backend's payload: both graphs of a capture as ONNX, and the maps between them
(`Lowered`, which the persistent cache stores), made from a capture (`lower`; the part that
needs the exporter, `lower_graphs`, may run in another process, `offload`).

The cold path: nothing here runs on a call. `program` makes sessions of a `Lowered`.

`_outputs_for_onnx` rewrites a graph's outputs, yet it is no pass over the captured graph
(`passes`): it is the first step of the translation, which may run in the lowering child
(`offload`), and it makes the graph fit ONNX's outputs (no None, no input, none twice), keeping
the map from the graph's outputs to the ONNX ones that the `Captured`'s indices need.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine import rng
from ort_autopatch.engine.backends.ort import lowering, stages, torch_nodes
from ort_autopatch.engine.backends.ort.aliasing import Replay
from ort_autopatch.engine.backends.ort.capture import Captured, Feed
from ort_autopatch.engine.backends.ort.stages import Staging
from ort_autopatch.engine.backends.ort.torch_nodes import Segment, Split
from ort_autopatch.engine.errors import ExportError


def _outputs_for_onnx(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """Rewrite the graph's outputs to what ONNX can carry (no None, no input, none twice)
    and say where each original output comes from."""
    inputs = {n: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    kept: list[Any] = []
    plan: list[tuple[str, int]] = []
    for node in output.args[0]:
        if node is None:
            plan.append(("none", -1))
        elif node in inputs:
            plan.append(("in", inputs[node]))
        else:
            if node not in kept:
                kept.append(node)
            plan.append(("onnx", kept.index(node)))
    output.args = (tuple(kept),)
    gm.recompile()
    return plan


@dataclass
class GraphFacts:
    """What a session of one ONNX graph needs besides the graph."""

    inputs: list[str]  # the graph's input names, in order
    draws: bool  # a run reads ORT's generator (`rng.draws_per_run`)
    #: output index -> the shape its value is viewed as (`lowering.VIEWED`)
    viewed: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: output index -> the output indices of the rows and the values torch adds into it
    #: (`lowering.ADDED`); those outputs come last, and the program never sees them
    added: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: bytes) -> GraphFacts:
        import onnx

        proto = onnx.load_from_string(model)
        meta = {p.key: json.loads(p.value) for p in proto.metadata_props}
        outputs = {value.name: k for k, value in enumerate(proto.graph.output)}
        viewed = {
            outputs[name]: tuple(shape) for name, shape in meta.get(lowering.VIEWED, {}).items()
        }
        added = {
            outputs[name]: (outputs[rows], outputs[values])
            for name, (rows, values) in meta.get(lowering.ADDED, {}).items()
        }
        inputs = [value.name for value in proto.graph.input]
        return cls(inputs, rng.draws_per_run(proto), viewed, added)

    def meta(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "draws": self.draws,
            "viewed": [[k, list(shape)] for k, shape in self.viewed.items()],
            "added": [[k, *parts] for k, parts in self.added.items()],
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> GraphFacts:
        viewed = {int(k): tuple(int(d) for d in shape) for k, shape in meta.get("viewed", [])}
        added = {int(k): (int(r), int(v)) for k, r, v in meta.get("added", [])}
        return cls([str(n) for n in meta["inputs"]], bool(meta["draws"]), viewed, added)


@dataclass
class Lowered:
    """Both graphs of a capture as ONNX, and the maps between them: plain data (the
    backend's payload, which the persistent cache stores)."""

    forward: bytes
    backward: bytes | None
    feeds: list[Feed]  # per forward graph input, in order
    user_outputs: list[int]  # forward output index of each user output
    mutations: dict[int, int]  # forward output index -> feed index of the buffer it updates
    backward_inputs: list[tuple[str, int]]  # see `Captured.backward_inputs`
    forward_outputs: list[tuple[str, int]]  # see `_Session.outputs`
    backward_outputs: list[tuple[str, int]]
    input_mutations: dict[int, int]  # see `Captured.input_mutations`
    hidden_mutations: list[int]  # see `Captured.hidden_mutations`
    bases: list[int]  # see `Captured.bases`
    regenerated: dict[int, Replay]  # see `Captured.regenerated`
    viewed_feeds: list[int]  # see `Captured.viewed_feeds`
    viewed_outputs: list[int]  # see `Captured.viewed_outputs`
    #: what sessions need to know of each graph ("forward", "backward"), read when it was
    #: lowered, so that sessions for a stored graph never parse it (nor import onnx)
    facts: dict[str, GraphFacts]
    #: forward's random operators, read when it was lowered (None: a stored graph's, unread)
    random_operators: list[str] | None = None
    #: the graphs ("forward", "backward") cut at operators ONNX cannot express (`torch_nodes`):
    #: their bytes above are empty, their segments are here. Never stored (`torch_nodes`)
    splits: dict[str, Split] = field(default_factory=dict)
    #: the backward as stages (`stages`), which let go of saved values as they go
    staging: Staging | None = None

    @property
    def torch_nodes(self) -> dict[str, int]:
        """Nodes run in torch between ORT segments, by operator (the report's `torch_nodes`)."""
        counts: dict[str, int] = {}
        for cut in self.splits.values():
            for name, count in cut.torch_nodes.items():
                counts[name] = counts.get(name, 0) + count
        return counts

    @functools.cached_property
    def slots(self) -> list[int]:
        """See `Captured.slots` (read by every call: made once)."""
        return [*self.user_outputs, *self.bases, *self.input_mutations]

    def graphs(self) -> dict[str, bytes]:
        found = {"forward": self.forward}
        if self.backward is not None:
            found["backward"] = self.backward
        for role, cut in self.splits.items():  # a cut graph: its segments
            del found[role]
            found.update(cut.graphs(role))
        if self.staging is not None:  # the backward as it runs, beside the whole
            found.update(self.staging.graphs("backward"))
        return found

    def meta(self) -> dict[str, Any]:
        return {
            "feeds": [[f.kind, f.where] for f in self.feeds],
            "user_outputs": self.user_outputs,
            "mutations": [[k, v] for k, v in self.mutations.items()],
            "backward_inputs": [list(x) for x in self.backward_inputs],
            "forward_outputs": [list(x) for x in self.forward_outputs],
            "backward_outputs": [list(x) for x in self.backward_outputs],
            "input_mutations": [[k, v] for k, v in self.input_mutations.items()],
            "hidden_mutations": self.hidden_mutations,
            "bases": self.bases,
            "regenerated": [[k, v.as_data()] for k, v in self.regenerated.items()],
            "viewed_feeds": self.viewed_feeds,
            "viewed_outputs": self.viewed_outputs,
            "facts": {role: f.meta() for role, f in self.facts.items()},
            "staging": None if self.staging is None else self.staging.meta(),
        }

    @classmethod
    def from_stored(cls, meta: dict[str, Any], graphs: dict[str, bytes]) -> Lowered:
        def pairs(key: str) -> list[tuple[str, int]]:
            return [(str(a), int(b)) for a, b in meta[key]]

        return cls(
            forward=graphs["forward"],
            backward=graphs.get("backward"),
            feeds=[Feed(str(k), w) for k, w in meta["feeds"]],
            user_outputs=[int(k) for k in meta["user_outputs"]],
            mutations={int(k): int(v) for k, v in meta["mutations"]},
            backward_inputs=pairs("backward_inputs"),
            forward_outputs=pairs("forward_outputs"),
            backward_outputs=pairs("backward_outputs"),
            input_mutations={int(k): int(v) for k, v in meta["input_mutations"]},
            hidden_mutations=[int(k) for k in meta["hidden_mutations"]],
            bases=[int(k) for k in meta["bases"]],
            regenerated={int(k): Replay.from_data(v) for k, v in meta["regenerated"]},
            viewed_feeds=[int(k) for k in meta["viewed_feeds"]],
            viewed_outputs=[int(k) for k in meta["viewed_outputs"]],
            facts={
                str(role): GraphFacts.from_meta(f)
                for role, f in meta["facts"].items()
                if role in graphs
            },
            staging=Staging.from_stored(meta.get("staging"), graphs, "backward"),
        )


@dataclass
class Graphs:
    """Both graphs of a capture as ONNX, with what sessions need of them: the part of
    lowering that needs the exporter (and can run in another process, `offload`)."""

    forward: bytes
    backward: bytes | None
    forward_outputs: list[tuple[str, int]]  # see `_Session.outputs`
    backward_outputs: list[tuple[str, int]]
    facts: dict[str, GraphFacts]
    random_operators: list[str]  # forward's (`verify.random_ops`)
    splits: dict[str, Split] = field(default_factory=dict)  # see `Lowered.splits`
    staging: Staging | None = None  # see `Lowered.staging`

    @classmethod
    def of(cls, parts: list[LoweredGraph]) -> Graphs:
        """The graphs lowered one by one (`lower_graph`), forward first."""
        forward, *rest = parts
        backward = rest[0] if rest else None
        assert forward.role == "forward" and (backward is None or backward.role == "backward")
        return cls(
            forward=forward.model,
            backward=None if backward is None else backward.model,
            forward_outputs=forward.outputs,
            backward_outputs=[] if backward is None else backward.outputs,
            facts={part.role: part.facts for part in parts},
            random_operators=forward.random_operators,
            splits={part.role: part.split for part in parts if part.split is not None},
            staging=None if backward is None else backward.staging,
        )


@dataclass
class LoweredGraph:
    """One graph of a capture as ONNX (or cut at its torch nodes: `split`), with what
    `Graphs` keeps of it: lowered alone (in the lowering child, one per request)."""

    role: str  # "forward" or "backward"
    model: bytes  # empty when cut
    outputs: list[tuple[str, int]]  # see `_Session.outputs`
    facts: GraphFacts
    random_operators: list[str]  # forward's (`verify.random_ops`); a backward's are not read
    split: Split | None = None
    staging: Staging | None = None  # a backward's stages (`stages.cut`)


def lower_graph(
    gm: torch.fx.GraphModule, cls: str, role: str, promoted: bool = False, cut: bool = True
) -> LoweredGraph:
    """One graph to ONNX (its outputs rewritten to what ONNX can carry); `promoted`: its
    types were promoted already (`lowering.promote_types`). `cut`: a graph with operators
    ONNX cannot express is cut at them (`torch_nodes`), else refused."""
    import onnx

    from ort_autopatch.engine import verify

    plan = _outputs_for_onnx(gm)
    missing = lowering.missing_targets(gm) if cut else set()
    if missing:  # cut at them, each run in torch (`torch_nodes`)
        if not (promoted or gm.meta.get(lowering.PROMOTED)):
            lowering.promote_types(gm)  # whole: a segment's inputs have no producer
        split = _cut(gm, missing, cls, role)
        random = sorted({op for s in split.segments for op in s.random_operators})
        facts = GraphFacts(split.inputs, False)
        return LoweredGraph(role, b"", plan, facts, random if role == "forward" else [], split)
    model = lowering.to_onnx(gm, cls, role, promoted, finished_in_torch=True)
    random = verify.random_ops(onnx.load_from_string(model)) if role == "forward" else []
    staging = None
    if role == "backward":  # run in stages where that lowers its peak (`stages`)
        staging = stages.cut(model, gm.meta.get(stages.HANDED, frozenset()))
    return LoweredGraph(role, model, plan, GraphFacts.of(model), random, staging=staging)


def lower_graphs(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule | None,
    cls: str,
    promoted: bool = False,
    cut: bool = True,
) -> Graphs:
    """Both graphs to ONNX (`lower_graph`)."""
    parts = [lower_graph(forward, cls, "forward", promoted, cut)]
    if backward is not None:
        parts.append(lower_graph(backward, cls, "backward", promoted, cut))
    return Graphs.of(parts)


def _cut(gm: torch.fx.GraphModule, missing: set[Any], cls: str, what: str) -> Split:
    """`gm` (promoted, its outputs as ONNX carries them) cut at its torch nodes
    (`torch_nodes.cut`), every other stretch lowered to ONNX; refused when a stretch draws
    from ORT's generator (seeded per session run, which would draw out of eager's order)."""
    import onnx

    from ort_autopatch.engine import verify

    top, modules, counts = torch_nodes.cut(gm, missing, cls, what)
    segments: list[Segment] = []
    for node in top.graph.nodes:
        if node.op != "call_module" or node.target in modules:
            continue
        sub = getattr(top, str(node.target))
        output = next(n for n in sub.graph.nodes if n.op == "output")
        single = not isinstance(output.args[0], tuple | list)
        if single:
            output.args = ((output.args[0],),)
            sub.recompile()
        outputs = _outputs_for_onnx(sub)
        held = [n.name for n in sub.graph.nodes if n.op == "placeholder"]
        # promoted: the caller promoted the whole graph (`lowering.promote_types`)
        model = lowering.to_onnx(sub, cls, f"{what} (segment {len(segments)})", True)
        facts = GraphFacts.of(model)
        if facts.draws:
            raise ExportError(
                cls,
                f"the {what} graph has operators ONNX cannot express "
                f"({', '.join(sorted(counts))}) beside random ones ONNX Runtime seeds per "
                "session run, which cutting the graph would draw out of eager's order",
                torch_nodes.REMEDY,
            )
        proto = onnx.load_from_string(model)
        segments.append(
            Segment(str(node.target), model, held, outputs, single, verify.random_ops(proto))
        )
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return Split(top.graph, modules, segments, inputs, counts)


def lower(captured: Captured, cls: str, graphs: Graphs | None = None) -> Lowered:
    """Both graphs of a capture to ONNX (or `graphs`, lowered from it elsewhere), and the
    maps between them."""
    if graphs is None:
        graphs = lower_graphs(captured.forward, captured.backward, cls)
    position = {feed: k for k, feed in enumerate(captured.feeds)}
    return Lowered(
        forward=graphs.forward,
        backward=graphs.backward,
        feeds=captured.feeds,
        user_outputs=captured.user_outputs,
        mutations={k: position[Feed("buffer", name)] for k, name in captured.mutations.items()},
        backward_inputs=captured.backward_inputs,
        forward_outputs=graphs.forward_outputs,
        backward_outputs=graphs.backward_outputs,
        input_mutations=captured.input_mutations,
        hidden_mutations=captured.hidden_mutations,
        bases=captured.bases,
        regenerated=captured.regenerated,
        viewed_feeds=captured.viewed_feeds,
        viewed_outputs=captured.viewed_outputs,
        facts=graphs.facts,
        random_operators=graphs.random_operators,
        splits=graphs.splits,
        staging=graphs.staging,
    )
