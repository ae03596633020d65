"""The passes over a capture's FX graphs, declared once, in the order they run.

One job: say which passes run on the graphs aot_autograd made of a call, in which order and
when each applies. `JOINT` runs on the joint forward + backward graph before the partitioner
splits it; `PARTITIONED` on the forward and backward graphs it made, once their inputs and
outputs are read into a `Captured`. Each entry names a function of the module that holds
it (the rewrites are `fx_passes`, each tested on its own graphs) and says when it applies;
`capture` runs each stage through `engine.passes.apply` (the entry type, `Pass`, is the
training build's too), and nothing else in this package rewrites a
captured graph. (`lowered` makes a graph's outputs what ONNX can carry, and `lowering` runs
the exporter's type promotion: both are steps of the translation to ONNX, which may run in
another process, `offload`, not passes over the captured graph; their docstrings say so.)

The plain backend's cache version (`backend._graph_version`) hashes every file of this package:
adding, reordering or editing a pass retires the graphs stored before, with nothing to bump.

A new fix of a captured graph: a function in `fx_passes.py`, its test in
tests/test_plain_backend.py, and one line below at its place in the order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ort_autopatch.engine.backends.ort import aliasing, draws, fx_passes, linking, symbolic
from ort_autopatch.engine.passes import Pass

if TYPE_CHECKING:
    from ort_autopatch.engine.backends.ort.capture import Captured


@dataclass
class JointGraph:
    """aot's joint graph, before the partitioner splits it."""

    graph: torch.fx.GraphModule
    draws_decided: bool  # the trace decided a branch on a random draw (`draws.decided`)


@dataclass
class PartitionedGraphs:
    """The partitioned graphs of one call, with what the capture read of them."""

    cls: str
    captured: Captured  # its forward and backward are the graphs the passes rewrite
    tangents: dict[str, int]  # backward's tangent placeholders: name -> slot
    num_forward: int  # forward's outputs before the values it saves for backward
    symbolic: bool  # traced with symbolic sizes (`symbolic.fake_inputs`)

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        """Forward, then backward where there is one."""
        backward = self.captured.backward
        return [self.captured.forward] + ([] if backward is None else [backward])


def _each(rewrite: Callable[[torch.fx.GraphModule], object]) -> Callable[[PartitionedGraphs], None]:
    """`rewrite` on forward, then on backward."""

    def run(g: PartitionedGraphs) -> None:
        for graph in g.graphs:
            rewrite(graph)

    return run


def _real_constants(g: PartitionedGraphs) -> None:
    for graph in g.graphs:
        fx_passes.real_constants(g.cls, graph)


def _link(g: PartitionedGraphs) -> None:
    assert g.captured.backward is not None
    linking.link(g.captured, g.captured.forward, g.captured.backward, g.tangents, g.num_forward)


def _drop_regenerated(g: PartitionedGraphs) -> None:
    outputs = [g.captured.user_outputs[k] for k in g.captured.regenerated]
    aliasing.drop_regenerated(g.captured.forward, outputs)


def _save_bases_of_views(g: PartitionedGraphs) -> None:
    assert g.captured.backward is not None
    forward = g.captured.forward
    placeholders = forward.graph.find_nodes(op="placeholder")
    feeds = g.captured.feeds  # one per placeholder, in order
    parameters: frozenset[torch.fx.Node] = frozenset()
    if len(feeds) == len(placeholders):  # else none is known to be a parameter
        kinds = zip(placeholders, feeds, strict=True)
        parameters = frozenset(node for node, feed in kinds if feed.kind == "param")
    fx_passes.save_bases_of_views(
        forward, g.captured.backward, g.captured.backward_inputs, parameters
    )


def _activation_masks_saved(g: PartitionedGraphs) -> None:
    assert g.captured.backward is not None
    backward, reads = g.captured.backward, g.captured.backward_inputs
    fx_passes.activation_masks_saved(g.captured.forward, backward, reads)


def _tied_gradients_summed(g: PartitionedGraphs) -> None:
    if g.captured.backward is not None:
        fx_passes.tied_gradients_summed(g.captured.backward, g.captured.tied)


def _has_backward(g: PartitionedGraphs) -> bool:
    return g.captured.backward is not None


JOINT: tuple[Pass[JointGraph], ...] = (
    # LayerDrop's draws, read by the branch alone
    Pass(
        "drop_unread_draws", lambda g: draws.drop_unread_draws(g.graph), lambda g: g.draws_decided
    ),
)

PARTITIONED: tuple[Pass[PartitionedGraphs], ...] = (
    Pass("real_constants", _real_constants),
    # not a rewrite: names what backward reads, before any pass moves forward's outputs
    Pass("link", _link, _has_backward),
    Pass(
        "pass_feeds_through",
        lambda g: fx_passes.pass_feeds_through(g.captured.forward, g.num_forward),
        _has_backward,
    ),
    Pass("drop_regenerated", _drop_regenerated, lambda g: bool(g.captured.regenerated)),
    # before the views: a copy of the activation is then saved as the activation itself
    Pass("activation_masks_saved", _activation_masks_saved, _has_backward),
    Pass("save_bases_of_views", _save_bases_of_views, _has_backward),
    Pass("detaches_read_through", _each(fx_passes.detaches_read_through)),
    Pass("sums_without_kept_dims", _each(fx_passes.sums_without_kept_dims)),
    Pass("masks_multiplied_once", _each(fx_passes.masks_multiplied_once)),
    Pass("pads_summed_into_cat", _each(fx_passes.pads_summed_into_cat)),
    Pass("reshape_chains_as_one", _each(fx_passes.reshape_chains_as_one)),
    Pass("transposes_composed", _each(fx_passes.transposes_composed)),
    Pass("tied_gradients_summed", _tied_gradients_summed, lambda g: bool(g.captured.tied)),
    Pass("scatters_added_into_the_sum", _each(fx_passes.scatters_added_into_the_sum)),
    Pass("cross_entropy_backward_fused", _each(fx_passes.cross_entropy_backward_fused)),
    Pass("int64_indices", _each(fx_passes.int64_indices)),
    Pass("expand_numel", _each(symbolic.expand_numel), lambda g: g.symbolic),
)
