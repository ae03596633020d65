"""benchmarks/bench_scale.py's own checks: the interleaved run holds the tool's losses to
eager's and counts its calls in ONNX Runtime, and its guard names a run whose numbers would be
wrong to report (a loss off eager's, a call in PyTorch). The models at users' size are the
benchmark's to run (`nox -s bench_scale`); here a small MLP stands in for them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_scale
import render_scale


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _spec() -> bench_scale.Spec:
    def batch(size: int, tiny: bool, gen: torch.Generator, model: nn.Module) -> dict[str, Any]:
        return {
            "x": torch.randn(size, 16, generator=gen),
            "labels": torch.randint(0, 10, (size,), generator=gen),
        }

    return bench_scale.Spec(
        "torch",
        lambda tiny: "MLP 16-32-10",
        lambda tiny: _Net(),
        batch,
        lambda out, b: F.cross_entropy(out, b["labels"]),
        lambda model, b, tiny: (6.0 * 874 * b["x"].shape[0], "6 x 874 parameters x rows"),
    )


@pytest.fixture
def mlp(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(bench_scale.MODELS, "mlp", _spec())
    return "mlp"


def test_interleaved_run_matches_eager_and_runs_in_ort(mlp: str) -> None:
    from ort_autopatch import patcher

    run = bench_scale.interleaved(mlp, 4, 3, False, "auto", ("eager", "tool"))
    tool, eager = run["variants"]["tool"], run["variants"]["eager"]
    assert len(tool["losses"]) == len(eager["losses"]) == 4  # the first call and 3 rounds
    assert tool["losses_equal_eager"], (tool["losses"], eager["losses"])
    assert eager["losses"][0] != eager["losses"][-1]  # AdamW did train
    assert run["tool_calls"]["ort_calls"] == 4 and not run["tool_calls"]["fallbacks"]
    assert bench_scale._check(mlp, "k", run, 3) == []
    assert not patcher.is_patched(_Net)  # the benchmark leaves the class as it found it


def test_check_names_a_loss_off_eager_and_calls_in_pytorch() -> None:
    run = {
        "variants": {
            "eager": {"losses": [2.0, 1.9]},
            "tool": {"losses": [2.0, 1.8], "loss_max_abs_diff": 0.1, "losses_equal_eager": False},
        },
        "tool_calls": {"ort_calls": 1, "eager_calls": 1, "fallbacks": []},
    }
    problems = bench_scale._check("bert", "batch 2, 2 threads", run, 1)
    assert len(problems) == 2
    assert "differ from eager's by 1.00e-01" in problems[0]
    assert "not every call of the tool ran in ONNX Runtime" in problems[1]


def test_losses_agree_to_4_decimals_or_within_eagers_own_movement() -> None:
    """ResNet-50 at batch 2: after a few AdamW steps a rounding-sized nudge moves eager's own
    loss by 6e-2; a first step (no update yet) still has to hold 4 decimals."""
    assert bench_scale.losses_agree([4e-6, 3e-2, 5e-2], [1e-6, 6e-2, 1e-2])
    assert not bench_scale.losses_agree([2e-3, 1e-6], [1e-6, 6e-2])  # the first step off
    assert not bench_scale.losses_agree([4e-6, 1.3e-1], [1e-6, 6e-2])  # past eager's own
    assert not bench_scale.losses_agree([4e-6, 1e-3], [1e-6, 1e-4])


_ENV = {
    "date": "d",
    "backend": "ort",
    "onnxruntime": "1",
    "torch": "2",
    "steps": 3,
    "tiny": False,
    "load_average": [1.0],
}


def _rendered_run(eager_ms: float, tool_ms: float) -> dict[str, Any]:
    def variant(ms: float) -> dict[str, Any]:
        return {
            "step_ms": ms,
            "ratio_over_eager": ms / eager_ms,
            "gflops": 1.0,
            "fraction_of_matmul": 0.5,
            "loss_max_abs_diff": 0.0,
        }

    return {
        "environment": _ENV,
        "matmul": {"2": {"gflops": 2.0}},
        "models": {
            "bert": {
                "description": "BERT-base MLM",
                "runs": {
                    "batch 2, 2 threads": {
                        "variants": {"eager": variant(eager_ms), "tool": variant(tool_ms)},
                        "eager_nudged_loss_max_abs_diff": 0.0,
                    }
                },
            }
        },
    }


def test_render_gives_each_backend_run_its_own_eager_step() -> None:
    """The backends run in separate processes, minutes apart: each ratio is over its own
    run's eager step, and the table shows both steps, so that a ratio flattered by a slow
    eager (1.37 against 1.09 s on one VM) can be seen."""
    block = render_scale.table(_rendered_run(1370.0, 1384.0), _rendered_run(1090.0, 1308.0))
    row = next(line for line in block.splitlines() if line.startswith("| BERT-base MLM"))
    assert "| 1.37 / 1.09 s | 1.01 | 1.20 |" in row


def test_render_states_a_skipped_model() -> None:
    env = _ENV
    skipped = {
        "description": "ResNet-50, 224x224",
        "runs": {},
        "skipped": "torchvision is not installed",
    }
    results = {
        "environment": env,
        "matmul": {"2": {"gflops": 100.0}},
        "models": {"resnet50": skipped},
    }
    block = render_scale.table(results, results)
    assert "| ResNet-50, 224x224 | skipped: torchvision is not installed |" in block
    assert "skipped: resnet50 (torchvision is not installed)" in block


def test_profile_splits_the_tool_step_by_operator(mlp: str) -> None:
    from ort_autopatch import patcher
    from ort_autopatch.engine import session

    original = session._session_options
    profile = bench_scale._profiled_child(mlp, 4, False, "auto")
    assert profile["sessions"] >= 1
    assert profile["kernels_ms"] > 0
    # the two layers' products are ONNX matrix products, whatever fusions ORT applied
    assert {"Gemm", "MatMul", "FusedMatMul"} & set(profile["ops_ms"]), profile["ops_ms"]
    assert session._session_options is original and not patcher.is_patched(_Net)


def test_a_zoo_entry_runs_at_the_zoo_size() -> None:
    pytest.importorskip("transformers")
    spec = bench_scale._spec("zoo:llama")
    assert spec.describe(False) == "zoo's llama (the zoo's size and batch)"
    run = bench_scale.interleaved("zoo:llama", 2, 2, False, "auto", ("eager", "tool"))
    assert run["variants"]["tool"]["losses_equal_eager"]
    assert bench_scale._check("zoo:llama", "k", run, 2) == []
    assert run["flops_per_step"] > 0
