"""The engine benchmark (`bench_engine.py`: step time, first call, peak memory against eager
PyTorch) on the plain backend: inference-only onnxruntime, graphs from torch's autograd.

    python benchmarks/bench_plain.py [bench_engine.py's options]

The same models, measurement and JSON layout as the training build's run, so README's table
(`render_engine.py`) sets the two side by side. It needs an environment with the plain
`onnxruntime` (`nox -s bench_plain`, which `nox -s bench` runs): the two builds cannot share
one. The first call includes the plain backend's check of that call against eager.

Results: benchmarks/results/plain.json, and a table on stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import bench_engine  # beside this script: the measurement itself

RESULTS = Path(__file__).resolve().parent / "results" / "plain.json"

if __name__ == "__main__":
    sys.exit(bench_engine.main(sys.argv[1:], backend="ort", output=RESULTS, doc=__doc__))
