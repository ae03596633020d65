"""FSDP2 with the blocks in ONNX Runtime against eager FSDP2: peak memory and step time per rank.

`examples/train_fsdp2.py` runs under torchrun (2 ranks, gloo) with a larger GPT (d256, 4 blocks,
context 128, batch 8 per rank), eagerly and with `__main__:Block` selected, alternating, for
`reshard_after_forward` True (ORT recomputes each block's forward in backward, because FSDP2
frees the gathered parameters in between) and False (ORT keeps its forward state). Peak RSS is
each rank's `ru_maxrss` (ORT's library and sessions included); step time is the median over the
steps after the first (which builds the graphs); the largest difference between the two runs'
final parameters is recorded too.

    python benchmarks/bench_fsdp2.py [--repeat 2] [--steps 8] [--device cpu|cuda]

With `--device cuda` it runs with NCCL (`benchmarks/gpu_check.sh` calls it so). Prints a table
and writes benchmarks/results/fsdp2[-cuda].json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_fsdp2.py"
SIZE = ["--dim", "256", "--layers", "4", "--context", "128", "--batch", "8"]


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(
    out: pathlib.Path, options: list[str], ort: bool, steps: int, device: str, nproc: int
) -> dict[str, Any]:
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    command = (
        [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    )
    command += [
        "--nproc_per_node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        _port(),
    ]
    if ort:
        command += ["-m", "ort_autopatch", "--modules", "__main__:Block"]
        command += ["--report", str(out / "report-{rank}.json")]
    command += [str(SCRIPT), *SIZE, "--steps", str(steps), "--out", str(out), *options]
    if device == "cuda":
        command += ["--device", "cuda"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORT_AUTOPATCH")}
    env.update(PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    subprocess.run(command, env=env, cwd=out.parent, capture_output=True, text=True, check=True)
    ranks = [json.loads((out / f"run-{r}.json").read_text()) for r in range(nproc)]
    result: dict[str, Any] = {
        "peak_rss_mib": max(r["peak_rss_kib"] for r in ranks) / 1024,
        "step_ms": statistics.median(s for r in ranks for s in r["step_seconds"][1:]) * 1000,
    }
    if ort:
        block = json.loads((out / "report-0.json").read_text())["classes"]["__main__:Block"]
        result["ort_calls"], result["eager_calls"] = block["ort_calls"], block["eager_calls"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one GPU each with cuda)")
    args = parser.parse_args()
    configurations = {
        "reshard_after_forward=True": [],
        "reshard_after_forward=False": ["--reshard-after-forward", "false"],
    }
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, options in configurations.items():
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for k in range(args.repeat):
                for ort in (False, True):
                    out = pathlib.Path(folder, f"{name}-{ort}-{k}")
                    runs[ort].append(_run(out, options, ort, args.steps, args.device, args.nproc))
            import torch

            eager_params = torch.load(pathlib.Path(folder, f"{name}-False-0", "params-0.pt"))
            ort_params = torch.load(pathlib.Path(folder, f"{name}-True-0", "params-0.pt"))
            difference = max(
                (ort_params[n] - p).abs().max().item() for n, p in eager_params.items()
            )
            eager_rss = statistics.median(r["peak_rss_mib"] for r in runs[False])
            ort_rss = statistics.median(r["peak_rss_mib"] for r in runs[True])
            eager_ms = statistics.median(r["step_ms"] for r in runs[False])
            ort_ms = statistics.median(r["step_ms"] for r in runs[True])
            rows.append(
                {
                    "configuration": name,
                    "eager_peak_rss_mib": round(eager_rss, 1),
                    "ort_peak_rss_mib": round(ort_rss, 1),
                    "rss_ratio": round(ort_rss / eager_rss, 3),
                    "eager_step_ms": round(eager_ms, 1),
                    "ort_step_ms": round(ort_ms, 1),
                    "step_ratio": round(ort_ms / eager_ms, 3),
                    "ort_calls": runs[True][-1]["ort_calls"],
                    "eager_calls": runs[True][-1]["eager_calls"],
                    "max_param_difference": difference,
                }
            )
    print("configuration                  peak RSS MiB eager / ORT (ratio)   step ms eager / ORT")
    for r in rows:
        print(
            f"{r['configuration']:30} {r['eager_peak_rss_mib']:>7} / {r['ort_peak_rss_mib']:<7}"
            f" ({r['rss_ratio']})  {r['eager_step_ms']:>7} / {r['ort_step_ms']} ({r['step_ratio']})"
        )
    suffix = "" if args.device == "cpu" else f"-{args.device}"
    result = REPO / "benchmarks" / "results" / f"fsdp2{suffix}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    size = " ".join(SIZE)
    result.write_text(
        json.dumps({"model": size, "steps": args.steps, "rows": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
