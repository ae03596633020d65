"""random_ops.py: the one place that says which operators draw random numbers."""

from __future__ import annotations

import onnx
import pytest

from ort_autopatch.engine import random_ops


@pytest.mark.parametrize(
    "name",
    [
        "aten::dropout",
        "aten::native_dropout",
        "aten::randn_like",
        "aten::bernoulli_",
        "aten::uniform_",
        "aten::multinomial",
        "aten::rrelu",
        "aten::lstm",
        "aten::scaled_dot_product_attention",
    ],
)
def test_random_aten_operators_are_known(name: str) -> None:
    assert random_ops.aten(name)


@pytest.mark.parametrize(
    "name", ["aten::add", "aten::layer_norm", "aten::batch_norm", "aten::poisson_nll_loss"]
)
def test_deterministic_aten_operators_are_not_random(name: str) -> None:
    assert not random_ops.aten(name)


def test_ort_fused_dropouts_are_random_per_run() -> None:
    assert {"BitmaskDropout", "BiasDropout"} <= random_ops.ONNX_PER_RUN <= random_ops.ONNX


def _model_with_a_function(op: str, training_mode: bool = False) -> onnx.ModelProto:
    """A graph calling one local function (as torchlib writes some ATen operators) whose body
    holds the random operator `op`; a Dropout gets a ratio and, if asked, training_mode."""
    from onnx import TensorProto, helper

    if op == "Dropout":
        body = [
            helper.make_node(
                "Constant",
                [],
                ["ratio"],
                value=helper.make_tensor("r", TensorProto.FLOAT, [], [0.3]),
            ),
            helper.make_node(
                "Constant", [], ["on"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])
            ),
            helper.make_node("Dropout", ["x", "ratio", *(["on"] if training_mode else [])], ["y"]),
        ]
    else:
        body = [helper.make_node(op, ["x"], ["y"])]
    function = helper.make_function(
        "pkg.torch", "aten_draw", ["x"], ["y"], body, [helper.make_opsetid("", 18)]
    )
    graph = helper.make_graph(
        [helper.make_node("aten_draw", ["x"], ["y"], domain="pkg.torch")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    return helper.make_model(
        graph,
        functions=[function],
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("pkg.torch", 1)],
    )


@pytest.mark.parametrize("op", ["RandomUniformLike", "RandomNormalLike", "Bernoulli"])
def test_per_session_random_operators_inside_a_function_are_found(op: str) -> None:
    from ort_autopatch.engine import rng, verify

    model = _model_with_a_function(op)
    assert [n.op_type for n in model.graph.node] == ["aten_draw"]
    assert random_ops.per_session(model) == [op]
    assert verify.random_ops(model) == [op]  # the first-call check does not compare it
    assert not rng.draws_per_run(model)  # no run's seed reaches it


def test_a_dropout_in_training_mode_inside_a_function_is_seeded_per_run() -> None:
    from ort_autopatch.engine import rng, verify

    model = _model_with_a_function("Dropout", training_mode=True)
    assert rng.draws_per_run(model)
    assert verify.random_ops(model) == ["Dropout"]
    assert random_ops.per_session(model) == []


def test_a_dropout_without_training_mode_inside_a_function_draws_nothing_per_run() -> None:
    from ort_autopatch.engine import rng

    assert not rng.draws_per_run(_model_with_a_function("Dropout"))


def test_random_operators_inside_a_subgraph_are_found() -> None:
    from onnx import TensorProto, helper

    branch = helper.make_graph(
        [helper.make_node("RandomNormalLike", ["x"], ["z"])],
        "then",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)],
        "g",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    assert random_ops.per_session(helper.make_model(graph)) == ["RandomNormalLike"]
