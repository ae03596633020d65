"""passes.py: the pass pipeline is declared once and the cache version follows it."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from ort_autopatch.engine.backends.ort_training import passes


def _model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["traced_7"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("traced_7", onnx.TensorProto.FLOAT, [2, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_forward_stage_names_outputs_and_counts_them() -> None:
    model = _model()
    done = passes.apply_forward(model, has_backward=True, padding={})
    assert [o.name for o in model.graph.output] == ["output_0"]
    assert (done.num_user_outputs, done.frozen, done.batch_norms) == (1, [], [])


def test_every_declared_pass_has_its_own_name() -> None:
    names = [p.name for p in passes.FORWARD + passes.GRADIENT]
    assert len(names) == len(set(names))


def test_the_cache_version_changes_with_the_declared_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    derive = passes.version.__wrapped__
    before = derive()
    assert derive() == before
    monkeypatch.setattr(passes, "FORWARD", passes.FORWARD[1:])
    assert derive() != before


def test_the_training_builds_cache_version_covers_the_exporters_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Besides the passes, what the TorchScript export writes decides the stored graphs: its
    call protocol, the extra symbolics and the routing of operators to torch."""
    from ort_autopatch.engine.backends.ort_training import payload

    derive = payload.graph_version.__wrapped__
    before = derive()
    assert set(payload._EXPORT_SOURCES) >= {"export.py", "symbolics.py"}
    for dropped in payload._EXPORT_SOURCES:
        kept = tuple(n for n in payload._EXPORT_SOURCES if n != dropped)
        monkeypatch.setattr(payload, "_EXPORT_SOURCES", kept)
        assert derive() != before, dropped
