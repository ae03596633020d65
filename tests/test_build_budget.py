"""A build that would cost more than the calls it could speed up gives up, says why, and lets
the class run in PyTorch: a graph too large (a loop unrolled over many steps), a build too slow,
a module that rebuilds on almost every call."""

from __future__ import annotations

import json
import pathlib
import resource
import textwrap
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.onnx._internal.torchscript_exporter import utils as exporter_utils

from ort_autopatch.engine import budget, calls
from ort_autopatch.engine.backends.ort_training import export
from ort_autopatch.engine.errors import BuildOverBudget
from ort_autopatch.engine.module_engine import EngineOptions, ModuleEngine
from tests.helpers import assert_close, plain_backend
from tests.proc_helpers import LAUNCHER, PY, run


class Unrolled(nn.Module):
    """An LSTMCell over every time step, as pytorch/examples' time_sequence_prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(1, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[0], 8)
        outputs = []
        for x_t in x.split(1, dim=1):
            h, c = self.cell(x_t, (h, c))
            outputs.append(self.head(h))
        return torch.cat(outputs, dim=1)


class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, pause: float = 0.0) -> torch.Tensor:
        time.sleep(pause)
        for _ in range(40):
            x = torch.tanh(self.fc(x))
        return x


def _exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the engine's exports (the plain backend's: its traces)."""
    made: list[int] = []
    if plain_backend():
        from ort_autopatch.engine.backends.ort import capture as where

        name = "capture"
    else:
        where, name = export, "export_call"
    traced = getattr(where, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return traced(*args, **kwargs)

    monkeypatch.setattr(where, name, counted)
    return made


def _assert_torch_restored() -> None:
    """Nothing of the stopped export is left behind: hooks out, export lock free."""
    assert torch.nn.Module._slow_forward.__qualname__ == "Module._slow_forward"
    assert exporter_utils._optimize_graph.__module__ == exporter_utils.__name__
    assert torch.jit._trace._create_interpreter_name_lookup_fn.__module__ == "torch.jit._trace"
    assert calls.EXPORT_LOCK.acquire(blocking=False)
    calls.EXPORT_LOCK.release()


def test_a_trace_past_the_node_limit_stops_in_the_middle_of_the_trace() -> None:
    model = Unrolled().eval()
    engine = ModuleEngine(model, EngineOptions(max_graph_nodes=2000))
    x = torch.randn(2, 1000)
    started = time.perf_counter()
    with torch.no_grad(), pytest.raises(BuildOverBudget) as refused:
        engine(x)
    assert time.perf_counter() - started < 60
    assert "forward traces to more than 2000 graph nodes" in refused.value.cause
    assert "by the middle of the trace" in refused.value.cause
    assert refused.value.reason == "build over budget"
    _assert_torch_restored()


def test_operators_counted_before_a_trace_stop_a_run_past_the_node_limit() -> None:
    """The plain backend runs forward on the call's tensors before aot's trace, counting its
    operators: a loop past the limit stops at eager's speed, long before its end."""
    steps: list[int] = []

    def run() -> None:
        x = torch.ones(2)
        for step in range(1000):
            steps.append(step)
            x = torch.tanh(x) * 2

    with budget.limited("Loop", budget.Limits(nodes=100)):
        with pytest.raises(BuildOverBudget) as refused:
            budget.count_run(run)
    assert "forward traces to more than 100 graph nodes" in refused.value.cause
    assert 50 <= len(steps) <= 51  # two operators a step


def test_the_counting_run_writes_only_into_memory_it_made() -> None:
    """A write into a tensor the run did not make (a parameter, an input, a buffer) lands in
    a copy: the trace and the call after it see every tensor as the user left it."""
    weight, x = torch.ones(3), torch.zeros(3)
    made: list[torch.Tensor] = []

    def run() -> None:
        x.add_(1)
        weight[0].mul_(2)  # a view's write reaches its base
        torch.mul(x, 3, out=weight)
        own = x * 2
        own.add_(1)  # its own memory: written as eager writes it
        made.append(own)

    with budget.limited("Net", budget.Limits(nodes=100)):
        budget.count_run(run)
    assert x.tolist() == [0.0] * 3 and weight.tolist() == [1.0] * 3
    assert made[0].tolist() == [1.0] * 3  # x as it was, times two, plus one


def test_a_refused_key_is_not_traced_again_after_the_cache_evicts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = _exports(monkeypatch)
    model = Unrolled().eval()
    engine = ModuleEngine(model, EngineOptions(max_graph_nodes=2000, cache_size=1))
    long, short = torch.randn(2, 1000), torch.randn(2, 5)
    with torch.no_grad():
        with pytest.raises(BuildOverBudget):
            engine(long)
        model.train()  # another key, whose graph takes the cache's one place
        assert_close(engine(short), model.forward(short), "the short sequence's graph")
        model.eval()
        with pytest.raises(BuildOverBudget):
            engine(long)
    assert len(made) == 2  # the long sequence once, the short one once


@pytest.mark.skipif(not plain_backend(), reason="the plain backend's trace (aot_autograd's)")
def test_the_plain_trace_watches_the_users_forward_not_aots_machinery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The limits' torch function mode is entered around each run of the user's forward, so
    it sees the forward's torch calls (aot runs forward twice), not the tens of thousands of
    aot's own machinery (its traced backward above all), each of which it would slow; the
    deadline is still checked there (`test_a_build_past_its_deadline_stops_...`)."""
    seen: list[Any] = []
    watched = budget._TracedCalls.__torch_function__

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen.append(func)
        return watched(self, func, types, args, kwargs)

    monkeypatch.setattr(budget._TracedCalls, "__torch_function__", counted)
    engine = ModuleEngine(Slow(), EngineOptions(backend="ort", threads=1))
    x = torch.randn(2, 4)
    engine(x).sum().backward()
    assert engine.builds == 1
    # per run of forward: 40 linears and 40 tanhs, and the few torch calls around them
    assert 2 * 80 <= len(seen) <= 2 * 120, len(seen)


def test_a_build_past_its_deadline_stops_with_the_time_in_the_reason() -> None:
    engine = ModuleEngine(Slow(), EngineOptions(max_build_seconds=1))
    with pytest.raises(BuildOverBudget) as refused:
        engine(torch.randn(2, 4), pause=1.2)
    assert "building its graph took longer than 1 s" in refused.value.cause
    _assert_torch_restored()


def test_limits_of_zero_build_what_they_would_refuse() -> None:
    model = Unrolled().eval()
    engine = ModuleEngine(model, EngineOptions(max_graph_nodes=0, max_build_seconds=0))
    x = torch.randn(2, 30)
    with torch.no_grad():
        assert_close(engine(x), model.forward(x), "an unlimited build")
    assert engine.builds == 1


def test_a_module_rebuilding_on_every_call_stops_building_and_keeps_its_graphs() -> None:
    model = Slow()
    engine = ModuleEngine(model, EngineOptions(cache_size=16))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for k in range(budget.REBUILD_FLOOR):  # a new constant each call: a graph each call
            assert_close(engine(x, pause=k / 1e6), model.forward(x), f"graph {k}")
        with pytest.raises(BuildOverBudget) as refused:
            engine(x, pause=1e-3)
        assert f"it built {budget.REBUILD_FLOOR} graphs for" in refused.value.cause
        assert_close(engine(x, pause=0.0), model.forward(x), "a graph built before")
    assert engine.builds == budget.REBUILD_FLOOR


@pytest.mark.skipif(
    plain_backend(),
    reason="the training build's refusal (ORT 1.19.2 has no float64 gradient kernels); the plain "
    "backend's gradients are torch's own graphs, run by ORT's float64 inference kernels",
)
def test_float64_training_is_refused_before_anything_is_exported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = _exports(monkeypatch)
    engine = ModuleEngine(Unrolled().double())
    with pytest.raises(Exception, match="training with float64"):
        engine(torch.randn(2, 10, dtype=torch.float64))
    assert made == []


SCRIPT = """
import sys
import time

import torch
from torch import nn

started = time.perf_counter()


class Unrolled(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(1, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = c = torch.zeros(x.shape[0], 16)
        outputs = []
        for x_t in x.split(1, dim=1):
            h, c = self.cell(x_t, (h, c))
            outputs.append(self.head(h))
        return torch.cat(outputs, dim=1)


torch.manual_seed(0)
model = Unrolled()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 1000)
for _ in range(3):
    optimizer.zero_grad()
    loss = (model(x) - x).square().mean()
    loss.backward()
    optimizer.step()
with torch.no_grad():
    print(round(float(model(x).square().mean()), 6))
print(time.perf_counter() - started, file=sys.stderr)
"""


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_an_unrolled_loop_of_1000_steps_runs_about_as_fast_as_plain_python(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    report = tmp_path / "report.json"
    options = ["--modules", "__main__:Unrolled", "--report", str(report)]
    begun = time.perf_counter(), _children_cpu_seconds()
    plain = run([PY, "train.py"], cwd=tmp_path, timeout=600)
    plain_wall, plain_cpu = time.perf_counter() - begun[0], _children_cpu_seconds() - begun[1]
    begun = time.perf_counter(), _children_cpu_seconds()
    tool = run([*LAUNCHER, *options, "train.py"], cwd=tmp_path, timeout=600)
    tool_wall, tool_cpu = time.perf_counter() - begun[0], _children_cpu_seconds() - begun[1]
    assert plain.returncode == 0 and tool.returncode == 0, tool.stderr
    assert tool.stdout == plain.stdout  # every call ran in PyTorch: the same numbers
    stats = json.loads(report.read_text())["classes"]["__main__:Unrolled"]
    assert stats["ort_calls"] == 0 and stats["eager_calls"] == 4
    reasons = {f["reason"]: f for f in stats["fallbacks"]}
    assert "forward traces to more than 10000 graph nodes" in reasons["build over budget"]["detail"]
    assert "runs in PyTorch (build over budget)" in tool.stderr
    # Each refused trace costs about as much as a few eager calls: one for training, one for
    # the no_grad call. Compared in CPU seconds (the processes' and what they waited for):
    # wall time on a loaded 2-core machine varies more between the runs than the bound allows.
    assert tool_cpu < 3 * plain_cpu, {"cpu": (tool_cpu, plain_cpu), "wall": (tool_wall, plain_wall)}
