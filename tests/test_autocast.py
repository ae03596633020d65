"""torch.autocast around a selected class: each call computes in the dtypes eager would.

A graph exported outside autocast never serves a call inside it (autocast's state is part of
the call key). ONNX Runtime's CPU build cannot compute autocast's lower-precision operators as
torch does (no bfloat16 Gemm; float16 Gemm computed in float32), so those calls run in PyTorch
as a counted known limitation, while calls outside autocast keep running in ORT.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ort_autopatch import patcher
from ort_autopatch.engine import EngineOptions
from tests.helpers import assert_close, class_stats, patched

AUTOCAST_FALLBACK = "fallback: autocast dtype without ONNX Runtime kernels"


class Mlp(nn.Module):
    """Linear layers: the operators autocast lowers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))


class Elementwise(nn.Module):
    """Only operators autocast leaves in float32: its graph needs no other kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale + self.shift)


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched([Mlp, Elementwise], patcher.Settings(engine=EngineOptions()))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: how far autocast's lower-precision results may be from eager's (a bfloat16 ulp is 2**-8;
#: another kernel may round a float16/bfloat16 product once more)
AUTOCAST_TOLERANCE = {"rtol": 2e-2, "atol": 2e-3}


def _step(
    model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None, eager: bool
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One training call (inside autocast when `autocast` is a dtype); backward outside it,
    as torch's mixed-precision recipe does. Returns the output and every gradient."""
    model.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    device = x.device.type
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model.forward(x) if eager else model(x)
    out.float().square().sum().backward()
    assert x.grad is not None
    return out, x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_calls_in_and_out_of_autocast_give_eager_dtypes_and_numbers(
    dtype: torch.dtype, device: str
) -> None:
    """On CPU the autocast calls run in PyTorch (the known limitation), on CUDA in ORT; every
    call outside autocast runs in ORT."""
    torch.manual_seed(0)
    model = Mlp().to(device)
    twin = copy.deepcopy(model)
    stats = class_stats(Mlp)
    ort_calls = fallbacks = 0
    for k, autocast in enumerate([None, dtype, None, dtype, dtype, None]):
        x = torch.randn(5, 8, device=device)
        out, x_grad, grads = _step(model, x, autocast, eager=False)
        want, want_x_grad, want_grads = _step(twin, x, autocast, eager=True)
        what = f"call {k} ({'autocast ' + str(autocast) if autocast else 'no autocast'})"
        assert out.dtype == want.dtype == (autocast or torch.float32), what
        tolerance = AUTOCAST_TOLERANCE if autocast else {}
        assert_close(out, want, f"{what}: output", **tolerance)
        assert_close(x_grad, want_x_grad, f"{what}: input grad", **tolerance)
        for n, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            assert_close(g, w, f"{what}: grad of parameter {n}", **tolerance)
        if autocast is None or device == "cuda":
            ort_calls += 1
        else:
            fallbacks += 1
        assert stats.ort_calls == ort_calls, f"{what} did not run in ORT"
        assert stats.eager_calls[AUTOCAST_FALLBACK] == fallbacks, f"{what} not in PyTorch"


def test_the_autocast_limitation_is_said_once_at_info_not_as_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Mlp()
    caplog.set_level(logging.INFO, logger="ort_autopatch")
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(3, 8))
    said = [r for r in caplog.records if r.name == "ort_autopatch" and "autocast" in r.message]
    assert len(said) == 1
    assert said[0].levelno == logging.INFO
    assert "no bfloat16 kernel for Gemm" in said[0].message
    assert "report" not in said[0].message
    assert class_stats(Mlp).fallbacks  # the report keeps the cause too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_graph_autocast_leaves_in_float32_runs_in_ort_rebuilt_for_autocast(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(0)
    model = Elementwise()
    twin = copy.deepcopy(model)
    stats = class_stats(Elementwise)
    for k, autocast in enumerate([None, dtype, dtype, None]):
        x = torch.randn(4, 8)
        out, x_grad, grads = _step(model, x, autocast, eager=False)
        want, want_x_grad, want_grads = _step(twin, x, autocast, eager=True)
        assert_close(out, want, f"call {k}: output")
        assert_close(x_grad, want_x_grad, f"call {k}: input grad")
        for n, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            assert_close(g, w, f"call {k}: grad of parameter {n}")
        assert stats.ort_calls == k + 1, f"call {k} did not run in ORT"
    name = str(dtype).removeprefix("torch.")
    # one graph per autocast state, the second built for the reason that names autocast
    assert dict(stats.rebuilds) == {f"autocast changed (off -> cpu {name})": 1}
    assert stats.exports == 2


def test_inference_calls_under_autocast_follow_the_same_rule() -> None:
    """Eval mode under no_grad: a graph autocast lowers runs in PyTorch with eager's dtype,
    one it leaves in float32 in ORT, each beside its calls outside autocast."""
    torch.manual_seed(0)
    lowered, plain = Mlp().eval(), Elementwise().eval()
    for model, cls in ((lowered, Mlp), (plain, Elementwise)):
        for k, autocast in enumerate([None, torch.bfloat16, None]):
            x = torch.randn(3, 8)
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bool(autocast)):
                out, want = model(x), model.forward(x)
            assert_close(out, want, f"{cls.__name__} call {k}")
    assert class_stats(Mlp).ort_calls == 2
    assert class_stats(Mlp).eager_calls[AUTOCAST_FALLBACK] == 1
    assert class_stats(Elementwise).ort_calls == 3
