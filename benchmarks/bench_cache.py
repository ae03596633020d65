"""First call with a cold and a warm persistent graph cache, each in a fresh process.

    python benchmarks/bench_cache.py [--runs 7] [--backend ort]

The build time is what the engine spends on a cache miss (export + gradient build + session,
or loading the stored graphs + session); the first call adds the engine's making (where the
backend is imported, as a patched class's first call does), the first forward and backward.
Targets for the TransformerEncoderLayer: warm build <= 25 % of cold, warm first call <= 0.2 s
(median of the fresh processes, on both backends). Results:
benchmarks/results/cache.json (`--backend ort`, the plain backend: cache_ort.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cache.json"

CHILD = """
import os, sys, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from torch import nn
from ort_autopatch.engine import EngineOptions, ModuleEngine

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
x = torch.randn(16, 64, 256)
# timed from the engine's making on: a patched class makes it at its first call (and with it
# imports the backend)
start = time.perf_counter()
engine = ModuleEngine(layer, EngineOptions(cache_dir=sys.argv[1], backend=sys.argv[2]))
engine(x).sum().backward()
first = time.perf_counter() - start
record = engine.records[0]
print(first, record.export_seconds + record.build_seconds, record.from_disk)
"""


def _child(script: Path, cache: Path, backend: str) -> tuple[float, float, bool]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run(
        [sys.executable, str(script), str(cache), backend],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.split()
    return float(out[0]), float(out[1]), out[2] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--backend", default="auto", choices=("auto", "ort", "ort-training"))
    args = parser.parse_args()
    cold_first, cold_build, warm_first, warm_build = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "child.py"
        script.write_text(CHILD)
        for run in range(args.runs):
            cache = Path(folder) / f"cache{run}"
            first, build, from_disk = _child(script, cache, args.backend)
            assert not from_disk
            cold_first.append(first)
            cold_build.append(build)
            first, build, from_disk = _child(script, cache, args.backend)
            assert from_disk
            warm_first.append(first)
            warm_build.append(build)
    results = {
        "model": "TransformerEncoderLayer d256 h4 ff1024, input 16x64x256, training",
        "backend": args.backend,
        "cold_build_s": round(statistics.median(cold_build), 4),
        "warm_build_s": round(statistics.median(warm_build), 4),
        "warm_over_cold_build": round(
            statistics.median(warm_build) / statistics.median(cold_build), 3
        ),
        "cold_first_call_s": round(statistics.median(cold_first), 4),
        "warm_first_call_s": round(statistics.median(warm_first), 4),
        "warm_first_call_range_s": [round(min(warm_first), 4), round(max(warm_first), 4)],
        "runs": args.runs,
    }
    output = RESULTS if args.backend != "ort" else RESULTS.with_name("cache_ort.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    for key, value in results.items():
        print(f"{key:24} {value}")


if __name__ == "__main__":
    main()
