"""The backward graph run in stages, so that what forward saved for it is let go of as soon as
backward has read it for the last time.

ONNX Runtime holds every input of a run until the run ends. Eager autograd frees each saved
activation once the gradient that reads it is done: its backward's memory falls layer by layer
while the parameters' gradients pile up. One backward session held all of a call's saved
activations to its end, beside every gradient: BERT-base's backward reads 308 inputs (632
MB, about 200 MB of it saved activations), ResNet-50's at batch 2 about 160 MB of
activations, and their step peaks stood 440 and 250 MB above eager's. In stages, backward's
peak (torch 2.14, batch 2, glibc returning freed memory at once) went 1596 -> 1475 MB on
ResNet-50, 3231 -> 3096 on BERT-base and 3643 -> 3429 on GPT-2 small, steps unchanged.

`cut` splits the lowered backward graph into up to `MOST_STAGES` graphs along its nodes'
order (the exporter writes them in autograd's: the last layer's gradients first), ending the
stages where the inputs the call's Function hands over (`HANDED`: values forward made that
nothing else holds) have been read for the last time, in equal shares of their bytes; of 2
to `MOST_STAGES` stages it keeps the count whose values alive at once peak lowest
(`_Lifetimes`). A value one stage makes and a later one reads is an output of the first and
an input of the second; a Constant node is copied into every stage that reads it.
`StagedRunnable` runs the stages in order, one session each, and drops its reference to each
input after the last stage that reads it: the program hands those values over and keeps none
of its own (`program`), so their memory goes back to the heap for the rest of the backward.

A graph is left whole where staging would lower that peak by less than `LEAST_FREED` bytes
(small models; symbolic sizes, whose bytes are unknown), where a node has a subgraph (If,
Loop, Scan: a body reads outer values by name), and where a value that would cross stages
has no type in the graph (its stage's output could not be declared).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: a backward graph's meta: the names of its inputs the call's Function hands over (values
#: forward made that nothing else holds), which a stage can let go of
HANDED = "ort_autopatch_handed"

#: the most stages a backward is cut into: each costs a session run and a boundary ORT does
#: not fuse across
MOST_STAGES = 4
#: staging pays where it lowers the backward's peak by at least this many bytes...
LEAST_FREED = 16 << 20
#: ...and a stage more only where it lowers the peak by at least this many
LEAST_GAIN = 1 << 20


@dataclass
class Staging:
    """A graph cut into stages: what `StagedRunnable` runs, and the whole graph's output names
    in order (what it returns)."""

    stages: list[Stage]
    outputs: list[str]
    handed: list[str]  # the graph inputs handed over (`HANDED`)

    def graphs(self, role: str) -> dict[str, bytes]:
        return {f"{role}.stage{k}": stage.model for k, stage in enumerate(self.stages)}

    def meta(self) -> dict[str, Any]:
        return {
            "outputs": self.outputs,
            "handed": self.handed,
            "stages": [{"inputs": s.inputs, "outputs": s.outputs} for s in self.stages],
        }

    @classmethod
    def from_stored(
        cls, meta: dict[str, Any] | None, graphs: dict[str, bytes], role: str
    ) -> Staging | None:
        if meta is None:
            return None
        return cls(
            [
                Stage(graphs[f"{role}.stage{k}"], [str(n) for n in s["inputs"]], list(s["outputs"]))
                for k, s in enumerate(meta["stages"])
            ],
            [str(n) for n in meta["outputs"]],
            [str(n) for n in meta["handed"]],
        )


@dataclass
class Stage:
    """One stage's graph, the names it reads (graph inputs and earlier stages' values) and
    the names it makes for the graph's outputs and later stages."""

    model: bytes
    inputs: list[str]
    outputs: list[str]


def cut(model: bytes, handed: frozenset[str]) -> Staging | None:
    """`model` (a lowered backward graph) as stages, or None where it is better run whole
    (see the module's docstring). `handed`: the inputs its caller hands over; the others
    stay held by the caller (the module's tensors, the call's own), staged or not."""
    import onnx

    proto = onnx.load_from_string(model)
    graph = proto.graph
    nodes = list(graph.node)
    if any(a.type in (a.GRAPH, a.GRAPHS) for n in nodes for a in n.attribute):
        return None
    constant = [n.op_type == "Constant" and n.domain in ("", "ai.onnx") for n in nodes]
    names = [value.name for value in graph.input]
    handed = frozenset(handed & set(names))
    if not handed:
        return None
    lives = _Lifetimes(graph, nodes, handed)
    ends = lives.best_ends(constant)
    if not ends:
        return None
    stage_of = [bisect.bisect_left(ends, time) for time in lives.time]
    stages = _stages(proto, nodes, constant, stage_of, len(ends) + 1)
    if stages is None:
        return None
    return Staging(stages, [value.name for value in graph.output], sorted(handed))


class _Lifetimes:
    """Each value of a graph with its size and the times between which it lives, and the
    peak of their sum with the graph cut into stages.

    A node's time is its place in the graph's order, except for a node that reads only what
    is held anyway (the module's tensors, constants; a weight's transpose for a matmul's
    gradient): it floats to just before its first reader, as ORT runs it (its order follows
    what each output needs, not the file's), and it joins that reader's stage. Fixed at its
    place, all of GPT-2's 48 transposed weights (360 MB) were made in the first stage and
    held across the others, and its peak rose by 170 MB.

    Run whole, ORT frees a value after its last reader, and holds the graph's inputs to the
    run's end. Cut, a stage's inputs (the graph's, or values an earlier stage made) live to
    the end of the stage that reads them last: staging frees the handed-over inputs early,
    and holds a value that crosses stages longer. The other inputs live throughout: their
    caller holds them. ORT reuses buffers in a stage as it likes: the sum is a proxy for its
    memory, not a measure."""

    def __init__(self, graph: Any, nodes: list[Any], handed: frozenset[str]) -> None:
        import numpy

        count = len(nodes)
        kinds = {v.name: v.type for v in [*graph.input, *graph.value_info, *graph.output]}
        outputs = {v.name for v in graph.output}
        inputs = {v.name for v in graph.input}
        kept = (inputs - handed) | {t.name for t in graph.initializer}  # held anyway
        made_by: dict[str, int] = {}
        readers: list[list[int]] = [[] for _ in nodes]
        floating = [False] * count
        for k, node in enumerate(nodes):
            for name in node.input:
                if name in made_by:
                    readers[made_by[name]].append(k)
            floating[k] = not any(n in outputs for n in node.output) and all(
                not n or n in kept or (n in made_by and floating[made_by[n]]) for n in node.input
            )
            for name in node.output:
                if name:
                    made_by[name] = k
        time = list(range(count))
        for k in reversed(range(count)):
            if floating[k] and readers[k]:
                time[k] = min(time[j] for j in readers[k])
        self.time = time
        start: dict[str, int] = {name: 0 for name in inputs}
        last: dict[str, int] = {}
        for k, node in enumerate(nodes):
            for name in node.input:
                if name:
                    last[name] = max(last.get(name, 0), time[k])
            for name in node.output:
                if name:
                    start[name] = time[k]
        names = [n for n in start if n in kinds]
        self.count = count
        self.start = numpy.array([start[n] for n in names], dtype=numpy.int64)
        held = outputs | (inputs - handed)  # alive to the end
        self.last = numpy.array(
            [count if n in held else last.get(n, start[n]) for n in names], dtype=numpy.int64
        )
        self.size = numpy.array([_bytes(kinds[n]) for n in names], dtype=numpy.float64)
        self.input = numpy.array([n in inputs for n in names], dtype=bool)
        # where staging can free, and how much: after the last reader of an input handed over
        self.freed = sorted((last[n], _bytes(kinds[n])) for n in handed if n in last)

    def peak(self, ends: list[int]) -> float:
        """The most bytes alive at once with stages ending after the nodes `ends` (sorted)."""
        import numpy

        bounds = numpy.array([*ends, self.count - 1], dtype=numpy.int64)
        reader = numpy.minimum(self.last, self.count - 1)
        last_stage = numpy.searchsorted(bounds, reader)
        held = self.input | (numpy.searchsorted(bounds, self.start) != last_stage)
        stop = numpy.where(held & (self.last < self.count), bounds[last_stage], self.last)
        change = numpy.zeros(self.count + 2)
        numpy.add.at(change, self.start, self.size)
        numpy.add.at(change, stop + 1, -self.size)
        return float(numpy.cumsum(change)[: self.count + 1].max())

    def best_ends(self, constant: list[bool]) -> list[int]:
        """The stage ends that lower the peak most, among those splitting the handed-over
        inputs' bytes into 2 to `MOST_STAGES` equal shares (by where each is read last;
        fewer stages where two give the same peak); none where the best lowers it by less
        than `LEAST_FREED`. (Ends chosen one at a time stopped at one on ResNet-50: a second
        alone lowered no peak, while three together lowered it twice as far as one.)"""
        # a stage of Constant nodes alone (copied where read) would run nothing
        final = max((k for k, c in enumerate(constant) if not c), default=-1)
        freed = [(time, size) for time, size in self.freed if time < final]
        total = sum(size for _, size in freed)
        whole = self.peak([])
        best, chosen = whole, []
        for count in range(2, MOST_STAGES + 1):
            ends: list[int] = []
            reached = 0
            for time, size in freed:
                reached += size
                if reached >= total * (len(ends) + 1) / count and (not ends or time > ends[-1]):
                    ends.append(time)
                    if len(ends) == count - 1:
                        break
            peak = self.peak(ends)
            if peak < best - LEAST_GAIN:
                best, chosen = peak, ends
        return chosen if whole - best >= LEAST_FREED else []


def _stages(
    proto: Any, nodes: list[Any], constant: list[bool], stage_of: list[int], count: int
) -> list[Stage] | None:
    """The stages of `proto` with each non-Constant node in `stage_of`'s stage; None where a
    value crossing stages has no declared type."""
    from onnx import helper

    graph = proto.graph
    outputs = {value.name for value in graph.output}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    made_by: dict[str, int] = {}  # a value -> the node making it
    for k, node in enumerate(nodes):
        for name in node.output:
            made_by[name] = k
    if not outputs <= made_by.keys():  # an output no node makes (an initializer)
        return None
    # each Constant node goes to every stage reading it (and the last, for a graph output)
    members: list[set[int]] = [set() for _ in range(count)]
    for k in range(len(nodes)):
        if not constant[k]:
            members[stage_of[k]].add(k)
    for k, node in enumerate(nodes):
        if constant[k] and any(name in outputs for name in node.output):
            members[count - 1].add(k)
    for s in range(count):
        for k in list(members[s]):
            for name in nodes[k].input:
                j = made_by.get(name)
                if j is not None and constant[j]:
                    members[s].add(j)
    types = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
    orders = [sorted(m) for m in members]
    made = [{name for k in order for name in nodes[k].output if name} for order in orders]
    reads = [[name for k in order for name in nodes[k].input if name] for order in orders]
    inputs = [
        list(dict.fromkeys(n for n in read if n not in mine and n not in initializers))
        for read, mine in zip(reads, made, strict=True)
    ]
    stages: list[Stage] = []
    for s, order in enumerate(orders):
        later = {name for taken in inputs[s + 1 :] for name in taken}
        # a graph output of a Constant copied into several stages: the last one's
        kept = [
            name
            for k in order
            for name in nodes[k].output
            if name in later or (name in outputs and (not constant[k] or s == count - 1))
        ]
        if any(name not in types for name in [*inputs[s], *kept]):
            return None
        body = helper.make_graph(
            [nodes[k] for k in order],
            f"{graph.name}_stage{s}",
            [types[name] for name in inputs[s]],
            [types[name] for name in kept],
            initializer=[initializers[n] for n in dict.fromkeys(reads[s]) if n in initializers],
            value_info=[v for v in graph.value_info if v.name in made[s] and v.name not in kept],
        )
        model = helper.make_model(
            body,
            opset_imports=list(proto.opset_import),
            ir_version=proto.ir_version,
            functions=list(proto.functions),
            producer_name=proto.producer_name,
        )
        stages.append(Stage(model.SerializeToString(), inputs[s], kept))
    return stages


#: bytes of each ONNX element type of a fixed size (TensorProto's numbering)
_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}


def _bytes(kind: Any) -> int:
    """A graph input's size in bytes, 0 where its shape or type is not fixed."""
    tensor = kind.tensor_type
    size = _ITEM_BYTES.get(tensor.elem_type, 0)
    for dim in tensor.shape.dim:
        if not dim.HasField("dim_value"):
            return 0
        size *= dim.dim_value
    return size


class StagedRunnable:
    """The stages run as one session runs the whole graph (`session.RunnableSession`'s
    `feed_names` and `run`), each input dropped after the last stage reading it."""

    def __init__(self, staging: Staging, runs: Sequence[Any], feed_names: list[str]) -> None:
        self.feed_names = feed_names
        stages = staging.stages
        self._stages = list(zip(stages, runs, strict=True))
        self._fetches = staging.outputs
        wanted = set(staging.outputs)
        # per stage: the names no later stage reads, and no graph output is
        later: set[str] = set()
        self._drop: list[list[str]] = []
        for stage in reversed(stages):
            self._drop.append([n for n in stage.inputs if n not in later and n not in wanted])
            later |= set(stage.inputs)
        self._drop.reverse()

    def run(self, feeds: list[torch.Tensor], kept: Any = None) -> list[torch.Tensor]:
        """The graph's outputs. `feeds` is emptied: what the caller handed over is held here
        alone, until the last stage reading it has run."""
        values = dict(zip(self.feed_names, feeds, strict=True))
        feeds.clear()
        for (stage, run), drop in zip(self._stages, self._drop, strict=True):
            got = run.run([values[name] for name in run.feed_names])
            values.update(zip(stage.outputs, got, strict=True))
            for name in drop:
                del values[name]
        return [values[name] for name in self._fetches]
