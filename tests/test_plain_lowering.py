"""The lowering's own registry of the exporter's op library against the exporter's full one:
the same functions for every operator, the same operators named as translated."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.plain_helpers import PLAIN_READY, SKIP_REASON, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)


def _full_registry() -> Any:
    from torch.onnx._internal.exporter import _registration

    from ort_autopatch.engine.backends.ort import lowering

    return _registration.ONNXRegistry.from_torchlib(lowering.OPSET)


def test_the_graph_registry_gives_each_operator_the_full_registrys_functions() -> None:
    from ort_autopatch.engine.backends.ort import lowering

    full = _full_registry()
    functions = full.functions
    ours = lowering.registry_for(metas[0].fx_target for metas in functions.values())
    # besides torchlib's: our own operators' translations, once a graph had them
    own = {op.name() for op in lowering.our_translations()}
    assert set(ours.functions) - own == set(functions)
    for key, metas in functions.items():
        # ours for torchlib's operators come first (custom), then torchlib's own
        got = [m for m in ours.functions[key] if m.onnx_function is not lowering.OWN.get(key)]
        assert [(m.onnx_function, m.is_complex) for m in got] == [
            (m.onnx_function, m.is_complex) for m in metas
        ], key
        assert all(m.signature is not None or m.skip_signature_inference for m in got), key


def test_the_operators_named_as_translated_are_the_full_registrys() -> None:
    from torch.onnx._internal.exporter import _decomp

    from ort_autopatch.engine.backends.ort import lowering

    full = set(_decomp.get_onnx_implemented_overloads(_full_registry()))
    assert lowering.implemented() == full


def test_the_exporters_passes_run_under_the_export_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The type-promotion pass sets torch.fx's process-wide `preserve_node_meta` flag and puts
    back what it found: outside the lock every trace holds, a lowering in one thread ended
    another thread's aot trace under way ("expected preserved node meta")."""
    import threading

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.onnx._internal.exporter import _fx_passes

    from ort_autopatch.engine.backends.ort import lowering
    from ort_autopatch.engine.calls import EXPORT_LOCK

    free_to_others: list[bool] = []
    promote = _fx_passes.insert_type_promotion_nodes

    def probed(gm: torch.fx.GraphModule) -> None:
        def probe() -> None:  # another thread's trace: may it start now?
            taken = EXPORT_LOCK.acquire(blocking=False)
            if taken:
                EXPORT_LOCK.release()
            free_to_others.append(taken)

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        promote(gm)

    monkeypatch.setattr(_fx_passes, "insert_type_promotion_nodes", probed)
    gm = make_fx(lambda x: torch.relu(x) + 1, tracing_mode="fake")(torch.randn(3))
    assert lowering.to_onnx(gm, "Net", "forward")
    assert free_to_others == [False]


def test_symbolic_floor_division_of_a_negative_size_rounds_down_as_python() -> None:
    """`-(-n // 2)` (a ceiling) on a symbolic size: with ONNX's truncating Div the graph
    traced for symbolic sizes returned n // 2 columns for odd n, not eager's (n + 1) // 2."""
    import operator

    import torch

    from ort_autopatch.engine import ModuleEngine
    from ort_autopatch.engine.backends.ort import lowering
    from ort_autopatch.engine.recipe import EngineOptions

    assert operator.floordiv in lowering.OWN

    class Halves(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, : -(-x.shape[1] // 2)] * self.w

    model = Halves()
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1))
    for length in (4, 4, 5, 7, 6, 9):
        x = torch.randn(2, length, requires_grad=True)
        y = engine(x)
        assert ran_in_plain_ort(y)
        torch.testing.assert_close(y, x[:, : (length + 1) // 2] * 2.0)
        y.sum().backward()
        assert x.grad is not None and float(x.grad.sum()) == 2.0 * 2 * ((length + 1) // 2)
    assert [r.dynamic for r in engine.records] == [False, True]


class _Mixed(torch.nn.Module):
    """Arithmetic across dtypes, where ATen promotes implicitly: the promotion pass casts."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * (ids > 1) + ids
        return torch.where(ids > 2, y, 0) / 3 + ids // 2 + x.half().sum(-1, keepdim=True)


def _graphs_of(name: str, promoted: bool = True) -> list[Any]:
    """A model's captured forward and backward graphs, types promoted (`promoted`)."""
    import torch
    from torch import nn

    from ort_autopatch.engine import signature
    from ort_autopatch.engine.backends.ort import capture, decompositions, lowering

    torch.manual_seed(0)
    model, args = {
        "transformer": lambda: (
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
            (torch.randn(2, 5, 16),),
        ),
        "conv_batchnorm_pool": lambda: (
            nn.Sequential(
                nn.Conv2d(3, 4, 3, padding=1),
                nn.BatchNorm2d(4),
                nn.ReLU(),
                nn.AvgPool2d(2),
                nn.Flatten(),
                nn.Linear(16, 3),
            ),
            (torch.randn(2, 3, 4, 4),),
        ),
        "activations_and_norms": lambda: (
            nn.Sequential(
                nn.Embedding(10, 8),
                nn.LayerNorm(8),
                nn.GELU(approximate="tanh"),
                nn.Linear(8, 8),
                nn.LeakyReLU(0.2),
                nn.LogSoftmax(-1),
            ),
            (torch.randint(0, 10, (2, 5)),),
        ),
        "mixed_dtypes": lambda: (_Mixed(), (torch.randn(3, 4), torch.randint(0, 4, (3, 4)))),
    }[name]()
    call = signature.flatten_call("M", args, {})
    captured = capture.capture(
        model, lambda m, *a, **k: m(*a, **k), call.spec(), call.tensors, "M", decompositions.table()
    )
    graphs = [g for g in (captured.forward, captured.backward) if g is not None]
    for graph in graphs:
        if promoted:
            lowering.promote_types(graph)
    return graphs


def _nodes(gm: Any) -> list[tuple[Any, ...]]:
    """A graph node by node: what it computes, from what, and its value's type and size."""

    def described(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (value.dtype, tuple(value.shape))
        if isinstance(value, (list, tuple)):
            return tuple(described(v) for v in value)
        return type(value).__name__

    return [
        (n.op, n.name, str(n.target), str(n.args), str(n.kwargs), described(n.meta.get("val")))
        for n in gm.graph.nodes
    ]


@pytest.mark.parametrize(
    "name", ["transformer", "conv_batchnorm_pool", "activations_and_norms", "mixed_dtypes"]
)
def test_type_promotion_from_the_traces_values_gives_the_exporters_graph(name: str) -> None:
    """`promote_types` reads each node's value from its meta instead of running the node on
    fake tensors again: the graph it gives is the exporter's pass's, cast for cast."""
    from torch.onnx._internal.fx.passes import type_promotion

    from ort_autopatch.engine.backends.ort.trace_context import real_constants_allowed

    ours = _graphs_of(name)
    theirs = _graphs_of(name, promoted=False)
    for graph in theirs:
        with real_constants_allowed():
            type_promotion.InsertTypePromotion(graph).run()
    assert [_nodes(g) for g in ours] == [_nodes(g) for g in theirs]
    if name == "mixed_dtypes":  # the pass had casts to insert
        untouched = _graphs_of(name, promoted=False)
        assert [_nodes(g) for g in ours] != [_nodes(g) for g in untouched]


@pytest.mark.parametrize("name", ["transformer", "conv_batchnorm_pool", "activations_and_norms"])
def test_signatures_made_once_translate_to_the_bytes_made_each_time(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Reusing the ONNX operators' signatures (`_signatures_reused`) changes no byte of a
    graph's translation, translated twice over (the second time from signatures reused
    across graphs)."""
    import contextlib

    from ort_autopatch.engine.backends.ort import lowering

    graphs = _graphs_of(name)
    reused = [lowering.to_onnx(g, "M", f"graph{k}", True) for k, g in enumerate(graphs)]
    again = [lowering.to_onnx(g, "M", f"graph{k}", True) for k, g in enumerate(graphs)]
    monkeypatch.setattr(lowering, "_signatures_reused", contextlib.nullcontext)
    made = [lowering.to_onnx(g, "M", f"graph{k}", True) for k, g in enumerate(graphs)]
    assert reused == made and again == made


def test_a_lowered_graph_carries_no_metadata_per_node() -> None:
    """The translator's metadata of each node (the FX node printed, its stack trace and
    module path) is left out: nothing reads it, and it was most of a graph's bytes. The
    exporter's own function is back in place after the lowering."""
    import onnx
    from torch.onnx._internal.exporter import _core

    from ort_autopatch.engine.backends.ort import lowering

    writer = _core._set_node_metadata
    for k, graph in enumerate(_graphs_of("conv_batchnorm_pool")):
        model = onnx.load_from_string(lowering.to_onnx(graph, "M", f"graph{k}", True))
        assert model.graph.node
        assert [n.name for n in model.graph.node if n.metadata_props] == []
    assert _core._set_node_metadata is writer


@pytest.mark.parametrize("name", ["transformer", "conv_batchnorm_pool", "activations_and_norms"])
def test_attribute_lists_typed_first_translate_to_the_bytes_onnx_ir_gives(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Typing lists of numbers before onnx_ir's Protocol checks (`_number_lists_typed_first`)
    changes no byte of a graph's translation; onnx_ir's own function is back afterwards."""
    import contextlib

    from onnx_ir import _convenience

    from ort_autopatch.engine.backends.ort import lowering

    infer = _convenience._infer_attribute_type
    graphs = _graphs_of(name)
    fast = [lowering.to_onnx(g, "M", f"graph{k}", True) for k, g in enumerate(graphs)]
    assert _convenience._infer_attribute_type is infer
    monkeypatch.setattr(lowering, "_number_lists_typed_first", contextlib.nullcontext)
    made = [lowering.to_onnx(g, "M", f"graph{k}", True) for k, g in enumerate(graphs)]
    assert fast == made


@pytest.mark.parametrize(
    ("module", "name", "rebinding"),
    [
        ("torch.onnx._internal.exporter._core", "_set_node_metadata", "_without_node_metadata"),
        ("onnx_ir._convenience", "_infer_attribute_type", "_number_lists_typed_first"),
    ],
)
def test_a_rebinding_whose_function_is_gone_leaves_the_library_as_it_is(
    monkeypatch: pytest.MonkeyPatch, module: str, name: str, rebinding: str
) -> None:
    """A torch or onnx_ir that renamed the private function a lowering speed-up rebinds is
    lowered as that version lowers, not refused."""
    import importlib

    from ort_autopatch.engine.backends.ort import lowering

    target = importlib.import_module(module)
    monkeypatch.delattr(target, name)
    with getattr(lowering, rebinding)():
        assert not hasattr(target, name)
    assert not hasattr(target, name)


def test_each_reused_signature_has_its_own_lists_and_default_attributes() -> None:
    """A node takes a default attribute in as it is: no two translations share one."""
    import onnx
    from onnx_ir import schemas

    from ort_autopatch.engine.backends.ort import lowering

    schema = onnx.defs.get_schema("LeakyRelu", lowering.OPSET, "")
    with lowering._signatures_reused():
        one = schemas.OpSignature.from_op_schema(schema)
        two = schemas.OpSignature.from_op_schema(schema)
    made = schemas.OpSignature.from_op_schema(schema)  # (unpatched again)
    assert one == two == made
    assert one.params is not two.params and one.outputs is not two.outputs
    (alpha,) = (p for p in one.params if p.name == "alpha")
    (other,) = (p for p in two.params if p.name == "alpha")
    assert alpha.default is not None and alpha.default is not other.default
    assert alpha.default.value == other.default.value


@pytest.mark.parametrize("finished_in_torch", [False, True])
def test_a_rewrite_that_fails_is_an_export_error_the_fallback_takes(
    monkeypatch: pytest.MonkeyPatch, finished_in_torch: bool
) -> None:
    """A rewrite of the translated graph (`onnx_passes`) that raises is the graph's failure,
    named with its cause, which the fallback policy sends to PyTorch: never an exception of
    another kind in the user's run."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import lowering, onnx_passes
    from ort_autopatch.engine.errors import ExportError

    def broken(graph: Any) -> Any:
        raise ValueError("a node that does not belong to this graph")

    name = "reshapes_into_outputs_left_to_torch" if finished_in_torch else "cleaned"
    monkeypatch.setattr(onnx_passes, name, broken)
    gm = make_fx(lambda x: torch.relu(x).reshape(3, 1) + 1, tracing_mode="fake")(torch.randn(3))
    with pytest.raises(ExportError, match="rewriting the forward graph in ONNX failed: ValueError"):
        lowering.to_onnx(gm, "Net", "forward", finished_in_torch=finished_in_torch)
