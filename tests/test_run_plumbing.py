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


def test_a_kept_value_reads_in_place_updates_and_a_replaced_tensor_is_wrapped_again() -> None:
    program, kept = _program(rank=1), dlpack.KeptValues([0])
    w = torch.zeros(3)
    program.run([w], kept)
    first = kept.values[0][4]
    w.add_(2)  # an optimizer step: same memory
    (y,) = program.run([w], kept)
    assert torch.equal(y, torch.full((3,), 3.0)) and kept.values[0][4] is first
    w = torch.ones(3)  # new memory
    (y,) = program.run([w], kept)
    assert torch.equal(y, torch.full((3,), 2.0)) and kept.values[0][4] is not first


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
