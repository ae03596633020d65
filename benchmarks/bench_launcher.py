"""What ``python -m ort_autopatch`` costs a run that accelerates nothing.

The same script (import torch, a short eager training loop) runs as ``python script.py`` and as
``python -m ort_autopatch --modules nothing.matches:This script.py``: the difference is the
launcher's whole overhead (its imports, the import hook on every later import, the
``__init_subclass__`` hook, the environment export), since no class is selected. Runs alternate
between the two commands so that drift hits both alike; the median of each is compared.

    python benchmarks/bench_launcher.py [--repeat 9]

Prints a table and writes benchmarks/results/launcher.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "launcher.json"

SCRIPT = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
for _ in range(50):
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(round(loss.item(), 4))
"""


def _time(command: list[str], env: dict[str, str], cwd: str) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORT_AUTOPATCH")}
    env.update(PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE")
    with tempfile.TemporaryDirectory() as folder:
        script = pathlib.Path(folder, "train.py")
        script.write_text(SCRIPT)
        commands = {
            "python": [sys.executable, str(script)],
            "python -m ort_autopatch": [
                sys.executable,
                "-m",
                "ort_autopatch",
                "--modules",
                "nothing.matches:This",
                str(script),
            ],
        }
        for command in commands.values():  # warm the page cache; check both print the same
            _time(command, env, folder)
        outputs = {name: _time(cmd, env, folder)[1] for name, cmd in commands.items()}
        assert len(set(outputs.values())) == 1, outputs
        samples: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeat):
            for name, command in commands.items():
                samples[name].append(_time(command, env, folder)[0])
    medians = {name: statistics.median(values) for name, values in samples.items()}
    base = medians["python"]
    overhead = medians["python -m ort_autopatch"] / base - 1
    for name, value in medians.items():
        print(f"{name:<26} median {value * 1000:8.1f} ms  (of {args.repeat})")
    print(f"overhead {overhead * 100:+.1f} %  (target <= 5 %)")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(
        json.dumps(
            {
                "what": "wall time of a fresh process: import torch + 50 eager SGD steps",
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "repeat": args.repeat,
                "median_seconds": {k: round(v, 4) for k, v in medians.items()},
                "samples_seconds": {k: [round(v, 4) for v in vs] for k, vs in samples.items()},
                "overhead": round(overhead, 4),
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
