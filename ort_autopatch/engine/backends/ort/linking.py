"""A capture's graph inputs and outputs linked to each other and to the caller's tensors.

One job: from aot_autograd's analysis and the partitioned graphs, say what each value the
backward reads is (a forward output, a forward input, a tangent), which inputs forward writes
into and whether autograd sees it, and which feeds and outputs share memory with a value the
backward saves (so that autograd's version check sees an in-place change, as in eager). Apart
from the capture (`capture`), which traces, and from `aliasing`, which regenerates the outputs
that are views: this is the bookkeeping between the two graphs and the caller, and it refuses
(`refuse`) a graph whose inputs or outputs it cannot map instead of guessing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ort_autopatch.engine.errors import ExportError, UnsupportedModelError

if TYPE_CHECKING:
    from ort_autopatch.engine.backends.ort.capture import Captured

_aten = torch.ops.aten


def refuse(cls: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        cls,
        f"the call's autograd graph has {what}, which the plain backend does not map",
        "Run this class eagerly (the default fallback policy does) and report the model",
    )


def input_mutations(cls: str, joint: Any, input_mutations: dict[int, int]) -> list[int]:
    """Forward writes into the caller's tensors: each a data write (a metadata change, such
    as `t_()` or `resize_`, is refused); those autograd does not see (a write under
    no_grad) are returned, by forward output index."""
    infos = joint._aot_state.fw_metadata.input_info
    hidden = []
    for k, feed in input_mutations.items():
        info = infos[feed]
        if info.mutates_metadata or info.mutates_storage_metadata:
            raise refuse(cls, f"a write changing the shape or storage of input {feed}")
        if info.mutations_hidden_from_autograd or info.mutations_under_no_grad_or_inference_mode:
            hidden.append(k)
    return hidden


#: operators whose output is a view of their first input (eager saves the input's memory)
VIEWS = frozenset(
    {
        _aten.t.default,
        _aten.transpose.int,
        _aten.permute.default,
        _aten.view.default,
        _aten._unsafe_view.default,
        _aten.reshape.default,
        _aten.expand.default,
        _aten.unsqueeze.default,
        _aten.squeeze.dim,
        _aten.squeeze.dims,
        _aten.detach.default,
        _aten.alias.default,
        _aten.slice.Tensor,
        _aten.select.int,
    }
)


def link(
    captured: Captured,
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    tangents: dict[str, int],
    num_forward: int,
) -> None:
    """Name what the backward reads, by the partitioner's naming (a saved value keeps the
    name of the forward node that made it). Backward's outputs need no map: the partitioner
    gives it one per joint input, in order (None for an input without a gradient)."""
    forward_inputs = {n.name: k for k, n in enumerate(forward.graph.nodes) if n.op == "placeholder"}
    forward_outputs = {
        getattr(node, "name", None): k
        for k, node in enumerate(next(n for n in forward.graph.nodes if n.op == "output").args[0])
    }
    reads: list[tuple[str, int]] = []
    for node in backward.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in tangents:
            reads.append(("tangent", tangents[node.name]))
        elif node.name in forward_outputs and forward_outputs[node.name] >= num_forward:
            reads.append(("out", forward_outputs[node.name]))
        elif node.name in forward_inputs:
            reads.append(("feed", forward_inputs[node.name]))
        else:
            raise ExportError(
                "",
                f"the backward graph reads {node.name!r}, which forward does not provide",
                "Report the model",
            )
    captured.backward_inputs = reads
    producers = {n.name: n for n in forward.graph.nodes}
    outputs_in_order = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    user_nodes: dict[Any, int] = {}
    for n, k in enumerate(captured.slots):
        user_nodes.setdefault(outputs_in_order[k], n)
    viewed: set[int] = set()
    viewed_outputs: set[int] = set()
    for kind, k in reads:
        if kind != "out":
            continue
        node = outputs_in_order[k]
        while node is not None and node.op == "call_function" and node.target in VIEWS:
            if node in user_nodes:
                viewed_outputs.add(user_nodes[node])
            node = node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
        if node is not None and node in user_nodes:
            viewed_outputs.add(user_nodes[node])
        if node is not None and node.op == "placeholder" and node.name in producers:
            viewed.add(forward_inputs[node.name])
    captured.viewed_feeds = sorted(viewed - set(captured.input_mutations.values()))
    captured.viewed_outputs = sorted(viewed_outputs - set(captured.regenerated))
    outputs = next(n for n in backward.graph.nodes if n.op == "output").args[0]
    if len(outputs) != len(captured.feeds):
        raise ExportError(
            "",
            f"the backward graph has {len(outputs)} outputs for {len(captured.feeds)} inputs",
            "Report the model",
        )
