"""Step time and first-call time of the plain backend (inference-only onnxruntime, graphs from
torch's autograd) against eager PyTorch.

    python benchmarks/bench_plain.py [--steps 30] [--warmup 5] [--threads 1,2]
                                     [--models mlp,transformer,transformer_p0,cnn]

A step is forward + loss + backward + AdamW step. Eager and plain-backend steps alternate in
one process, in pairs whose order alternates, and medians over `--steps` pairs after
`--warmup` untimed pairs are reported with their ratio, at each `--threads` count
(torch.set_num_threads; the sessions follow it). The first call (capture, lowering, sessions
and the first step) is timed in a fresh subprocess, imports of the exporter and ONNX Runtime
included, and again for a second instance in the warm process.

Results: benchmarks/results/plain.json, and a table on stdout.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).resolve().parent / "results" / "plain.json"

Model = tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]


def _mlp() -> Model:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    return model, (x,), lambda out: F.cross_entropy(out, y)


def _transformer(dropout: float = 0.1) -> Model:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=dropout, batch_first=True)
    return layer, (torch.randn(16, 64, 256),), lambda out: (out * out).mean()


def _cnn() -> Model:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 10),
    )
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return model, (x,), lambda out: F.cross_entropy(out, y)


MODELS: dict[str, Callable[[], Model]] = {
    "mlp": _mlp,
    "transformer": _transformer,
    "transformer_p0": lambda: _transformer(0.0),
    "cnn": _cnn,
}


class _Plain:
    """A module's calls through the plain backend's capture, lowering and sessions."""

    def __init__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        from ort_autopatch.engine import session, signature
        from ort_autopatch.engine.plain import capture, decompositions, program

        call = signature.flatten_call("bench", inputs, {})
        self.captured = capture.capture(
            module,
            lambda m, *a, **k: m(*a, **k),
            call.spec(),
            call.tensors,
            "bench",
            decompositions.table(),
        )
        lowered = program.lower(self.captured, "bench")
        self.program = program.instantiate(
            lowered, "bench", torch.device("cpu"), session.SessionSettings()
        )
        named = dict(module.named_parameters())
        named.update(module.named_buffers())
        self.module_feeds = [
            None if f.kind == "input" else named[str(f.where)] for f in self.captured.feeds
        ]
        self.input_index = [int(f.where) if f.kind == "input" else -1 for f in self.captured.feeds]

    def __call__(self, *inputs: torch.Tensor) -> Any:
        feeds = [
            t if t is not None else inputs[k]
            for t, k in zip(self.module_feeds, self.input_index, strict=True)
        ]
        return self.captured.output_spec.rebuild(self.program.run(feeds))


def _step(
    call: Callable[..., Any],
    inputs: tuple[torch.Tensor, ...],
    loss: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss(call(*inputs)).backward()
    optimizer.step()
    return time.perf_counter() - start


def measure(name: str, threads: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    eager, inputs, loss = MODELS[name]()
    model, _, _ = MODELS[name]()
    plain = _Plain(model, inputs)
    sides = {
        "eager": (eager, torch.optim.AdamW(eager.parameters(), lr=1e-4)),
        "plain": (plain, torch.optim.AdamW(model.parameters(), lr=1e-4)),
    }
    times: dict[str, list[float]] = {"eager": [], "plain": []}
    for k in range(warmup + steps):
        order = ("eager", "plain") if k % 2 == 0 else ("plain", "eager")
        for side in order:
            call, optimizer = sides[side]
            took = _step(call, inputs, loss, optimizer)
            if k >= warmup:
                times[side].append(took)
    eager_ms = statistics.median(times["eager"]) * 1e3
    plain_ms = statistics.median(times["plain"]) * 1e3
    return {
        "model": name,
        "threads": threads,
        "eager_ms": round(eager_ms, 3),
        "plain_ms": round(plain_ms, 3),
        "ratio": round(plain_ms / eager_ms, 3),
    }


def first_call(name: str) -> float:
    """Seconds from nothing imported but torch to the end of the first training step."""
    model, inputs, loss = MODELS[name]()
    start = time.perf_counter()
    plain = _Plain(model, inputs)
    loss(plain(*inputs)).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--first-call", help=argparse.SUPPRESS)  # the subprocess's job
    args = parser.parse_args()
    if args.first_call:
        print(json.dumps({"seconds": first_call(args.first_call)}))
        return
    rows = []
    for name in args.models.split(","):
        for threads in map(int, args.threads.split(",")):
            row = measure(name, threads, args.steps, args.warmup)
            rows.append(row)
            print(
                f"{name:15s} threads={threads}  eager {row['eager_ms']:8.2f} ms  "
                f"plain {row['plain_ms']:8.2f} ms  ratio {row['ratio']:.3f}",
                flush=True,
            )
    cold = subprocess.run(
        [sys.executable, __file__, "--first-call", "transformer"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    cold_s = json.loads(cold.stdout.strip().splitlines()[-1])["seconds"]
    warm_s = first_call("transformer")
    print(f"first call, transformer layer: cold {cold_s:.2f} s, warm process {warm_s:.2f} s")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "steps": rows,
                "first_call_seconds": {"cold": round(cold_s, 3), "warm": round(warm_s, 3)},
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
