"""Which export path makes graph reuse sound: measured on the zoo and the input-variety suite.

    python benchmarks/bench_export_paths.py [--models bert,gpt2,...]

Candidates, side by side on every zoo model (tests/zoo/models.py, 5 training steps with
varied padding and a second shape, compared with eager) and on tests/test_input_variety.py's
models:

- **torchscript+hazards** (the engine's path): TorchScript export with every conversion of a
  traced tensor recorded and judged (engine/hazards.py). Coverage = runs in ORT with eager's
  numbers; first call = the first training call (export, gradient build, session); hazards
  found; graphs built.
- **torch.export (dynamic dims)**: `torch.export.export` with `Dim.AUTO` on every dimension
  of every input; coverage = the capture succeeds; time = the capture alone, a lower bound:
  its ONNX translation and the rewrites ORT's gradient builder needs cost 1 to 2.5 s more per
  graph (shared/notes/engine.md).

Results: benchmarks/results/export_paths.json. The machine is shared; times are noisy.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ort_autopatch import patcher, report  # noqa: E402
from tests import test_input_variety as suite  # noqa: E402
from tests.zoo import harness  # noqa: E402
from tests.zoo.models import ENTRIES  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "export_paths.json"


def _torch_export(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[bool, float, str]:
    """Capture with every dimension dynamic; (captured, seconds, first line of the error)."""
    from torch.export import Dim

    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    dynamic = {k: {d: Dim.AUTO for d in range(v.dim())} for k, v in tensors.items()}
    others = {k: v for k, v in kwargs.items() if k not in tensors}
    dynamic.update(dict.fromkeys(others))
    start = time.perf_counter()
    try:
        torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as exc:  # the measurement is whether it captures
        return False, time.perf_counter() - start, f"{type(exc).__name__}: {str(exc)[:120]}"
    return True, time.perf_counter() - start, ""


def zoo_rows(names: set[str] | None) -> list[dict[str, Any]]:
    rows = []
    for entry in ENTRIES:
        if names and entry.name not in names:
            continue
        result = harness.run(entry, steps=harness.STEPS)
        stats = report.snapshot()
        hazards = sum(len(c["trace_hazards"]) for c in stats.values())
        torch.manual_seed(0)
        model = entry.build().train()
        batch = entry.batch(0, torch.Generator().manual_seed(1))
        captured, seconds, error = _torch_export(model, batch)
        rows.append(
            {
                "model": entry.name,
                "torchscript_hazards": {
                    "runs_in_ort": result.status == "ort",
                    "reason": result.reason,
                    "first_call_s": result.first_call_s,
                    "graphs": result.builds,
                    "hazards": hazards,
                },
                "torch_export": {
                    "captures": captured,
                    "capture_s": round(seconds, 3),
                    "error": error,
                },
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


SUITE = [
    ("LenScale", suite.LenScale, [(2, 4), (5, 4)]),
    ("UnrolledRNN", suite.UnrolledRNN, [(2, 3, 4), (2, 5, 4)]),
    ("IntOfShape", suite.IntOfShape, [(2, 6, 4), (2, 8, 4)]),
    ("LengthThreshold", suite.LengthThreshold, [(2, 3, 4), (2, 6, 4)]),
    ("DataBranch", suite.DataBranch, [(3, 4), (3, 4)]),
    ("SplitOverTime", suite.SplitOverTime, [(2, 3, 4), (2, 5, 4)]),
    ("Attention", suite.Attention, [(3, 5, 8), (3, 7, 8)]),
    ("Encoder", suite.Encoder, [(3, 5, 8), (3, 7, 8)]),
]


def suite_rows() -> list[dict[str, Any]]:
    rows = []
    for name, cls, sizes in SUITE:
        report.reset()
        patcher.patch(cls)
        try:
            torch.manual_seed(0)
            model = cls()
            start = time.perf_counter()
            model(torch.randn(*sizes[0])).sum().backward()
            first = time.perf_counter() - start
            model(torch.randn(*sizes[1])).sum().backward()
            stats = report.stats_for(patcher.class_name(cls))
        finally:
            patcher.unpatch(cls)
        torch.manual_seed(0)
        plain = cls()

        class Wrapped(torch.nn.Module):
            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.m = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.m(x)  # type: ignore[no-any-return]

        captured, seconds, error = _torch_export(Wrapped(plain), {"x": torch.randn(*sizes[0])})
        rows.append(
            {
                "model": name,
                "torchscript_hazards": {
                    "ort_calls": stats.ort_calls,
                    "eager_calls": sum(stats.eager_calls.values()),
                    "graphs": stats.exports,
                    "first_call_s": round(first, 3),
                    "hazards": [f"{k}: {w} at {at}" for k, w, at in stats.trace_hazards],
                },
                "torch_export": {
                    "captures": captured,
                    "capture_s": round(seconds, 3),
                    "error": error,
                },
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def export_overhead(repeat: int = 5) -> dict[str, Any]:
    """Export time of the chosen path (hazards recorded, traced sizes stripped) next to the
    export as it was before (no recording), median of `repeat` interleaved exports."""
    import contextlib

    from ort_autopatch.engine import hazards, signature
    from ort_autopatch.engine.backends.ort_training import export

    @contextlib.contextmanager
    def unrecorded() -> Any:
        yield hazards.Findings([])

    cases = {
        "transformer_layer_d64": (
            torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
            (torch.randn(4, 16, 64),),
        ),
        "unrolled_rnn": (suite.UnrolledRNN(), (torch.randn(2, 8, 4),)),
    }
    out: dict[str, Any] = {}
    for name, (model, args) in cases.items():
        call = signature.flatten_call(name, args, {})
        times: dict[str, list[float]] = {"recorded": [], "before": []}
        for _ in range(repeat):
            for label in ("recorded", "before"):
                original = hazards.recording
                if label == "before":
                    hazards.recording = unrecorded  # type: ignore[assignment]
                try:
                    graph = export.export_call(
                        model,
                        lambda *a, m=model, **k: m.forward(*a, **k),
                        call.spec(),
                        call.tensors,
                        opset=17,
                    )
                finally:
                    hazards.recording = original  # type: ignore[assignment]
                times[label].append(graph.seconds)
        out[name] = {k: round(statistics.median(v), 4) for k, v in times.items()}
        print(name, out[name], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="", help="comma list of zoo names (default: all)")
    args = parser.parse_args()
    names = set(filter(None, args.models.split(",")))
    overhead = export_overhead()
    zoo = zoo_rows(names or None)
    variety = suite_rows()
    ours = [r["torchscript_hazards"] for r in zoo]
    theirs = [r["torch_export"] for r in zoo]
    summary = {
        "zoo_models": len(zoo),
        "torchscript_hazards_in_ort": sum(r["runs_in_ort"] for r in ours),
        "torchscript_hazards_first_call_median_s": statistics.median(
            [r["first_call_s"] for r in ours if r["first_call_s"]] or [0.0]
        ),
        "torch_export_captures": sum(r["captures"] for r in theirs),
        "torch_export_capture_median_s": round(
            statistics.median([r["capture_s"] for r in theirs] or [0.0]), 3
        ),
        "suite_models": len(variety),
        "suite_torch_export_captures": sum(r["torch_export"]["captures"] for r in variety),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"summary": summary, "export_seconds": overhead, "zoo": zoo, "suite": variety},
            indent=2,
        )
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
