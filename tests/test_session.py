"""session.py on its own: sessions, dtypes ORT cannot train, what backward reads, messages."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from ort_autopatch.engine import session
from ort_autopatch.engine.backends.ort_training import agent
from ort_autopatch.engine.errors import UnsupportedInputError
from tests.helpers import plain_backend


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


def _scattered_into_zeros(rows: int) -> onnx.ModelProto:
    """`rows` x 64 float zeros made by ConstantOfShape, two rows added in by ScatterND: an
    embedding's gradient as the plain backend lowers it."""
    shape = onnx.numpy_helper.from_array(np.array([rows, 64], np.int64))
    zero = onnx.numpy_helper.from_array(np.zeros(1, np.float32))
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=shape),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=zero),
        helper.make_node("ScatterND", ["zeros", "ids", "rows"], ["grad"], reduction="add"),
    ]
    floats, ints = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("ids", ints, [2, 1]),
            helper.make_tensor_value_info("rows", floats, [2, 64]),
        ],
        [helper.make_tensor_value_info("grad", floats, [rows, 64])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("rows", [16, 8192])
def test_only_small_constants_are_folded_into_what_a_session_keeps(rows: int) -> None:
    # ORT's constant folding makes an initializer that lives as long as the session: GPT-2
    # small's embedding gradient's zeros were 147 MiB of it, beside every step.
    model = _scattered_into_zeros(rows)
    sess, optimized = session.create(
        model.SerializeToString(),
        torch.device("cpu"),
        session.SessionSettings(threads=1),
        "T",
        False,
        capture=True,
    )
    assert optimized is not None
    kept = onnx.load_from_string(optimized).graph
    sizes = [int(np.prod(init.dims)) * 4 for init in kept.initializer if init.name == "zeros"]
    fills = [node for node in kept.node if node.op_type == "ConstantOfShape"]
    # onnxruntime-training 1.19.2 has no such limit: the training build folds as before
    if rows * 64 * 4 > session.FOLDING_LIMIT and plain_backend():  # 2 MiB: made as it runs
        assert (sizes, len(fills)) == ([], 1)
    else:  # 4 KiB: folded, as ORT does by default
        assert (sizes, fills) == ([rows * 64 * 4], [])
    ids = np.array([[1], [1]], np.int64)
    values = np.ones((2, 64), np.float32)
    (grad,) = sess.run(None, {"ids": ids, "rows": values})
    expected = np.zeros((rows, 64), np.float32)
    expected[1] = 2.0
    np.testing.assert_array_equal(grad, expected)
