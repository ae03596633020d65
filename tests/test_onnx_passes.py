"""The rewrites of a translated ONNX graph (`backends/ort/onnx_passes.py`) on graphs written
node by node: what each drops, what it must keep, and the graph's outputs by name. Their
effect on real models is tested end to end in tests/test_plain_backend.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.plain_helpers import PLAIN_READY, SKIP_REASON

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)


def _graph(build: Any) -> Any:
    """A graph of one float32 input `x` (2, 3), with the nodes and outputs `build(x, ir)`
    returns."""
    import onnx_ir as ir

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    nodes, outputs = build(x, ir)
    return ir.Graph([x], outputs, nodes=nodes, opset_imports={"": 18})


def _run(graph: Any) -> dict[str, Any]:
    import onnx_ir as ir
    import onnxruntime as ort

    model = ir.Model(graph, ir_version=10)
    proto = ir.serde.serialize_model(model).SerializeToString()
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"x": x}), strict=True))


def test_a_cast_to_the_type_a_value_has_is_dropped_and_an_output_keeps_its_name() -> None:
    from ort_autopatch.engine.backends.ort import onnx_passes

    def build(x: Any, ir: Any) -> Any:
        doubled = ir.node("Add", [x, x])
        same = ir.node("Cast", [doubled.outputs[0]], {"to": ir.DataType.FLOAT})
        read = ir.node("Neg", [same.outputs[0]])
        out = ir.node("Cast", [read.outputs[0]], {"to": ir.DataType.FLOAT})
        out.outputs[0].name = "y"
        for node in (doubled, read):
            node.outputs[0].dtype = ir.DataType.FLOAT
        return [doubled, same, read, out], [out.outputs[0]]

    graph = _graph(build)
    onnx_passes.casts_to_own_type_dropped(graph)
    assert [n.op_type for n in graph] == ["Add", "Neg"]
    assert _run(graph)["y"].tolist() == [[-0.0, -2.0, -4.0], [-6.0, -8.0, -10.0]]


def test_an_inputs_cast_to_its_own_type_as_an_output_stays_a_node() -> None:
    """An output cannot take an input's name: the node stays, and the output its name."""
    from ort_autopatch.engine.backends.ort import onnx_passes

    def build(x: Any, ir: Any) -> Any:
        cast = ir.node("Cast", [x], {"to": ir.DataType.FLOAT})
        cast.outputs[0].name = "y"
        return [cast], [cast.outputs[0]]

    graph = _graph(build)
    onnx_passes.casts_to_own_type_dropped(graph)
    assert [n.op_type for n in graph] == ["Cast"]
    assert _run(graph)["y"].shape == (2, 3)


@pytest.mark.parametrize("to", ["INT64", "BOOL", "FLOAT16", "DOUBLE"])
def test_a_filled_tensor_cast_after_is_filled_in_that_type(to: str) -> None:
    """ConstantOfShape(value=2.5) then a cast: the fill is made in the cast's type, converted
    as the Cast converts it (2.5 to an integer is 2, to bool True)."""
    from ort_autopatch.engine.backends.ort import onnx_passes

    def build(x: Any, ir: Any) -> Any:
        shape = ir.node("Shape", [x])
        fill = ir.tensor(np.array([2.5], dtype=np.float32))
        filled = ir.node("ConstantOfShape", [shape.outputs[0]], {"value": fill})
        cast = ir.node("Cast", [filled.outputs[0]], {"to": ir.DataType[to]})
        cast.outputs[0].name = "y"
        return [shape, filled, cast], [cast.outputs[0]]

    expected = _run(_graph(build))["y"]
    graph = _graph(build)
    onnx_passes.casts_to_own_type_dropped(graph)
    assert [n.op_type for n in graph] == ["Shape", "ConstantOfShape"]
    got = _run(graph)["y"]
    assert got.dtype == expected.dtype and np.array_equal(got, expected)


def test_a_filled_tensor_cast_to_strings_keeps_its_cast() -> None:
    """A ConstantOfShape makes no strings, and how a number is written as one is the
    Cast's to say: left as it is."""
    from ort_autopatch.engine.backends.ort import onnx_passes

    def build(x: Any, ir: Any) -> Any:
        shape = ir.node("Shape", [x])
        filled = ir.node("ConstantOfShape", [shape.outputs[0]])
        cast = ir.node("Cast", [filled.outputs[0]], {"to": ir.DataType.STRING})
        cast.outputs[0].name = "y"
        return [shape, filled, cast], [cast.outputs[0]]

    graph = _graph(build)
    onnx_passes.casts_to_own_type_dropped(graph)
    assert [n.op_type for n in graph] == ["Shape", "ConstantOfShape", "Cast"]
    assert _run(graph)["y"].tolist() == [["0", "0", "0"], ["0", "0", "0"]]


def test_a_transpose_that_moves_nothing_is_dropped() -> None:
    from ort_autopatch.engine.backends.ort import onnx_passes

    def build(x: Any, ir: Any) -> Any:
        moved = ir.node("Transpose", [x], {"perm": [1, 0]})
        still = ir.node("Transpose", [moved.outputs[0]], {"perm": [0, 1]})
        still.outputs[0].name = "y"
        still.outputs[0].shape = ir.Shape([3, 2])  # as the translator gives an FX node's
        return [moved, still], [still.outputs[0]]

    graph = _graph(build)
    onnx_passes.identity_transposes_dropped(graph)
    assert [n.op_type for n in graph] == ["Transpose"]
    # the value taking the output's place keeps its shape: later rewrites read ranks off it
    assert graph.outputs[0].shape == [3, 2]
    assert _run(graph)["y"].tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


#: (data's shape, index depth, index tuples, negative indices): an embedding's rows (few
#: rows, every update onto them: a token type embedding), a vocabulary's, two indexed dims
#: (`x[i, j] += v`) with negative indices, and scalars into a vector
_SCATTERS = {
    "few rows": ((2, 768), 1, 4096, False),
    "vocabulary": ((30522, 64), 1, 4096, True),
    "two dims": ((5, 6, 7), 2, 3000, True),
    "elements": ((9,), 1, 5000, False),
}


@pytest.mark.parametrize("depth_known", [True, False], ids=["depth known", "depth unknown"])
@pytest.mark.parametrize("case", list(_SCATTERS))
def test_a_scatter_that_adds_is_made_one_that_adds_every_update(
    case: str, depth_known: bool
) -> None:
    """ORT's ScatterND with `reduction="add"` adds updates of one row from two threads
    without synchronisation and loses some (14 % to 38 % off from two threads at these
    sizes). Made ScatterElements over the data's rows, every update is added, at two
    threads, whatever the index depth and sign; an output keeps its name. Where the index
    tuples are known to address one dim, the scatter runs on the data as it is: its result
    is the output, with no Reshape to copy it there."""
    import onnx_ir as ir
    import onnxruntime as ort

    from ort_autopatch.engine.backends.ort import onnx_passes

    shape, depth, count, negative = _SCATTERS[case]
    rng = np.random.default_rng(0)
    low = [-s if negative else 0 for s in shape[:depth]]
    sides = zip(low, shape[:depth], strict=True)
    index = np.stack([rng.integers(lo, side, count) for lo, side in sides], -1)
    updates = rng.standard_normal((count, *shape[depth:])).astype(np.float32)
    data = rng.standard_normal(shape).astype(np.float32)
    expected = data.astype(np.float64)
    np.add.at(expected, tuple(index.T), updates)

    values = {
        "data": ir.Value(name="data", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(shape)),
        "index": ir.Value(
            name="index",
            type=ir.TensorType(ir.DataType.INT64),
            shape=ir.Shape([count, depth]) if depth_known else None,
        ),
        "updates": ir.Value(name="updates", type=ir.TensorType(ir.DataType.FLOAT)),
    }
    scatter = ir.node("ScatterND", list(values.values()), {"reduction": "add"})
    scatter.outputs[0].name = "y"
    graph = ir.Graph(
        list(values.values()), scatter.outputs, nodes=[scatter], opset_imports={"": 18}
    )
    onnx_passes.accumulating_scatters_by_element(graph)
    assert "ScatterND" not in [n.op_type for n in graph]
    (result,) = graph.outputs
    if depth_known and depth == 1:
        assert result.producer().op_type == "ScatterElements"
        assert result.producer().inputs[0] is values["data"]
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    feeds = {"data": data, "index": index.astype(np.int64), "updates": updates}
    for _ in range(10):  # a lost update shows in some runs (two threads at work), not all
        (got,) = session.run(["y"], feeds)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_a_reshape_into_an_output_is_left_to_torch_where_its_shape_is_static() -> None:
    """ONNX Runtime copies a Reshape into a graph output (a convolution's weight gradient
    made as a matrix, a language model's logits). The output is returned as the value the
    Reshape read, under the output's name, and its shape is named for torch to restore;
    a Reshape of an input, of a constant, or to a symbolic shape stays."""
    from ort_autopatch.engine.backends.ort import onnx_passes

    def build(x: Any, ir: Any) -> Any:
        doubled, again = ir.node("Add", [x, x]), ir.node("Add", [x, x])
        nodes, outputs = [doubled, again], []
        sources = {
            "y": doubled.outputs[0],  # computed: left to torch
            "read": again.outputs[0],  # also read in the graph: left to torch, read reshaped
            "of_input": x,
            "symbolic": doubled.outputs[0],
        }
        for name, source in sources.items():
            shape = ir.node(
                "Constant", [], {"value": ir.tensor(np.array([3, 2, 1], dtype=np.int64))}
            )
            reshape = ir.node("Reshape", [source, shape.outputs[0]])
            reshape.outputs[0].name = name
            reshape.outputs[0].shape = ir.Shape(["n", 2, 1] if name == "symbolic" else [3, 2, 1])
            reshape.outputs[0].dtype = ir.DataType.FLOAT
            nodes += [shape, reshape]
            outputs.append(reshape.outputs[0])
        reader = ir.node("Shape", [outputs[1]])
        reader.outputs[0].name = "read_shape"
        return [*nodes, reader], [*outputs, reader.outputs[0]]

    graph = _graph(build)
    assert onnx_passes.reshapes_into_outputs_left_to_torch(graph) == {
        "y": [3, 2, 1],
        "read": [3, 2, 1],
    }
    y, read, of_input, symbolic, _ = graph.outputs
    assert y.name == "y" and y.producer().op_type == "Add"
    assert read.name == "read" and read.producer().op_type == "Add"
    assert of_input.producer().op_type == "Reshape"
    assert symbolic.producer().op_type == "Reshape"
    got = _run(graph)
    assert got["y"].shape == (2, 3)  # as the Add made it: torch views it as (3, 2, 1)
    assert got["y"].reshape(3, 2, 1).tolist() == (2 * np.arange(6.0)).reshape(3, 2, 1).tolist()
    assert got["read"].shape == (2, 3)
    assert got["read_shape"].tolist() == [3, 2, 1]  # the graph's reader reads it reshaped
    assert [n.op_type for n in graph].count("Constant") == 3  # the dropped Reshape's went


@pytest.mark.parametrize("case", ["computed", "an input", "sum read in the graph"])
def test_rows_added_into_an_output_are_left_to_torch_where_the_table_is_computed(
    case: str,
) -> None:
    """ONNX Runtime scatters into a graph output only after copying the whole table (an
    embedding's gradient: 2 ms in place, 57-164 ms as an output). Where the table is
    computed in the graph, the output is that table, and the rows and values come out
    beside it for torch to add (`index_add_`): added so, they give what the scatter gave.
    Into an input, or where the graph reads the sum too, the scatter stays."""
    import onnx_ir as ir
    import onnxruntime as ort

    from ort_autopatch.engine.backends.ort import onnx_passes

    shape, count = (50, 8), 400
    rng = np.random.default_rng(0)
    index = rng.integers(-50, 50, (count, 1)).astype(np.int64)
    updates = rng.standard_normal((count, 8)).astype(np.float32)
    table = rng.standard_normal(shape).astype(np.float32)
    data_computed = case != "an input"
    expected = 2 * table.astype(np.float64) if data_computed else table.astype(np.float64)
    np.add.at(expected, index[:, 0], updates)

    def value(name: str, dtype: Any, dims: Any) -> Any:
        return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))

    inputs = [
        value("table", ir.DataType.FLOAT, shape),
        value("index", ir.DataType.INT64, [count, 1]),
        value("updates", ir.DataType.FLOAT, [count, 8]),
    ]
    nodes = []
    data = inputs[0]
    if data_computed:
        doubled = ir.node("Add", [data, data])
        nodes.append(doubled)
        data = doubled.outputs[0]
    scatter = ir.node("ScatterND", [data, inputs[1], inputs[2]], {"reduction": "add"})
    scatter.outputs[0].name = "y"
    scatter.outputs[0].shape = ir.Shape(shape)
    scatter.outputs[0].dtype = ir.DataType.FLOAT  # as the translator gives an FX node's
    outputs, nodes = [scatter.outputs[0]], [*nodes, scatter]
    if case == "sum read in the graph":
        nodes.append(ir.node("Neg", [scatter.outputs[0]]))
        outputs.append(nodes[-1].outputs[0])
    graph = ir.Graph(inputs, outputs, nodes=nodes, opset_imports={"": 18})
    onnx_passes.accumulating_scatters_by_element(graph)
    added = onnx_passes.accumulations_into_outputs_left_to_torch(graph)
    ops = [n.op_type for n in graph]
    if case != "computed":
        assert added == {} and "ScatterElements" in ops
        return
    assert added == {"y": ["y.rows", "y.values"]}
    assert [o.dtype for o in graph.outputs] == [
        ir.DataType.FLOAT,
        ir.DataType.INT64,
        ir.DataType.FLOAT,
    ]
    assert "ScatterElements" not in ops and "Expand" not in ops  # nothing left unread
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString()
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    feeds = {"table": table, "index": index, "updates": updates}
    y, rows, values = (torch.from_numpy(t) for t in session.run(["y", "y.rows", "y.values"], feeds))
    y.index_add_(0, rows, values)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-4)
