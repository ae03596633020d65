"""Faults injected at every stage: the run survives (fallback or typed error), the module's
state is what eager would have left, the next call works, and no half-built graph stays."""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ort_autopatch import patcher, report
from ort_autopatch.engine import EngineError, EngineOptions, ExecutionError, persist, runtime
from ort_autopatch.policy import Fallback
from tests.helpers import plain_backend, repatch

PLAIN = plain_backend()


class Net(nn.Module):
    """Parameters, BatchNorm buffers, no dropout: every piece of state is comparable."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    report.reset()
    persist._stores.clear()
    patcher.patch(Net)
    yield
    patcher.unpatch_all()


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "torch_rng": torch.random.get_rng_state(),
        "random": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
    }


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    for group in ("params", "grads", "buffers"):
        for name, value in want[group].items():
            if value is None:
                assert got[group][name] is None, f"{group} {name}"
            else:
                torch.testing.assert_close(got[group][name], value, msg=f"{group} {name}")
    assert torch.equal(got["torch_rng"], want["torch_rng"])
    assert got["random"] == want["random"]
    assert np.array_equal(got["numpy"], want["numpy"])


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.sum().backward()
    return out


def _eager_step(twin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = twin.forward(x)
    out.sum().backward()
    return out


def _pair() -> tuple[Net, Net, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    return model, copy.deepcopy(model), torch.randn(6, 8)


def _graphs(model: nn.Module) -> dict[Any, int]:
    """The engine's cached entries by key (identity of each value)."""
    entries = patcher._instances[model].engine._cache._entries
    return {key: id(value) for key, value in entries.items()}


def _built_and_working(model: nn.Module, twin: nn.Module, x: torch.Tensor) -> None:
    """Steps of both until a step builds nothing (the plain backend's shape that comes back
    earns its own graph after the first call's)."""
    for _ in range(5):
        before = _graphs(model) if model in patcher._instances else None
        _step(model, x), _eager_step(twin, x)
        if _graphs(model) == before:
            return
    raise AssertionError("every step built a graph")


def _graphs_kept(model: nn.Module, before: dict[Any, int]) -> None:
    """A failure while running a built graph neither drops, replaces nor poisons its entry."""
    assert _graphs(model) == before


def _export_failing_midway(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """The training build's exporter, or the plain backend's trace of forward and backward,
    runs forward and then fails."""

    def broken(model: nn.Module, args: tuple[Any, ...], *a: Any, **k: Any) -> None:
        model(*args)  # the trace ran forward (BatchNorm stats moved, RNG advanced)...
        torch.rand(3)
        random.random()
        raise error  # ...then the exporter failed

    if PLAIN:
        from torch._functorch import aot_autograd

        def traced(stack: Any, model: nn.Module, args: tuple[Any, ...], **k: Any) -> None:
            broken(model, args)

        monkeypatch.setattr(aot_autograd, "aot_export_joint_with_descriptors", traced)
        return
    monkeypatch.setattr(torch.onnx, "export", broken)


class _BrokenBuilder:
    def initialize(self, *args: Any) -> None:
        raise RuntimeError("injected: gradient builder failed")


def _failing(name: str, error: BaseException) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    fail.__name__ = name
    return fail


class _AgentProxy:
    """A TrainingAgent whose forward or backward fails on demand."""

    fail_forward: BaseException | None = None
    fail_backward: BaseException | None = None

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def run_forward(self, *args: Any) -> None:
        if _AgentProxy.fail_forward is not None:
            raise _AgentProxy.fail_forward
        self._agent.run_forward(*args)

    def run_backward(self, *args: Any) -> None:
        if _AgentProxy.fail_backward is not None:
            raise _AgentProxy.fail_backward
        self._agent.run_backward(*args)


class _FailingSession:
    """An InferenceSession whose runs raise (the plain backend's ORT failing)."""

    def __init__(self, error: BaseException) -> None:
        self._sess = self
        self.error = error

    def run_with_ortvaluevector(self, *args: Any) -> None:
        raise self.error


@pytest.fixture
def agent_faults(monkeypatch: pytest.MonkeyPatch) -> type[_AgentProxy]:
    """ORT's forward or backward failing on demand: the training build's TrainingAgent, or
    the plain backend's forward and backward sessions."""
    _AgentProxy.fail_forward = _AgentProxy.fail_backward = None
    if PLAIN:
        from ort_autopatch.engine.backends.ort import program

        real_run = program._Session.run

        def run(self: Any, cls: str, phase: str, *args: Any, **kwargs: Any) -> list[Any]:
            fault = _AgentProxy.fail_forward if phase == "forward" else _AgentProxy.fail_backward
            if fault is not None:
                self = copy.copy(self)
                self.runnable = dataclasses.replace(self.runnable, session=_FailingSession(fault))
            return real_run(self, cls, phase, *args, **kwargs)

        monkeypatch.setattr(program._Session, "run", run)
        return _AgentProxy
    capi = runtime.capi()
    real = capi.TrainingAgent
    monkeypatch.setattr(capi, "TrainingAgent", lambda *a: _AgentProxy(real(*a)))
    return _AgentProxy


def _fallback_leaves_eager_state(model: Net, twin: Net, x: torch.Tensor) -> None:
    out = _step(model, x)
    expected = _eager_step(twin, x)
    torch.testing.assert_close(out, expected)
    _assert_same_state(_state(model), _state(twin))


def test_export_failing_midway_falls_back_with_eager_state(monkeypatch: pytest.MonkeyPatch) -> None:
    model, twin, x = _pair()
    _export_failing_midway(monkeypatch, RuntimeError("injected: exporter failed"))
    _fallback_leaves_eager_state(model, twin, x)
    assert _stats()["fallbacks"][0]["reason"] == "export failed"
    _fallback_leaves_eager_state(model, twin, x)  # the next call works (in PyTorch)


def test_gradient_builder_failing_falls_back_with_eager_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The training build's gradient builder; the plain backend's backward graph, built from
    torch's autograd, failing to become ONNX (an export failure there)."""
    model, twin, x = _pair()
    if PLAIN:
        from ort_autopatch.engine.backends.ort import lowering

        real = lowering.to_onnx

        def to_onnx(gm: Any, cls: str, what: str, *args: Any, **kwargs: Any) -> bytes:
            if what == "backward":
                raise lowering.ExportError(cls, "injected: backward graph failed", "none")
            return real(gm, cls, what, *args, **kwargs)

        monkeypatch.setattr(lowering, "to_onnx", to_onnx)
        from ort_autopatch.engine.backends.ort import offload

        offload.close_kept()  # a lowering child forked before (kept, prestarted) lowers unhurt
    else:
        monkeypatch.setattr(runtime.capi(), "OrtModuleGraphBuilder", _BrokenBuilder)
    _fallback_leaves_eager_state(model, twin, x)
    reason = "export failed" if PLAIN else "gradient build failed"
    assert _stats()["fallbacks"][0]["reason"] == reason
    _fallback_leaves_eager_state(model, twin, x)


def test_session_creation_failing_falls_back_with_eager_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, twin, x = _pair()
    ort, _ = runtime.load(training=not PLAIN)
    monkeypatch.setattr(
        ort, "InferenceSession", _failing("InferenceSession", RuntimeError("injected"))
    )
    _fallback_leaves_eager_state(model, twin, x)
    assert _stats()["fallbacks"][0]["reason"] == "session creation failed"


def test_ort_failing_inside_forward_falls_back_and_the_next_call_runs_in_ort(
    agent_faults: type[_AgentProxy],
) -> None:
    model, twin, x = _pair()
    _built_and_working(model, twin, x)
    graphs = _graphs(model)
    agent_faults.fail_forward = RuntimeError("injected: ORT forward failed")
    _fallback_leaves_eager_state(model, twin, x)
    agent_faults.fail_forward = None
    calls = _stats()["ort_calls"]
    _fallback_leaves_eager_state(model, twin, x)
    assert _stats()["ort_calls"] == calls + 1
    _graphs_kept(model, graphs)


def test_ort_failing_inside_backward_raises_typed_and_writes_no_gradient(
    agent_faults: type[_AgentProxy],
) -> None:
    model, twin, x = _pair()
    _built_and_working(model, twin, x)
    model.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    agent_faults.fail_backward = RuntimeError("injected: ORT backward failed")
    out = model(x)
    with pytest.raises(ExecutionError, match="backward failed"):
        out.sum().backward()
    twin.forward(x)  # eager's forward moved the same BatchNorm statistics
    _assert_same_state(_state(model), _state(twin))  # no gradient was written
    agent_faults.fail_backward = None
    _fallback_leaves_eager_state(model, twin, x)


def test_after_a_failed_backward_the_class_trains_in_pytorch_said_once(
    agent_faults: type[_AgentProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A backward that fails in ORT cannot fall back (its forward ran there): the user's
    `backward()` raises, and every later training call of the class runs in PyTorch, on
    every backend, even once ORT would work again; the warning comes once."""
    model, twin, x = _pair()
    _built_and_working(model, twin, x)
    agent_faults.fail_backward = RuntimeError("injected: ORT backward failed")
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        out = model(x)
        with pytest.raises(ExecutionError, match="backward failed"):
            out.sum().backward()
        twin.forward(x)  # eager's forward moved the same BatchNorm statistics
        agent_faults.fail_backward = None
        ort_calls, eager_calls = _stats()["ort_calls"], _stats()["eager_calls"]
        for _ in range(3):
            _fallback_leaves_eager_state(model, twin, x)
    assert _stats()["ort_calls"] == ort_calls  # no training call went to ORT again
    assert _stats()["eager_calls"] == eager_calls + 3
    said = [r for r in caplog.records if "backward failed" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert [f["reason"] for f in _stats()["fallbacks"]] == ["execution failed"]


def test_fallback_disable_raises_the_typed_error_and_leaves_state_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repatch(Net, patcher.Settings(fallback=Fallback.FALLBACK_DISABLE))
    model, _, x = _pair()
    before = _state(model)
    _export_failing_midway(monkeypatch, RuntimeError("injected: exporter failed"))
    with pytest.raises(EngineError) as raised:
        model(x)
    assert raised.value.reason == "export failed"
    _assert_same_state(_state(model), before)


def test_keyboard_interrupt_during_export_propagates_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, twin, x = _pair()
    before = _state(model)
    with monkeypatch.context() as patch:
        _export_failing_midway(patch, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            model(x)
    _assert_same_state(_state(model), before)
    assert not patcher._instances[model].engine._cache._entries  # nothing half-built
    out = _step(model, x)  # the next call exports and runs in ORT
    torch.testing.assert_close(out, _eager_step(twin, x))
    assert _stats()["ort_calls"] == 1


def test_keyboard_interrupt_during_a_step_propagates_and_the_next_call_works(
    agent_faults: type[_AgentProxy],
) -> None:
    model, twin, x = _pair()
    _built_and_working(model, twin, x)
    graphs = _graphs(model)
    before = _state(model)
    agent_faults.fail_forward = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        model(x)
    _assert_same_state(_state(model), before)
    agent_faults.fail_forward = None
    _fallback_leaves_eager_state(model, twin, x)
    _graphs_kept(model, graphs)


def test_a_cache_folder_turning_unwritable_mid_run_only_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    repatch(Net, patcher.Settings(engine=EngineOptions(cache_dir=cache)))
    model, twin, x = _pair()
    _fallback_leaves_eager_state(model, twin, x)
    # Unwritable for root too: the folder is gone and a file holds its name.
    shutil.rmtree(cache)
    cache.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        model.eval(), twin.eval()
        with torch.no_grad():  # a new graph, which cannot be stored
            torch.testing.assert_close(model(x), twin.forward(x))
    assert any("cannot write the graph cache" in r.getMessage() for r in caplog.records)
    assert _stats()["fallbacks"] == [] and _stats()["ort_calls"] == 2


def _stats() -> dict[str, Any]:
    return report.snapshot()[patcher.class_name(Net)]
