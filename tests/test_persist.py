"""persist.py on its own: keys that mean the same in every process, recipes through JSON."""

from __future__ import annotations

import json

import torch
from torch.utils import _pytree as pytree

from ort_autopatch.engine import calls, hazards, persist
from ort_autopatch.engine.backends.ort_training import agent
from ort_autopatch.engine.backends.ort_training.backend import OrtTrainingBackend
from ort_autopatch.engine.backends.ort_training.payload import OrtTrainingPayload
from ort_autopatch.engine.recipe import Recipe
from ort_autopatch.engine.state import ModuleState
from ort_autopatch.engine.store import StoredEntry


class _Config:
    def __init__(self) -> None:
        self.width = 4


def test_stable_repr_holds_no_memory_address() -> None:
    text = persist.stable_repr([_Config(), print, torch.zeros(2)])
    assert " at 0x" not in text and "_Config" in text
    assert persist.stable_repr(torch.zeros(2)) != persist.stable_repr(torch.ones(2))


def _key(backend: str, opset: int = 17, graph_version: str = "g") -> str:
    return persist.static_key(
        cls="Net",
        backend=backend,
        graph_version=graph_version,
        sources="s",
        state=ModuleState(torch.nn.Linear(2, 2)),
        key={"grad": True},
        device=torch.device("cpu"),
        opset=opset,
    )


def test_the_static_key_names_the_backend_and_the_opset() -> None:
    assert _key("ort-training") == _key("ort-training")
    assert len({_key("ort-training"), _key("ort"), _key("ort-training", 18)}) == 3


def test_the_static_key_names_the_backends_graph_version() -> None:
    assert _key("ort", graph_version="a") != _key("ort", graph_version="b")


def _forward() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["output_0"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("output_0", TensorProto.FLOAT, ["n"])],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8
    ).SerializeToString()


def test_a_recipe_survives_json_and_back() -> None:
    _, spec = pytree.tree_flatten((torch.zeros(1), 3))
    recipe = Recipe(
        backend=OrtTrainingBackend.name,
        has_backward=False,
        forward_model=_forward(),
        payload=OrtTrainingPayload(None),
        feed_sources={"x": ("input", 0)},
        num_user_outputs=1,
        output_spec=calls.OutputSpec(spec, [None, 3], [0]),
        batch_norms=[("bn", 1, 2)],
        seeds_dropout=True,
        checks=[hazards.Check(4, hazards.Hazard(hazards.SHAPE, "size", "m.py:3"))],
        traced_shapes=((2, 3),),
    )
    meta = persist.meta_of(recipe)
    assert meta is not None
    stored = StoredEntry(json.loads(json.dumps(meta)), persist.graphs_of(recipe))
    back = persist.recipe_from(stored, "Net", OrtTrainingBackend)
    assert back is not None
    assert back == recipe


def test_a_recipe_another_backend_built_is_not_loaded() -> None:
    recipe = Recipe(
        "ort",
        False,
        _forward(),
        OrtTrainingPayload(None),
        {"x": ("input", 0)},
        1,
        calls.OutputSpec(pytree.tree_flatten(torch.zeros(1))[1], [None], [0]),
        [],
        False,
    )
    meta = persist.meta_of(recipe)
    assert meta is not None
    assert (
        persist.recipe_from(StoredEntry(meta, persist.graphs_of(recipe)), "N", OrtTrainingBackend)
        is None
    )


def test_a_gradient_payload_round_trips() -> None:
    gradient = agent.GradientGraph(_forward(), 2, 1, [1], [0], {"x": "x_grad"})
    payload = OrtTrainingPayload(gradient, optimized=None)
    back = OrtTrainingBackend.payload_from(
        json.loads(json.dumps(payload.meta())), {"forward": _forward(), **payload.graphs()}
    )
    assert back == payload
