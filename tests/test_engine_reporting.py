"""What the engine tells about its builds: reasons, and progress while a build is slow."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

from ort_autopatch.engine import EngineOptions, ModuleEngine, build
from tests.helpers import plain_backend


class SlowToTrace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)  # runs once, while the exporter traces
        return self.fc(x)


def _reasons(engine: ModuleEngine) -> list[str]:
    return [r.reason for r in engine.records]


def test_a_slow_build_says_so_while_it_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(build, "SLOW_BUILD_SECONDS", 0.1)
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        ModuleEngine(SlowToTrace())(torch.randn(2, 4))
    messages = [r.getMessage() for r in caplog.records]
    # the phase under way: the training build's export, the plain backend's trace
    phases = ("(export,", "(tracing forward and backward,")
    assert any(
        "SlowToTrace: still building" in m and any(p in m for p in phases) for m in messages
    )


def test_a_fast_build_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ort_autopatch"):
        ModuleEngine(nn.Linear(4, 4))(torch.randn(2, 4))
    assert not [r for r in caplog.records if "still building" in r.getMessage()]


def test_rebuild_reasons_name_what_changed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    engine = ModuleEngine(model, EngineOptions(cache_size=2))
    x = torch.randn(2, 4)
    engine(x)  # first call
    engine(x.double().float()[None])  # rank 3: new input signature
    model.eval()
    engine(x)  # train/eval mode changed
    model.train()
    model[0].weight.requires_grad_(False)
    engine(x)  # requires_grad changed
    model[0].weight.requires_grad_(True)
    engine(x)  # evicted from the 2-graph cache
    model[1] = nn.Sigmoid()
    engine(x)  # submodule replaced
    assert _reasons(engine) == [
        "first call",
        "new input signature",
        "train/eval mode changed",
        "requires_grad changed",
        "cache evicted",
        "submodule 1 replaced",
    ]


def test_a_dtype_change_in_place_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    engine = ModuleEngine(model)
    with torch.no_grad():  # float64 training is refused before any build (no ORT kernels)
        engine(torch.randn(2, 4))
        model.double()
        engine(torch.randn(2, 4, dtype=torch.float64))
    assert _reasons(engine)[-1] == "dtype changed"


class Rounds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(self.fc(x)) * self.fc(x)


@pytest.mark.skipif(
    plain_backend(),
    reason="ORT's gradient builder is the training build's; the plain backend's gradients are "
    "torch's own, so every operator torch differentiates has one",
)
def test_a_missing_gradient_names_the_operator_and_the_remedy() -> None:
    from ort_autopatch.engine import GradientBuildError

    with pytest.raises(GradientBuildError) as raised:
        ModuleEngine(Rounds(), EngineOptions(no_torch_ops=("aten::round",)))(torch.randn(2, 4))
    assert "no gradient for operator Round" in raised.value.cause
    assert "/onnxruntime_src/" not in str(raised.value)
    assert "Rounds" in str(raised.value) and "eagerly" in raised.value.remedy
