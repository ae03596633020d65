"""The run-time plumbing on its own: a session run (`session.RunnableSession`), tensors into
and out of ORT (`dlpack`), kept values, and the training build's BatchNorm statistics.

The DLPack plumbing is the installed build's (`dlpack.use_inference_dlpack`: the training
build moves bools as uint8 with a flag, the inference-only build as they are).
"""

from __future__ import annotations

import weakref

import onnx
import pytest
import torch
from onnx import helper

from ort_autopatch.engine import dlpack, session
from ort_autopatch.engine.errors import ExecutionError


def _add_one(rank: int) -> bytes:
    one = helper.make_tensor("one", onnx.TensorProto.FLOAT, [], [1])
    dims = [f"d{k}" for k in range(rank)]
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, dims)],
        [one],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8
    ).SerializeToString()


def _program(rank: int = 2) -> session.RunnableSession:
    dlpack.use_inference_dlpack()  # what the plain backend does before its first session
    settings = session.SessionSettings(threads=1)
    device = torch.device("cpu")
    made, _ = session.create(_add_one(rank), device, settings, "Test", False)
    return session.RunnableSession.of(made, device, None)


def test_an_inference_run_computes_the_graph() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    (y,) = _program().run([x])
    assert torch.equal(y, x + 1)


def test_a_non_contiguous_feed_is_read_as_its_values() -> None:
    x = torch.arange(6.0).reshape(2, 3).t()
    (y,) = _program().run([x])
    assert torch.equal(y, x + 1)


def test_a_feed_reads_in_place_updates_and_a_replaced_tensor() -> None:
    program = _program(rank=1)
    w = torch.zeros(3)
    program.run([w])
    w.add_(2)  # an optimizer step: same memory
    (y,) = program.run([w])
    assert torch.equal(y, torch.full((3,), 3.0))
    w = torch.ones(3)  # new memory
    (y,) = program.run([w])
    assert torch.equal(y, torch.full((3,), 2.0))


def test_a_kept_value_reads_in_place_updates_and_a_replaced_tensor_is_wrapped_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    program, kept = _program(rank=1), dlpack.KeptValues([0])
    # kept values serve feeds that go through DLPack: every feed on the training build, CUDA
    # tensors on the inference build (whose CPU feeds go by address)
    monkeypatch.setattr(dlpack, "_CPU", None)
    w = torch.zeros(3)
    program.run([w], kept)
    first = kept.values[0][4]
    w.add_(2)  # an optimizer step: same memory
    (y,) = program.run([w], kept)
    assert torch.equal(y, torch.full((3,), 3.0)) and kept.values[0][4] is first
    w = torch.ones(3)  # new memory
    (y,) = program.run([w], kept)
    assert torch.equal(y, torch.full((3,), 2.0)) and kept.values[0][4] is not first


def _graph(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str]) -> bytes:
    """Float32 inputs and outputs of any shape."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in outputs],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8
    ).SerializeToString()


def _runnable(model: bytes) -> session.RunnableSession:
    dlpack.use_inference_dlpack()
    device = torch.device("cpu")
    made, _ = session.create(model, device, session.SessionSettings(threads=1), "Test", False)
    return session.RunnableSession.of(made, device, None)


def test_feeds_by_address_and_through_dlpack_keep_their_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a - b - c - d: any feed out of place changes the numbers
    program = _runnable(
        _graph(
            [
                helper.make_node("Sub", ["a", "b"], ["ab"]),
                helper.make_node("Sub", ["ab", "c"], ["abc"]),
                helper.make_node("Sub", ["abc", "d"], ["y"]),
            ],
            ["a", "b", "c", "d"],
            ["y"],
        )
    )
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.arange(6.0).reshape(3, 2).t() * 10  # not dense: through DLPack, as a copy
    c = torch.full((2, 3), 100.0)
    d = torch.full((1,), 1000.0)
    assert c.is_contiguous() and not b.is_contiguous()
    runs: list[tuple[int, int]] = []
    by_address = dlpack._by_address

    def spied(vector: object, tensors: list[torch.Tensor], start: int) -> int:
        stop = by_address(vector, tensors, start)
        runs.append((start, stop))
        return stop

    monkeypatch.setattr(dlpack, "_by_address", spied)
    (y,) = program.run([a, b, c, d])
    assert torch.equal(y, a - b - c - d)
    # the inference build: a, then c and d, by address; the training build: all by DLPack
    assert runs == ([(0, 1), (2, 4)] if dlpack._CPU is not None else [])


def test_an_empty_feed_is_read_as_empty() -> None:
    (y,) = _program().run([torch.zeros(0, 3)])
    assert y.shape == (0, 3)


@pytest.mark.parametrize("op", ["Identity", "Reshape", "Flatten"])
def test_an_output_never_shares_a_feeds_memory(op: str) -> None:
    """Feeds by address are not owned by ORT: an output aliasing one would read freed memory
    once the caller dropped it. ORT copies such outputs; this holds it to that."""
    nodes = [helper.make_node(op, ["x", "shape"] if op == "Reshape" else ["x"], ["y"])]
    inputs = ["x"]
    if op == "Reshape":
        shape = helper.make_tensor("s", onnx.TensorProto.INT64, [1], [-1])
        nodes.insert(0, helper.make_node("Constant", [], ["shape"], value=shape))
    program = _runnable(_graph(nodes, inputs, ["y"]))
    x = torch.arange(12.0).reshape(3, 4)
    (y,) = program.run([x])
    assert y.data_ptr() != x.data_ptr()
    x.fill_(-1.0)
    assert torch.equal(y.reshape(3, 4), torch.arange(12.0).reshape(3, 4))


def test_a_size_one_dim_with_odd_strides_is_made_dense_for_ort() -> None:
    odd = torch.empty_strided((1, 3), (7, 1))
    assert odd.is_contiguous() and dlpack.dense(odd).stride() == (3, 1)
    dense = torch.zeros(2, 3)
    assert dlpack.dense(dense) is dense


def test_a_failed_run_is_one_typed_error_naming_the_phase_and_the_remedy() -> None:
    program = _program()
    with pytest.raises(Exception) as raised:
        program.run([torch.zeros(2, 3, dtype=torch.float64)])  # the graph takes float32
    error = session.execution_error("Test", "backward", raised.value)
    assert isinstance(error, ExecutionError) and error.reason == "execution failed"
    assert "ONNX Runtime backward failed" in error.cause
    assert "later training calls run in PyTorch" in error.remedy
    assert session.execution_error("Test", "forward", raised.value).remedy == "Run eagerly"
    # a segment of a cut graph named its failure already: not wrapped in a second one
    assert session.execution_error("Test", "forward", error) is error


def test_batch_norm_statistics_follow_pytorchs_cumulative_average() -> None:
    from ort_autopatch.engine.backends.ort_training.run import BatchNormUpdate

    bn = torch.nn.BatchNorm1d(2, momentum=None)
    update = BatchNormUpdate(weakref.ref(bn), 0, 1)
    update.apply([torch.tensor([2.0, 4.0]), torch.tensor([3.0, 5.0])])
    update.apply([torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])])
    assert int(bn.num_batches_tracked) == 2
    assert torch.allclose(bn.running_mean, torch.tensor([1.0, 2.0]))
    assert torch.allclose(bn.running_var, torch.tensor([2.0, 3.0]))
