"""session.py on its own: sessions, dtypes ORT cannot train, what backward reads, messages."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import helper

from ort_autopatch.engine import session
from ort_autopatch.engine.backends.ort_training import agent
from ort_autopatch.engine.errors import UnsupportedInputError


def _graph(
    nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str], dtype: int
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, dtype, ["n"]) for n in inputs],
        [helper.make_tensor_value_info(n, dtype, ["n"]) for n in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_an_inference_program_names_its_feeds_and_fetches() -> None:
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], ["x"], ["y"], onnx.TensorProto.FLOAT)
    program = agent.build_inference(
        model.SerializeToString(), torch.device("cpu"), session.SessionSettings(threads=1), "T"
    )
    assert (program.feed_names, program.fetch_names, program.stream) == (["x"], ["y"], None)


def test_training_a_float64_graph_is_refused_before_any_build() -> None:
    model = _graph([helper.make_node("Relu", ["x"], ["y"])], ["x"], ["y"], onnx.TensorProto.DOUBLE)
    with pytest.raises(UnsupportedInputError, match="float64"):
        agent._refuse_dtypes(model, "T")


def test_a_float64_input_only_cast_to_float32_is_trainable() -> None:
    cast = helper.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.FLOAT)
    model = _graph([cast], ["x"], [], onnx.TensorProto.DOUBLE)
    model.graph.output.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None))
    agent._refuse_dtypes(model, "T")


def test_backward_reads_a_value_through_an_aliasing_view() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["h"]),
        helper.make_node("YieldOp", ["h"], ["dh"], domain="com.microsoft"),
        helper.make_node("Reshape", ["x", "shape"], ["x_view"]),
        helper.make_node("Mul", ["dh", "x_view"], ["dx"]),
    ]
    reads = agent.backward_reads(_graph(nodes, ["x", "shape"], ["dx"], 1).graph)
    assert reads("x") and reads("x_view") and not reads("h")


def test_ort_messages_lose_their_source_locations() -> None:
    raw = RuntimeError(
        "[ONNXRuntimeError] : 1 : FAIL : /onnxruntime_src/core/graph.cc:12 void f() x was false. "
        "shapes differ"
    )
    assert session.ort_message(raw) == "shapes differ"
