"""The plain backend's torch nodes: an operator ONNX cannot express runs in torch between ORT
segments of the graph (`backends/ort/torch_nodes.py`), so its class keeps the rest in ONNX
Runtime instead of running in PyTorch. Patched with fallback disabled: a call that did not run
through the plain backend raises or counts as eager."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch import patcher
from ort_autopatch.config import Fallback
from ort_autopatch.engine import EngineOptions, ExportError, ModuleEngine
from tests.helpers import class_stats, patched
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, PlainCall, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)

PLAIN = EngineOptions(backend="ort", threads=1)


class TrigammaBetweenLayers(nn.Module):
    """polygamma has no translation in torchlib, in forward (trigamma) nor in backward (its
    gradient is polygamma(2, x)); BatchNorm's statistics are buffers forward updates."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.last = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.norm(self.first(x))) + 0.5  # polygamma's poles stay away
        return self.last(torch.polygamma(1, h))


@pytest.fixture
def _patched() -> Iterator[None]:
    settings = patcher.Settings(fallback=Fallback.FALLBACK_DISABLE, engine=PLAIN)
    yield from patched([TrigammaBetweenLayers], settings)


def _step_matches(
    call: Callable[[torch.Tensor], torch.Tensor],
    eager: Callable[[torch.Tensor], torch.Tensor],
    model: nn.Module,
    twin: nn.Module,
    rows: int,
    what: str,
) -> None:
    """One training step through `call` in ORT and through `eager` on `twin`: the same
    outputs, input gradients and parameter gradients."""
    x = torch.randn(rows, 6, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    model.zero_grad()
    twin.zero_grad()
    out, expected = call(x), eager(x_twin)
    assert ran_in_plain_ort(out), f"{what} ran elsewhere"
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_twin.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.usefixtures("_patched")
def test_an_operator_with_no_onnx_form_runs_in_torch_between_ort_segments() -> None:
    torch.manual_seed(0)
    model = TrigammaBetweenLayers()
    twin = copy.deepcopy(model)
    forward = TrigammaBetweenLayers.forward
    for step in range(3):
        _step_matches(model, lambda x: forward(twin, x), model, twin, 5, f"call {step}")
        for a, b in zip(model.buffers(), twin.buffers(), strict=True):
            torch.testing.assert_close(a, b)
    stats = class_stats(TrigammaBetweenLayers)
    assert stats.ort_calls == 3 and not stats.eager_calls, (stats.ort_calls, stats.fallbacks)
    # forward's trigamma and backward's polygamma(2, x): one node in each graph
    assert dict(stats.torch_nodes) == {"aten::polygamma": 2}


def test_the_engine_records_its_torch_nodes_and_cuts_no_other_graph() -> None:
    torch.manual_seed(0)
    engine = ModuleEngine(TrigammaBetweenLayers(), PLAIN)
    out = engine(torch.randn(4, 6))
    assert ran_in_plain_ort(out)
    assert engine.records[0].torch_nodes == {"aten::polygamma": 2}
    # a graph ONNX expresses whole stays one session per graph
    plain = PlainCall(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), torch.randn(4, 6))
    assert not plain.lowered.splits and plain.program.torch_nodes == {}
    assert set(plain.lowered.graphs()) == {"forward", "backward"}


def test_a_cut_graph_traced_with_symbolic_sizes_serves_other_batch_sizes() -> None:
    """The second batch size is traced with symbolic sizes: the segments' sessions and the
    torch nodes between them take every later size, with eager's outputs and gradients."""
    torch.manual_seed(0)
    model = TrigammaBetweenLayers()
    twin = copy.deepcopy(model)
    engine = ModuleEngine(model, PLAIN)
    for rows in (5, 7, 3, 9):
        _step_matches(engine, twin, model, twin, rows, f"{rows} rows")
    assert [r.dynamic for r in engine.records] == [False, True]
    assert all(r.torch_nodes == {"aten::polygamma": 2} for r in engine.records)


class DrawsBesideTrigamma(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.polygamma(1, nn.functional.dropout(x, 0.5, training=True).abs() + 1)


def test_a_cut_graph_with_dropout_is_refused_rather_than_drawn_out_of_order() -> None:
    engine = ModuleEngine(DrawsBesideTrigamma(), PLAIN)
    with pytest.raises(ExportError, match="random ones ONNX Runtime seeds"):
        engine(torch.randn(4, 6, requires_grad=True))


@torch.library.custom_op("ort_autopatch_tests::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    """A library operator of the user's: no exporter knows it."""
    return limit * torch.tanh(x / limit)


@soft_clip.register_fake
def _soft_clip_fake(x: torch.Tensor, limit: float) -> torch.Tensor:
    return torch.empty_like(x)


def _soft_clip_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.limit = inputs[1]


def _soft_clip_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    (x,) = ctx.saved_tensors
    return grad * (1 - torch.tanh(x / ctx.limit) ** 2), None


soft_clip.register_autograd(_soft_clip_backward, setup_context=_soft_clip_setup)


class SoftClipBetweenLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(soft_clip(self.first(x), 2.0))


def test_a_library_operator_runs_in_torch_and_its_gradient_in_ort() -> None:
    """forward calls the user's operator in torch; its registered backward traces to ATen,
    which ORT runs: backward is one graph."""
    torch.manual_seed(0)
    model = SoftClipBetweenLayers()
    twin = copy.deepcopy(model)
    engine = ModuleEngine(model, PLAIN)
    for batch in (3, 5, 7):  # the second shape builds a graph with symbolic sizes
        x = torch.randn(batch, 4)
        out, expected = engine(x), twin(x)
        assert ran_in_plain_ort(out)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        model.zero_grad()
        twin.zero_grad()
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert [r.torch_nodes for r in engine.records] == [{"ort_autopatch_tests::soft_clip": 1}] * 2


@torch.library.custom_op("ort_autopatch_tests::scale_in_place", mutates_args=("x",))
def scale_in_place(x: torch.Tensor) -> None:
    x.mul_(2)


@scale_in_place.register_fake
def _scale_in_place_fake(x: torch.Tensor) -> None:
    return None


class ScalesInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.5
        scale_in_place(y)
        return y.sum(dim=1)


def test_a_library_operator_writing_into_its_argument_is_refused() -> None:
    engine = ModuleEngine(ScalesInPlace(), PLAIN)
    with pytest.raises(ExportError, match=r"auto_functionalized.* is no ATen or library operator"):
        engine(torch.randn(3, 4, requires_grad=True))


class StrideScaled(nn.Module):
    """A stride that is a symbolic size once sizes vary: `aten.sym_stride` in the graph traced
    with symbolic sizes, which torchlib does not translate (T5's attention has one)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        columns = self.fc(x).t().contiguous()  # (4, n): its first stride is n
        return columns * columns.stride(0)


def test_a_size_query_is_no_torch_node_the_graphs_follow_each_shape() -> None:
    """Cut at `sym_stride`, the graph's run failed ("'int' object has no attribute
    'detach'"): a size is no tensor to hand between sessions. The symbolic trace is refused
    and each shape gets a graph traced for it, in ORT, with eager's numbers."""
    torch.manual_seed(0)
    model = StrideScaled()
    twin = copy.deepcopy(model)
    engine = ModuleEngine(model, PLAIN)
    for rows in (3, 5, 7):
        x = torch.randn(rows, 4, requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        out, expected = engine(x), twin(x_twin)
        assert ran_in_plain_ort(out), f"{rows} rows ran elsewhere"
        torch.testing.assert_close(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        torch.testing.assert_close(x.grad, x_twin.grad)
    assert [r.torch_nodes for r in engine.records] == [{}, {}, {}]
    assert [r.per_shape for r in engine.records] == [False, True, True]
