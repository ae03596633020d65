"""torch.compile and a selected class: compile decides, and the report counts those calls.

When both are asked for (`torch.compile(model)` or `model.compile()`), the calls run as
torch.compile compiles them, not in ONNX Runtime: the tool says so once and counts them as
`compiled_calls` (neither ORT nor eager calls). The count comes from a function dynamo runs
after its graph on every call, so it adds no graph break (`fullgraph=True` compiles). A selected
class called inside another compiled module is part of that module's graph: dynamo drops the
count in the frames it inlines, so only its traces are counted (`compiled_traces`). Compiled
with the "eager" backend: what is tested is dynamo's tracing of the patched call, not a code
generator.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn

from ort_autopatch import patcher
from ort_autopatch.engine import EngineOptions
from tests.helpers import assert_close, class_stats, patched
from tests.proc_helpers import LAUNCHER, PY, run


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


class Parent(nn.Module):
    """Not selected: a compiled module whose forward calls a selected one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * 2


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    torch._dynamo.reset()
    yield from patched([Net], patcher.Settings(engine=EngineOptions()))
    torch._dynamo.reset()


def _steps(model: nn.Module, call: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Three training steps; the output and every parameter gradient of each."""
    seen: list[torch.Tensor] = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        out = call(x)
        out.square().sum().backward()
        seen += [out.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]
        model.zero_grad()
    return seen


def _assert_compiled_like_eager(
    model: nn.Module, compiled: Callable[..., torch.Tensor], counted: int = 3, traces: int = 1
) -> None:
    """Three steps equal eager's, `counted` compiled calls and `traces` traces of the patched
    call (one graph serves the three steps), nothing in ORT or eager."""
    twin = copy.deepcopy(model)
    got = _steps(model, compiled)
    with patcher_off():
        want = _steps(twin, twin)
    for k, (a, e) in enumerate(zip(got, want, strict=True)):
        assert_close(a, e, f"tensor {k}")
    stats = class_stats(Net)
    assert stats.compiled_calls == counted
    assert stats.compiled_traces == traces
    assert stats.ort_calls == 0 and not stats.eager_calls


@contextlib.contextmanager
def patcher_off() -> Iterator[None]:
    """Eager PyTorch for the reference: Net unpatched for the block."""
    settings = patcher._settings_of(Net)
    patcher.unpatch(Net)
    try:
        yield
    finally:
        patcher.patch(Net, settings)


def test_torch_compile_of_a_selected_class_runs_compiled_and_counts_its_calls() -> None:
    model = Net()
    torch._dynamo.utils.counters.clear()
    _assert_compiled_like_eager(model, torch.compile(model, backend="eager", fullgraph=True))
    assert not torch._dynamo.utils.counters["graph_break"]


def test_model_compile_in_place_runs_compiled_and_counts_its_calls() -> None:
    model = Net()
    model.compile(backend="eager")
    # torch.compile traces the module's own _call_impl: the patched call runs in Python
    _assert_compiled_like_eager(model, model, traces=0)


def test_a_selected_class_inside_a_compiled_module_runs_compiled_its_trace_counted() -> None:
    parent = Parent()
    compiled = torch.compile(parent, backend="eager", fullgraph=True)
    _assert_compiled_like_eager(parent, compiled, counted=0)


def test_compiling_a_selected_class_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    model = Net()
    compiled = torch.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        for _ in range(3):
            compiled(torch.randn(2, 6))
    said = [r for r in caplog.records if "torch.compile" in r.message]
    assert len(said) == 1 and "not in ONNX Runtime" in said[0].message


def test_the_report_counts_compiled_calls_when_torch_compile_loads_after_the_tool(
    tmp_path: Path,
) -> None:
    """The real thing: the launcher installs the tool before the script imports anything of
    torch.compile, so dynamo learns of the count through the import hook."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch
            from torch import nn

            assert "torch._dynamo" not in sys.modules

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = nn.Linear(6, 3)

                def forward(self, x):
                    return torch.tanh(self.fc(x))

            model = Net()
            compiled = torch.compile(model, backend="eager", fullgraph=True)
            for _ in range(4):
                compiled(torch.randn(2, 6)).sum().backward()
            model(torch.randn(2, 6)).sum().backward()  # not compiled: ORT
            """
        )
    )
    report = tmp_path / "report.json"
    done = run(
        [*LAUNCHER, "--modules", "__main__:Net", "--report", str(report), str(script)],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    counts = json.loads(report.read_text())["classes"]["__main__:Net"]
    assert counts["compiled_calls"] == 4 and counts["compiled_traces"] == 1
    assert counts["ort_calls"] == 1 and counts["eager_calls"] == 0
    assert done.stderr.count("is compiled by torch.compile") == 1


def test_a_compiled_parent_of_a_selected_class_is_reported_by_its_traces(tmp_path: Path) -> None:
    """torch.compile imported before the selected class exists (the tool's patcher loads
    inside torch._dynamo's import), and only a parent compiled: the report and the exit
    line say the selected class ran under torch.compile instead of never being called."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torch._dynamo
            from torch import nn

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = nn.Linear(6, 3)

                def forward(self, x):
                    return torch.tanh(self.fc(x))

            class Parent(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.net = Net()

                def forward(self, x):
                    return self.net(x) * 2

            compiled = torch.compile(Parent(), backend="eager", fullgraph=True)
            for _ in range(3):
                compiled(torch.randn(2, 6)).sum().backward()
            """
        )
    )
    report = tmp_path / "report.json"
    done = run(
        [*LAUNCHER, "--modules", "__main__:Net", "--report", str(report), str(script)],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    counts = json.loads(report.read_text())["classes"]["__main__:Net"]
    assert counts["compiled_traces"] == 1 and counts["compiled_calls"] == 0
    assert counts["ort_calls"] == 0 and counts["eager_calls"] == 0
    assert done.stderr.count("is compiled by torch.compile") == 1
    assert "ran under torch.compile (0 calls counted, 1 traces)" in done.stderr


def test_torch_export_of_a_selected_class_traces_its_code_uncounted() -> None:
    model = Net()
    x = torch.randn(2, 6)
    program = torch.export.export(model, (x,))
    with patcher_off():
        want = model(x)
    assert_close(program.module()(x), want, "exported program")
    stats = class_stats(Net)
    assert stats.compiled_calls == 0 and stats.ort_calls == 0 and not stats.eager_calls


def test_a_class_patched_by_hand_before_torch_compile_loads_keeps_the_graph_whole() -> None:
    """Without the import hook, dynamo never learns of the count: the patched call then makes
    no call dynamo would break its graph on (fullgraph=True still compiles), uncounted."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        from torch import nn
        from ort_autopatch import patcher, report

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(6, 3)

            def forward(self, x):
                return self.fc(x)

        patcher.patch(Net)
        assert "torch._dynamo" not in sys.modules
        compiled = torch.compile(Net(), backend="eager", fullgraph=True)
        for _ in range(2):
            compiled(torch.randn(2, 6))
        print(report.stats_for(patcher.class_name(Net)).compiled_calls)
        """
    )
    done = run([PY, "-c", code], timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]
