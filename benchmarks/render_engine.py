"""Regenerate README's engine benchmark table (between `<!-- engine:start -->` and
`<!-- engine:end -->`) from benchmarks/results/engine.json (the training build, `ort-training`)
and plain.json (the plain backend, `ort`), side by side, so the README's headline numbers are
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
PLAIN = ROOT / "benchmarks" / "results" / "plain.json"
README = ROOT / "README.md"
START, END = "<!-- engine:start -->", "<!-- engine:end -->"


def _ratio(model: dict[str, Any] | None, threads: str) -> str:
    run = (model or {}).get("threads", {}).get(threads)
    return "" if run is None else f"{run['ratio_engine_over_eager']:.2f}"


def _first(model: dict[str, Any] | None) -> str:
    first = (model or {}).get("first_call_fresh_process_s")
    return "" if first is None else f"{first:.2f} s"


def _source(results: dict[str, Any], file: str, build: str) -> str:
    env = results["environment"]
    loads = [*env["load_average"], *env.get("load_average_after", [])]
    low, high = min(loads), max(loads)
    return (
        f"{file} of {env['date']}: {build} {env['onnxruntime']}, load average {low:.1f} to "
        f"{high:.1f}"
    )


def _runs(*results: dict[str, Any]) -> str:
    """Which fresh processes a first call comes from: the median of several since they were
    measured so, one before."""
    counts = sorted({int(r["environment"].get("fresh_runs", 1)) for r in results})
    if counts == [1]:
        return "in one fresh process"
    return f"the median of {' and '.join(str(c) for c in counts)} fresh processes"


def table(training: dict[str, Any], plain: dict[str, Any]) -> str:
    """The markdown block: one row per model, each backend's ratios and first call, and where
    the numbers come from."""
    lines = [
        "| model | `ort-training` 1 thread | 2 threads | first call "
        "| `ort` 1 thread | 2 threads | first call |",
        "|---|---|---|---|---|---|---|",
    ]
    names = list(training["models"]) + [n for n in plain["models"] if n not in training["models"]]
    for name in names:
        ours, theirs = training["models"].get(name), plain["models"].get(name)
        description = (ours or theirs or {})["description"]
        cells = [_ratio(ours, "1"), _ratio(ours, "2"), _first(ours)]
        cells += [_ratio(theirs, "1"), _ratio(theirs, "2"), _first(theirs)]
        lines.append(f"| {description} | {' | '.join(cells)} |")
    env = training["environment"]
    lines.append("")
    lines.append(
        "Step time ORT/eager, each side in a process of its own, steps taken in turn (the "
        "JSON's `same_process`: both in one process); first call: capture or export, "
        "gradient graph, sessions and the first step (the `ort` backend's first call also "
        "runs eagerly for its check), "
        f"{_runs(training, plain)}. "
        f"torch {env['torch']}, {env['cpu_count']} CPUs; "
        f"{_source(training, '`engine.json`', 'onnxruntime-training')}; "
        f"{_source(plain, '`plain.json`', 'onnxruntime')}."
    )
    return "\n".join(lines)


def render(readme: str, block: str) -> str:
    return render_zoo.render(readme, block, START, END)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    current = README.read_text(encoding="utf-8")
    updated = render(current, table(json.loads(RESULTS.read_text()), json.loads(PLAIN.read_text())))
    if args.check:
        if updated != current:
            print("README.md's engine table is stale; run python benchmarks/render_engine.py")
            return 1
        return 0
    README.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
