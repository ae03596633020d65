"""The graph passes, declared once, in the order they run; and the version they make.

`FORWARD` runs on every exported graph, `GRADIENT` on the gradient graph ORT's builder makes
of it. Each entry names a pass of `graph.py` (where the passes live, each tested on its own)
and says when it applies; `apply_forward`/`apply_gradient` run a stage, and the training
backend calls both from one place (`backends/ort_training.py`). `VERSION`, part of every
persistent cache key, is derived from this declaration and the passes' source: adding,
reordering or editing a pass retires the graphs stored before, with nothing to bump by hand.

A new ONNX fix: a function in `graph.py`, a test in tests/test_graph_passes.py, and one line
below at the place in the order where it must run.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
from dataclasses import dataclass, field

import onnx

from ort_autopatch.engine import passes as declared
from ort_autopatch.engine.backends.ort_training import graph
from ort_autopatch.engine.passes import Pass, apply


@dataclass
class ForwardPassState:
    """An exported graph going through the forward passes, and what they found out."""

    model: onnx.ModelProto
    has_backward: bool  # it gets a gradient graph
    padding: dict[str, int]  # nn.Embedding weight input -> its padding_idx
    num_user_outputs: int = 0  # the outputs forward returns (before the passes add any)
    frozen: list[str] = field(default_factory=list)  # inputs fed again as non-trainable
    batch_norms: list[graph.BatchNormStats] = field(default_factory=list)


@dataclass
class GradientPassState:
    """A gradient graph going through the gradient passes."""

    model: onnx.ModelProto
    extra_outputs: list[str]  # forward values handed out beside the user outputs
    num_forward_outputs: int


def _name_outputs(g: ForwardPassState) -> None:
    g.num_user_outputs = len(graph.name_outputs(g.model))


def _embedding_padding(g: ForwardPassState) -> None:
    g.frozen = graph.embedding_padding(g.model, g.padding)


def _batch_norm_statistics(g: ForwardPassState) -> None:
    g.batch_norms = graph.batch_norm_statistics(g.model)


def _yield_extra_outputs(g: GradientPassState) -> None:
    g.num_forward_outputs = graph.yield_extra_outputs(g.model, g.extra_outputs)


FORWARD: tuple[Pass[ForwardPassState], ...] = (
    Pass("name_outputs", _name_outputs),
    Pass("relax_shapes", lambda g: graph.relax_shapes(g.model)),
    Pass("torch_node_mode", lambda g: graph.torch_node_mode(g.model, g.has_backward)),
    Pass("layer_norm_outputs", lambda g: graph.layer_norm_outputs(g.model)),
    Pass("cross_entropy_log_prob", lambda g: graph.cross_entropy_log_prob(g.model)),
    Pass("attention_dropout", lambda g: graph.attention_dropout(g.model)),
    Pass("gather_without_axis_move", lambda g: graph.gather_without_axis_move(g.model)),
    Pass("embedding_padding", _embedding_padding, lambda g: g.has_backward and bool(g.padding)),
    Pass(
        "eval_batch_norm_arithmetic",
        lambda g: graph.eval_batch_norm_arithmetic(g.model),
        lambda g: g.has_backward,
    ),
    Pass(
        "torch_node_shapes_unknown",
        lambda g: graph.torch_node_shapes_unknown(g.model, g.has_backward),
    ),
    Pass("batch_norm_statistics", _batch_norm_statistics),
)

GRADIENT: tuple[Pass[GradientPassState], ...] = (
    Pass("gather_grad_as_slice_grad", lambda g: graph.gather_grad_as_slice_grad(g.model)),
    Pass("yield_extra_outputs", _yield_extra_outputs, lambda g: bool(g.extra_outputs)),
)


def apply_forward(
    model: onnx.ModelProto, has_backward: bool, padding: dict[str, int]
) -> ForwardPassState:
    """Run the forward passes on an exported graph, in place."""
    return apply(FORWARD, ForwardPassState(model, has_backward, padding))


def apply_gradient(
    model: onnx.ModelProto, extra_outputs: list[str], num_forward_outputs: int
) -> GradientPassState:
    """Run the gradient passes on a gradient graph, in place."""
    return apply(GRADIENT, GradientPassState(model, extra_outputs, num_forward_outputs))


@functools.cache
def version() -> str:
    """What the passes make, for persistent cache keys (`persist.static_key`): the stages'
    pass names in order and the source of the passes (this module, `graph.py` and the shared
    `engine.passes`)."""
    names = [f"forward:{p.name}" for p in FORWARD] + [f"gradient:{p.name}" for p in GRADIENT]
    digest = hashlib.sha256("\n".join(names).encode())
    for module in (graph, sys.modules[__name__], declared):
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:16]
