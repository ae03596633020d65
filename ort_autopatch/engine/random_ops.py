"""Which operators draw random numbers: decided here, once, for every part of the engine.

Two vocabularies ask. ONNX operator types: `rng` seeds the graphs that hold one, `verify`
cannot compare their numbers with eager's. ATen operator names (as the TorchScript trace and
the exporter see them, "aten::dropout"): `torch_in_graph.routing` runs a torch-calling node of
one under the tool's generator, `hazards` never takes a value drawn by one for a constant or a size.
Counting an operator as random when it is not costs a seed or a conservative judgment;
missing one costs wrong numbers, so the ATen rule matches by words in the name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: ONNX operators that read ORT's global generator at every run (`Dropout` only when given a
#: `training_mode` input; ORT's own fused variants always).
ONNX_PER_RUN = frozenset({"Dropout", "BitmaskDropout", "BiasDropout", "BitmaskBiasDropout"})
#: ONNX operators that seed a generator of their own when their session is created.
ONNX_PER_SESSION = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
    }
)
ONNX = ONNX_PER_RUN | ONNX_PER_SESSION

#: Words in an ATen operator's name that say it draws random numbers ("aten::randn_like").
_ATEN_WORDS = (
    "rand",
    "normal",
    "bernoulli",
    "dropout",
    "multinomial",
    "uniform",
    "exponential",
    "poisson",
    "cauchy",
    "geometric",
)
#: ATen operators that draw though their names do not say so (a dropout argument inside).
_ATEN_ALSO = frozenset(
    {
        "aten::rrelu",
        "aten::lstm",
        "aten::gru",
        "aten::rnn_tanh",
        "aten::rnn_relu",
        "aten::scaled_dot_product_attention",
    }
)
#: ATen operators whose names hold one of the words but which draw nothing.
_ATEN_NOT = frozenset({"aten::poisson_nll_loss"})


def aten(name: str) -> bool:
    """Whether an ATen operator (a trace node's kind, "aten::dropout") draws random numbers."""
    if name in _ATEN_ALSO:
        return True
    return name not in _ATEN_NOT and any(word in name for word in _ATEN_WORDS)


def bodies(model: Any) -> Iterator[Any]:
    """Every list of nodes of an ONNX model that runs: the graph's, each local function's
    (torchlib writes some ATen operators as functions, their random draws inside), and the
    subgraphs of control-flow nodes (If, Loop, Scan) in any of them."""
    graph = getattr(model, "graph", model)
    pending = [graph.node, *(f.node for f in getattr(model, "functions", ()))]
    while pending:
        nodes = pending.pop()
        yield nodes
        for node in nodes:
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    pending.append(attribute.g.node)
                pending.extend(g.node for g in attribute.graphs)


def nodes(model: Any) -> Iterator[Any]:
    """Every node of an ONNX model, the bodies of its functions and subgraphs included."""
    for body in bodies(model):
        yield from body


def per_session(model: Any) -> list[str]:
    """The operators of an ONNX model that draw from a generator ORT seeds once per session
    (`ONNX_PER_SESSION`: torchlib's `rand_like`, `randn_like`, `bernoulli`, `normal`): a run
    cannot be seeded, so running the graph again never draws the same numbers."""
    return sorted({n.op_type for n in nodes(model) if n.op_type in ONNX_PER_SESSION})
