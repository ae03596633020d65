"""rng.py: the tool's own seeds follow torch.manual_seed without drawing from torch's stream."""

from __future__ import annotations

import onnx
import torch
from onnx import helper

from ort_autopatch.engine import rng


def test_taking_seeds_leaves_torch_generator_where_it_was() -> None:
    torch.manual_seed(3)
    state = torch.get_rng_state()
    rng.next_seed()
    rng.next_seed("session")
    assert torch.equal(torch.get_rng_state(), state)


def test_the_same_manual_seed_gives_the_same_seeds() -> None:
    torch.manual_seed(5)
    first = [rng.next_seed() for _ in range(3)]
    torch.manual_seed(5)
    assert [rng.next_seed() for _ in range(3)] == first
    assert len(set(first)) == 3


def test_streams_are_independent() -> None:
    torch.manual_seed(7)
    runs = [rng.next_seed("run") for _ in range(2)]
    torch.manual_seed(7)
    rng.next_seed("session")
    assert [rng.next_seed("run") for _ in range(2)] == runs


def _dropout(inputs: list[str]) -> onnx.ModelProto:
    node = helper.make_node("Dropout", inputs, ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in inputs if n],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph)


def test_only_a_dropout_given_a_training_mode_draws_per_run() -> None:
    assert rng.draws_per_run(_dropout(["x", "ratio", "training"]))
    assert not rng.draws_per_run(_dropout(["x", "ratio"]))
