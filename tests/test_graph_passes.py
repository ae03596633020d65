"""Each graph pass on a minimal hand-built graph: what it changes and what it leaves alone."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from ort_autopatch.engine.backends.ort_training import graph
from tests.helpers import plain_backend

#: GatherGrad is the training build's gradient operator (com.microsoft), which these tests run
TRAINING_KERNELS = pytest.mark.skipif(
    plain_backend(),
    reason="runs the training build's GatherGrad kernel, which the inference-only onnxruntime "
    "lacks; the plain backend's backward graphs come from torch's autograd, not these passes",
)


def _model(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    return helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, [f"{n}_d0"]) for n in inputs],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in outputs],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )


def test_name_outputs_renames_outputs_and_their_producers() -> None:
    model = _model([helper.make_node("Identity", ["x"], ["17"])], ["x"], ["17"])
    assert graph.name_outputs(model) == ["output_0"]
    assert model.graph.node[0].output[0] == "output_0"


def test_relax_shapes_drops_traced_output_sizes() -> None:
    model = _model([helper.make_node("Identity", ["x"], ["y"])], ["x"], ["y"])
    graph.relax_shapes(model)
    dims = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["y_dim0", "y_dim1"]
    assert not any(d.HasField("dim_value") for d in dims)


def test_layer_norm_gets_mean_and_inv_std_outputs() -> None:
    node = helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], name="ln")
    model = _model([node], ["x", "w", "b"], ["y"])
    assert graph.layer_norm_outputs(model) == 1
    assert len(model.graph.node[0].output) == 3


def test_attention_dropout_gets_training_mode_and_mask() -> None:
    ratio = helper.make_node(
        "Constant", [], ["r"], value=helper.make_tensor("r", TensorProto.FLOAT, [], [0.1])
    )
    drop = helper.make_node("Dropout", ["x", "r"], ["y"], name="d")
    model = _model([ratio, drop], ["x"], ["y"])
    assert graph.attention_dropout(model) == 1
    fixed = next(n for n in model.graph.node if n.op_type == "Dropout")
    assert len(fixed.input) == 3 and len(fixed.output) == 2
    flag = next(n for n in model.graph.node if n.output[0] == fixed.input[2])
    assert onnx.numpy_helper.to_array(flag.attribute[0].t).item() is True
    onnx.checker.check_model(model)


def test_attention_dropout_leaves_complete_dropout_alone() -> None:
    drop = helper.make_node("Dropout", ["x", "r", "t"], ["y", "m"])
    model = _model([drop], ["x", "r", "t"], ["y"])
    assert graph.attention_dropout(model) == 0


def _batch_norm_model(training: int) -> onnx.ModelProto:
    node = helper.make_node(
        "BatchNormalization",
        ["x", "scale", "bias", "mean", "var"],
        ["y", "running_mean", "running_var"] if training else ["y"],
        training_mode=training,
        momentum=0.9,
    )
    return _model([node], ["x", "scale", "bias", "mean", "var"], ["y"])


def test_batch_norm_statistics_become_outputs_and_buffers_are_not_fed_to_the_kernel() -> None:
    model = _batch_norm_model(training=1)
    (stats,) = graph.batch_norm_statistics(model)
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    assert stats.running_mean == "mean" and stats.running_var == "var"
    assert "mean" not in bn.input and "var" not in bn.input
    assert next(a.f for a in bn.attribute if a.name == "momentum") == 0.0
    assert [o.name for o in model.graph.output][-2:] == [stats.mean_output, stats.var_output]
    onnx.checker.check_model(model)


def test_batch_norm_placeholders_are_distinct_so_ort_cannot_merge_them() -> None:
    model = _batch_norm_model(training=1)
    graph.batch_norm_statistics(model)
    fills = [
        onnx.numpy_helper.to_array(n.attribute[0].t).item()
        for n in model.graph.node
        if n.op_type == "ConstantOfShape"
    ]
    assert len(fills) == len(set(fills)) == 2


def test_batch_norm_in_eval_mode_is_untouched() -> None:
    model = _batch_norm_model(training=0)
    assert graph.batch_norm_statistics(model) == []


def test_embedding_padding_routes_pad_positions_to_a_frozen_weight() -> None:
    gather = helper.make_node("Gather", ["weight", "ids"], ["emb"], axis=0)
    model = _model([gather], ["weight", "ids"], ["emb"])
    assert graph.embedding_padding(model, {"weight": 0}) == ["weight__frozen"]
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Gather") == 2 and "Where" in ops
    where = next(n for n in model.graph.node if n.op_type == "Where")
    assert where.output[0] == "emb"
    assert "weight__frozen" in [i.name for i in model.graph.input]


def test_embedding_padding_ignores_gathers_of_other_tensors() -> None:
    gather = helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0)
    model = _model([gather], ["table", "ids"], ["emb"])
    assert graph.embedding_padding(model, {"weight": 0}) == []


def test_yield_extra_outputs_appends_non_differentiable_yield_inputs() -> None:
    yield_op = helper.make_node("YieldOp", ["out"], ["out_grad"], domain="com.microsoft")
    model = _model([yield_op], ["out"], ["out_grad"])
    assert graph.yield_extra_outputs(model, ["a", "b"]) == 3
    attr = next(a for a in model.graph.node[0].attribute if a.name == "non_differentiable_outputs")
    assert list(attr.ints) == [1, 2]


def test_yield_extra_outputs_requires_a_yield_op() -> None:
    with pytest.raises(ValueError, match="YieldOp"):
        graph.yield_extra_outputs(_model([], ["x"], ["x"]), ["a"])


def test_yield_extra_outputs_moves_late_producers_before_the_yield_op() -> None:
    nodes = [
        helper.make_node("YieldOp", ["out"], ["out_grad"], domain="com.microsoft"),
        helper.make_node("Neg", ["x"], ["late"]),
        helper.make_node("Abs", ["late"], ["stat"]),
        helper.make_node("Neg", ["out_grad"], ["x_grad"]),
    ]
    model = _model(nodes, ["x", "out"], ["x_grad"])
    graph.yield_extra_outputs(model, ["stat"])
    order = [n.output[0] for n in model.graph.node]
    assert order == ["late", "stat", "out_grad", "x_grad"]
    assert list(model.graph.node[2].input) == ["out", "stat"]


@TRAINING_KERNELS
@pytest.mark.parametrize(("index", "axis"), [(0, 0), (2, 1), (-1, 1), (-1, -1)])
def test_gather_grad_at_a_constant_index_becomes_the_same_slice_grad(index: int, axis: int) -> None:
    import numpy as np
    import onnxruntime as ort

    x = np.zeros((3, 4, 5), dtype=np.float32)
    grad = np.random.default_rng(0).standard_normal(np.take(x, 0, axis=axis).shape)
    grad = grad.astype(np.float32)

    def run(model: onnx.ModelProto) -> np.ndarray:
        model.ir_version = 8  # what ONNX Runtime 1.19.2 reads
        options = ort.SessionOptions()
        options.log_severity_level = 3  # the rewrite leaves the index constant unused
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return session.run(None, {"shape": np.array(x.shape), "dy": grad})[0]

    def model() -> onnx.ModelProto:
        nodes = [
            helper.make_node(
                "Constant", [], ["i"], value=helper.make_tensor("i", TensorProto.INT64, [], [index])
            ),
            helper.make_node(
                "GatherGrad", ["shape", "i", "dy"], ["dx"], axis=axis, domain="com.microsoft"
            ),
        ]
        return helper.make_model(
            helper.make_graph(
                nodes,
                "g",
                [
                    helper.make_tensor_value_info("shape", TensorProto.INT64, [3]),
                    helper.make_tensor_value_info("dy", TensorProto.FLOAT, None),
                ],
                [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)],
            ),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        )

    expected = run(model())
    rewritten = model()
    assert graph.gather_grad_as_slice_grad(rewritten) == 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert "GatherGrad" not in ops and "SliceGrad" in ops
    np.testing.assert_array_equal(run(rewritten), expected)


def test_gather_grad_with_tensor_indices_is_left_alone() -> None:
    node = helper.make_node("GatherGrad", ["shape", "ids", "dy"], ["dx"], domain="com.microsoft")
    model = _model([node], ["shape", "ids", "dy"], ["dx"])
    assert graph.gather_grad_as_slice_grad(model) == 0
    assert [n.op_type for n in model.graph.node] == ["GatherGrad"]


@TRAINING_KERNELS
@pytest.mark.parametrize("size", [3, 5])
def test_summed_gather_grads_of_leading_indices_become_one_padded_concat(size: int) -> None:
    import numpy as np
    import onnxruntime as ort

    x = np.zeros((size, 4, 2), dtype=np.float32)
    rng = np.random.default_rng(1)
    grads = {f"dy{i}": rng.standard_normal((4, 2)).astype(np.float32) for i in range(3)}

    def model() -> onnx.ModelProto:
        nodes = []
        for i in range(3):
            nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [f"i{i}"],
                    value=helper.make_tensor(f"i{i}", TensorProto.INT64, [], [(2, 0, 1)[i]]),
                )
            )
            nodes.append(helper.make_node("Shape", ["x"], [f"s{i}"]))  # one Shape per gradient
            nodes.append(
                helper.make_node(
                    "GatherGrad",
                    [f"s{i}", f"i{i}", f"dy{i}"],
                    [f"dx{i}"],
                    axis=0,
                    domain="com.microsoft",
                )
            )
        nodes.append(helper.make_node("Sum", ["dx0", "dx1", "dx2"], ["dx"]))
        graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)]
        graph_inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in grads]
        return helper.make_model(
            helper.make_graph(
                nodes, "g", graph_inputs, [helper.make_tensor_value_info("dx", 1, None)]
            ),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        )

    def run(m: onnx.ModelProto) -> np.ndarray:
        m.ir_version = 8
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(m.SerializeToString(), options, ["CPUExecutionProvider"])
        return session.run(None, {"x": x, **grads})[0]

    expected = run(model())
    rewritten = model()
    assert graph.gather_grad_as_slice_grad(rewritten) == 3
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Sum" not in ops and "SliceGrad" not in ops and "Pad" in ops
    np.testing.assert_array_equal(run(rewritten), expected)
    assert expected.shape == (size, 4, 2) and not expected[3:].any()


def _packed_qkv(extra_reader: bool = False) -> onnx.ModelProto:
    """MultiheadAttention's packed projection as exported: [S, B, 3, E] -> unsqueeze(0) ->
    transpose(0, -2) -> squeeze(-2) -> proj[0], proj[1], proj[2]."""

    def ints(name: str, values: list[int], scalar: bool = False) -> onnx.NodeProto:
        dims = [] if scalar else [len(values)]
        return helper.make_node(
            "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, dims, values)
        )

    nodes = [
        ints("zero", [0]),
        ints("three", [3]),
        *(ints(f"i{k}", [k], scalar=True) for k in range(3)),
        helper.make_node("Unsqueeze", ["proj", "zero"], ["u"]),
        helper.make_node("Transpose", ["u"], ["t"], perm=[3, 1, 2, 0, 4]),
        helper.make_node("Squeeze", ["t", "three"], ["moved"]),
        *(helper.make_node("Gather", ["moved", f"i{k}"], [f"qkv{k}"], axis=0) for k in range(3)),
    ]
    outputs = ["qkv0", "qkv1", "qkv2"] + (["twice"] if extra_reader else [])
    if extra_reader:
        nodes.append(helper.make_node("Add", ["moved", "moved"], ["twice"]))
    return helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("proj", TensorProto.FLOAT, ["s", "b", 3, 4])],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,  # what ONNX Runtime 1.19.2 reads
    )


def test_packed_qkv_are_gathered_where_they_lie_with_the_same_values() -> None:
    import numpy as np
    import onnxruntime as ort

    proj = np.random.default_rng(0).standard_normal((5, 2, 3, 4)).astype(np.float32)

    def run(model: onnx.ModelProto) -> list[np.ndarray]:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # the rewrite leaves constants unused
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return session.run(None, {"proj": proj})

    rewritten = _packed_qkv()
    assert graph.gather_without_axis_move(rewritten) == 1
    ops = [n.op_type for n in rewritten.graph.node if n.op_type != "Constant"]
    assert ops == ["Gather"] * 3
    assert all(next(a.i for a in n.attribute) == 2 for n in rewritten.graph.node[-3:])
    for got, want in zip(run(rewritten), run(_packed_qkv()), strict=True):
        np.testing.assert_array_equal(got, want)
    for k, got in enumerate(run(rewritten)):
        np.testing.assert_array_equal(got, proj[:, :, k])


def test_a_moved_tensor_read_by_more_than_gathers_is_left_alone() -> None:
    model = _packed_qkv(extra_reader=True)
    assert graph.gather_without_axis_move(model) == 0
    assert "Transpose" in [n.op_type for n in model.graph.node]


def test_torch_node_outputs_reach_their_readers_through_a_reshape_of_their_own_sizes() -> None:
    python_op = helper.make_node(
        "PythonOp",
        ["x"],
        ["ctx", "a"],
        domain="com.microsoft",
        output_tensor_types=[TensorProto.FLOAT],
        output_tensor_ranks=[2],
    )
    model = _model([python_op, helper.make_node("Mul", ["a", "x"], ["y"])], ["x"], ["y"])
    assert graph.torch_node_shapes_unknown(model, gradient=True) == 1
    op_types = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert op_types == [
        ("PythonOp", ["x"], ["ctx", "a__torch"]),
        ("Shape", ["a__torch"], ["a__shape"]),
        ("Reshape", ["a__torch", "a__shape"], ["a"]),  # readers keep the old name
        ("Mul", ["a", "x"], ["y"]),
    ]
    (info,) = model.graph.value_info
    dims = [d.dim_param for d in info.type.tensor_type.shape.dim]
    assert (info.name, dims) == ("a__torch", ["a__torch_size0", "a__torch_size1"])


def test_torch_node_outputs_of_a_forward_only_graph_get_sizes_of_their_own_and_no_reshape() -> None:
    python_op = helper.make_node(
        "PythonOp",
        ["x"],
        ["ctx", "a"],
        domain="com.microsoft",
        output_tensor_types=[TensorProto.FLOAT],
        output_tensor_ranks=[1],
    )
    model = _model([python_op, helper.make_node("Mul", ["a", "x"], ["y"])], ["x"], ["y"])
    assert graph.torch_node_shapes_unknown(model, gradient=False) == 1
    assert [n.op_type for n in model.graph.node] == ["PythonOp", "Mul"]
    (info,) = model.graph.value_info
    dims = [d.dim_param for d in info.type.tensor_type.shape.dim]
    assert (info.name, dims) == ("a", ["a_size0"])
