"""Operators with no ONNX form, called in torch between ONNX Runtime segments of one graph.

The training build keeps such an operator inside its ORT graph as a `com.microsoft::PythonOp`
node; plain onnxruntime has no node that calls Python (nor C API headers to compile one
against; onnxruntime-extensions' Python operators would be another dependency, copying
through numpy on CPU alone), so this backend cuts the graph instead (`cut`; `lowered` lowers
the stretches): every stretch of operators the exporter translates becomes an ONNX graph of
its own and an InferenceSession, and each node it
cannot translate (a "torch node", named in the report's `torch_nodes` as the training build's
are) runs in torch between them, on the tensors the segments hand over through DLPack. A graph
with no such node is never cut: the cost (one session boundary per torch node) falls on the
graphs that would otherwise have been refused and run entirely in PyTorch.

What a cut must not change is refused (`ExportError`, the refusal a graph with such an
operator got before): a torch node that computes a size rather than a tensor (a symbolic
trace's `sym_stride`: the trace is then made for the call's shapes), draws random numbers or
writes into its arguments,
and a segment drawing from ORT's generator (dropout), whose seeding is per session run and
would not follow eager's stream across several sessions.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine.errors import ExportError

REMEDY = "Run this class eagerly (the default fallback policy does) and report the model"


def label(target: Any) -> str:
    """A torch node's name in the report, as the training build names its own ("aten::cummax")."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target._schema.name)
    return getattr(target, "__name__", str(target))


@dataclass
class Segment:
    """One ONNX graph of a cut graph, and where each of its submodule's outputs comes from
    (`program._Session.outputs`)."""

    name: str  # the top-level module's attribute the segment runs as
    model: bytes
    inputs: list[str]  # the submodule's placeholders, in order: what its caller passes
    outputs: list[tuple[str, int]]
    single: bool  # the submodule returned one value, not a tuple
    random_operators: list[str]


@dataclass
class Split:
    """A graph cut at its torch nodes: a top-level FX graph calling the segments (attributes
    named by `Segment.name`, made sessions by `program`) and the torch nodes' submodules in
    the original order."""

    graph: torch.fx.Graph
    modules: dict[str, torch.nn.Module]  # the torch nodes' submodules, by attribute
    segments: list[Segment]
    inputs: list[str]  # the graph's placeholders, in order (the phase's feed names)
    torch_nodes: Counter[str] = field(default_factory=Counter)

    def graphs(self, role: str) -> dict[str, bytes]:
        return {f"{role}.{k}": s.model for k, s in enumerate(self.segments)}


def _holds_tensor(kind: Any) -> bool:
    """Whether a schema's return type is a tensor, or a list or optional of tensors."""
    if isinstance(kind, torch.TensorType):
        return True
    if isinstance(kind, torch.ListType | torch.OptionalType):
        return _holds_tensor(kind.getElementType())
    return False


def _check(node: torch.fx.Node, cls: str, what: str) -> None:
    """A torch node whose call could differ from eager's inside a captured graph: refused."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):  # a higher-order operator, a callable
        raise ExportError(
            cls,
            f"the {what} graph calls {label(target)}, which has no ONNX form and is no ATen "
            "or library operator a torch node between ONNX Runtime sessions can call",
            REMEDY,
        )
    if not any(_holds_tensor(r.type) for r in target._schema.returns):
        # a size query of a symbolic trace (`aten.sym_stride`: T5's attention with symbolic
        # sizes) or another integer: its value is a size of the graph, computed between the
        # segments' ONNX sizes, which no segment hands over
        raise ExportError(
            cls,
            f"the {what} graph's {label(target)} has no ONNX form and computes a number (a "
            "size), not a tensor, which a torch node between ONNX Runtime sessions cannot "
            "hand over",
            REMEDY,
        )
    if torch.Tag.nondeterministic_seeded in target.tags:
        raise ExportError(
            cls,
            f"the {what} graph's {label(target)} has no ONNX form and draws random numbers, "
            "which a torch node between ONNX Runtime sessions would draw out of eager's order",
            REMEDY,
        )
    if target._schema.is_mutable:
        raise ExportError(
            cls,
            f"the {what} graph's {label(target)} has no ONNX form and writes into its "
            "arguments, which a torch node between ONNX Runtime sessions does not carry",
            REMEDY,
        )


def cut(
    gm: torch.fx.GraphModule, missing: set[Any], cls: str, what: str
) -> tuple[torch.fx.GraphModule, dict[str, torch.nn.Module], Counter[str]]:
    """`gm` cut before and after each node whose target is in `missing` (a torch node, each
    in a submodule of its own): the top-level module, whose other submodules are the stretches
    to lower to ONNX (`lowered`), the torch nodes' submodules by attribute, and their count
    by operator."""
    from torch.fx.passes.split_module import split_module

    part: dict[torch.fx.Node, int] = {}
    current, in_torch = 0, False
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0] in part:
            part[node] = part[node.args[0]]  # an item stays with the node that made it
            continue
        torch_node = node.target in missing
        if torch_node:
            _check(node, cls, what)
            counts[label(node.target)] += 1
        if part and (torch_node or in_torch):
            current += 1
        part[node] = current
        in_torch = torch_node
    torch_parts = {f"submod_{part[n]}" for n in part if n.target in missing}
    top = split_module(gm, gm, lambda node: part[node], keep_original_order=True)
    modules = {name: getattr(top, name) for name in sorted(torch_parts)}
    return top, modules, counts
