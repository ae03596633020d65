"""FX graph to ONNX, with the exporter's own translator and without re-tracing.

`torch.onnx.export` would trace the graph again with torch.export and decompose it again
(2 to 6 s a graph); the graphs the capture produces are already ATen-level and decomposed
into what the exporter's op library (torchlib) translates, so each node goes straight through
the exporter's translator. An operator the library lacks is an `ExportError` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
from collections.abc import Iterator
from typing import Any

import torch

from ort_autopatch.engine.errors import ExportError

OPSET = 18  # torchlib's own opset: its functions are written for it


@functools.cache
def registry() -> Any:
    """torchlib's registry of ATen -> ONNX functions (built once: about 1 s)."""
    from torch.onnx._internal.exporter import _registration

    # it warns, on the user's stderr, of every torchvision operator it skips when torchvision
    # is not installed: nothing the user asked about
    logger = logging.getLogger(_registration.__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return _registration.ONNXRegistry.from_torchlib(OPSET)
    finally:
        logger.setLevel(level)


def missing_operators(gm: torch.fx.GraphModule) -> list[str]:
    """Operators of the graph the exporter has no translation for."""
    found = registry()
    missing = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if not found.is_registered(node.target):
            missing.add(str(node.target))
    return sorted(missing)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The translator logs a warning per node it finds no module stack for."""
    logger = logging.getLogger("torch.onnx._internal.exporter._core")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def to_onnx(gm: torch.fx.GraphModule, cls: str, what: str) -> bytes:
    """The ONNX bytes of one graph: its placeholders are the inputs, its outputs (no None,
    none twice) the outputs, all named after their FX nodes."""
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _constants, _core, _fx_passes, _ir_passes

    missing = missing_operators(gm)
    if missing:
        raise ExportError(
            cls,
            f"the {what} graph has operators ONNX cannot express: {', '.join(missing)}",
            "Run this class eagerly (the default fallback policy does) and report the model",
        )
    model = ir.Model(
        graph=ir.Graph([], [], nodes=[], name=what),
        ir_version=_constants.ONNX_IR_VERSION,
        producer_name="ort_autopatch",
    )
    try:
        with _quiet():
            _fx_passes.insert_type_promotion_nodes(gm)
            _core._translate_fx_graph(
                gm.graph,
                model,
                graph_like=model.graph,
                owned_graphs={},
                lower="at_conversion",
                registry=registry(),
            )
    except Exception as exc:
        raise ExportError(
            cls,
            f"translating the {what} graph to ONNX failed: {_operator_of(exc)}",
            "Run this class eagerly (the default fallback policy does) and report the model",
        ) from exc
    _ir_passes.add_opset_imports(model)
    proto = ir.serde.serialize_model(model)
    return bytes(proto.SerializeToString())


def _operator_of(exc: BaseException) -> str:
    """The failing node's operator and the translator's reason, in one line."""
    text = str(exc)
    node = re.search(r"torch\.ops\.(aten\.\w+(?:\.\w+)?)", text)
    cause = exc.__cause__
    reason = f"{type(cause).__name__}: {cause}" if cause is not None else text
    reason = " ".join(reason.split())[:300]
    return f"{node[1]}: {reason}" if node else reason
