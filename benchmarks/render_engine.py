"""Regenerate README's engine benchmark table (between `<!-- engine:start -->` and
`<!-- engine:end -->`) from benchmarks/results/engine.json, so the README's headline numbers are
those of the last `nox -s bench` run; nothing else in README.md changes.

    python benchmarks/render_engine.py [--check]

`--check` exits 1 when the README's table is not what the results give (`nox -s lint`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import render_zoo  # beside this script: its README splice

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "engine.json"
README = ROOT / "README.md"
START, END = "<!-- engine:start -->", "<!-- engine:end -->"


def _ratio(model: dict[str, Any], threads: str) -> str:
    run = model.get("threads", {}).get(threads)
    return "" if run is None else f"{run['ratio_engine_over_eager']:.2f}"


def table(results: dict[str, Any]) -> str:
    """The markdown block: one row per model, and where the numbers come from."""
    env = results["environment"]
    lines = [
        "| model | step time ORT/eager, 1 thread | 2 threads | first call |",
        "|---|---|---|---|",
    ]
    for model in results["models"].values():
        first = model.get("first_call_fresh_process_s")
        shown = "" if first is None else f"{first:.2f} s"
        lines.append(
            f"| {model['description']} | {_ratio(model, '1')} | {_ratio(model, '2')} | {shown} |"
        )
    low, high = min(env["load_average"]), max(env["load_average"])
    lines.append("")
    lines.append(
        f"Run of {env['date']} (`benchmarks/results/engine.json`; torch {env['torch']}, "
        f"onnxruntime-training {env['onnxruntime']}, {env['cpu_count']} CPUs, load average "
        f"{low:.1f} to {high:.1f}). First call: export, gradient build and session in a fresh "
        "process."
    )
    return "\n".join(lines)


def render(readme: str, block: str) -> str:
    return render_zoo.render(readme, block, START, END)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    current = README.read_text(encoding="utf-8")
    updated = render(current, table(json.loads(RESULTS.read_text())))
    if args.check:
        if updated != current:
            print("README.md's engine table is stale; run python benchmarks/render_engine.py")
            return 1
        return 0
    README.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
