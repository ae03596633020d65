"""Regenerate README's table of the models at users' size (between `<!-- scale:start -->` and
`<!-- scale:end -->`) from benchmarks/results/scale_ort-training.json (the training build) and
scale_ort.json (the plain backend), which `benchmarks/bench_scale.py` writes, one run per
backend since the two cannot share an environment.

    python benchmarks/render_scale.py [--check]

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
TRAINING = ROOT / "benchmarks" / "results" / "scale_ort-training.json"
PLAIN = ROOT / "benchmarks" / "results" / "scale_ort.json"
README = ROOT / "README.md"
START, END = "<!-- scale:start -->", "<!-- scale:end -->"


def _variant(run: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    return None if run is None else run["variants"].get(name)


def _ratio(run: dict[str, Any] | None, name: str) -> str:
    v = _variant(run, name)
    return "" if v is None else f"{v['ratio_over_eager']:.2f}"


def _step(run: dict[str, Any] | None, name: str) -> str:
    v = _variant(run, name)
    return "" if v is None else f"{v['step_ms'] / 1e3:.2f}"


def _fresh(run: dict[str, Any] | None, name: str, key: str, fmt: str) -> str:
    v = _variant(run, name)
    value = None if v is None else (v.get("fresh_process") or {}).get(key)
    return "" if value is None else fmt.format(value)


def _compile_first(run: dict[str, Any] | None) -> str:
    """torch.compile's first call: a fresh process's, else (`--fresh eager,tool`) the
    benchmark process's, where it found torch's compiler imported and warm."""
    fresh = _fresh(run, "compile", "first_call_s", "{:.0f} s")
    v = _variant(run, "compile")
    if fresh or v is None:
        return fresh
    return f"{v['first_call_in_process_s']:.0f} s in process"


def _gflops(run: dict[str, Any] | None, name: str) -> str:
    v = _variant(run, name)
    return "" if v is None else f"{v['gflops']:.0f} ({v['fraction_of_matmul']:.0%})"


def _losses(*runs: dict[str, Any] | None) -> str:
    """The largest difference of the tool's losses from eager's over both runs' steps, and
    eager's own under a rounding-sized nudge of its parameters."""
    diffs = [v["loss_max_abs_diff"] for r in runs if (v := _variant(r, "tool")) is not None]
    own = [r["eager_nudged_loss_max_abs_diff"] for r in runs if r is not None]
    if not diffs:
        return ""
    return f"{max(diffs):.0e}" + (f" ({max(own):.0e})" if own else "")


def _join(*cells: str) -> str:
    return " / ".join(c or "-" for c in cells)


def _source(results: dict[str, Any], file: str) -> str:
    env = results["environment"]
    loads = [*env["load_average"], *env.get("load_average_after", [])]
    rates = ", ".join(
        f"{m['gflops']:.0f} GFLOP/s at {t} thread{'s' if t != '1' else ''}"
        for t, m in results["matmul"].items()
    )
    skipped = [f"{n} ({m['skipped']})" for n, m in results["models"].items() if m.get("skipped")]
    return (
        f"{file} of {env['date']} ({env['backend']}, onnxruntime {env['onnxruntime']}, torch "
        f"{env['torch']}, {env['steps']} timed steps{', tiny models' if env['tiny'] else ''}, "
        f"load average {min(loads):.1f} to {max(loads):.1f}; matmul {rates}"
        + (f"; skipped: {', '.join(skipped)}" if skipped else "")
        + ")"
    )


def table(training: dict[str, Any], plain: dict[str, Any]) -> str:
    """One row per model and (batch, threads): step ratios, first calls, step peak RSS,
    achieved GFLOP/s and the losses' largest difference from eager's."""
    lines = [
        "| model | batch, threads | eager step `ort-training` / `ort` run "
        "| `ort-training` / eager | `ort` / eager "
        "| torch.compile / eager | first call `ort-training` / `ort` / compile "
        "| step peak RSS eager / `ort-training` / `ort` | GFLOP/s (of matmul) eager / "
        "`ort-training` / `ort` | loss diff (eager's own) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = list(training["models"]) + [n for n in plain["models"] if n not in training["models"]]
    for name in names:
        ours, theirs = training["models"].get(name, {}), plain["models"].get(name, {})
        keys = list(ours.get("runs", {})) + [
            k for k in theirs.get("runs", {}) if k not in ours.get("runs", {})
        ]
        description = (ours or theirs)["description"]
        for key in keys:
            t, p = ours.get("runs", {}).get(key), theirs.get("runs", {}).get(key)
            cells = [
                description,
                key,
                _join(_step(t, "eager"), _step(p, "eager")) + " s",
                _ratio(t, "tool"),
                _ratio(p, "tool"),
                _join(_ratio(t, "compile"), _ratio(p, "compile")),
                _join(
                    _fresh(t, "tool", "first_call_s", "{:.1f} s"),
                    _fresh(p, "tool", "first_call_s", "{:.1f} s"),
                    _compile_first(t),
                ),
                _join(
                    _fresh(t, "eager", "step_peak_rss_mb", "{:.0f}"),
                    _fresh(t, "tool", "step_peak_rss_mb", "{:.0f}"),
                    _fresh(p, "tool", "step_peak_rss_mb", "{:.0f}"),
                )
                + " MB",
                _join(_gflops(t, "eager"), _gflops(t, "tool"), _gflops(p, "tool")),
                _losses(t, p),
            ]
            lines.append(f"| {' | '.join(cells)} |")
        if not keys:
            reason = ours.get("skipped") or theirs.get("skipped") or "not run"
            lines.append(f"| {description} | skipped: {reason} |" + " |" * 8)
    lines += [
        "",
        "Step: forward, loss, backward and AdamW, the median of the timed steps, each variant's "
        "steps interleaved with the others' in one process (torch.compile's ratio from each "
        "backend's run). The backends' runs are separate processes at separate times, each "
        "ratio over its own run's eager step (on these VMs eager's own step moved by up to a "
        "quarter between two runs minutes apart): compare the backends' ratios where their "
        "eager steps agree; "
        "first call and peak RSS from a fresh process per variant; GFLOP/s: "
        "6 x parameters x tokens (transformers), 3 x the forward's FLOPs (ResNet); loss diff: "
        "the tool's largest difference from eager's loss over every step of both runs (eager's "
        "own: its losses from parameters nudged by one float32 rounding step). "
        f"{_source(training, '`scale_ort-training.json`')}; {_source(plain, '`scale_ort.json`')}.",
    ]
    problems = [
        (r["environment"]["backend"], p) for r in (training, plain) for p in r.get("problems", [])
    ]
    if problems:
        lines += ["", "What the runs asserted and found otherwise (the benchmark exited 1):", ""]
        lines += [f"- `{backend}`: {_short(problem)}" for backend, problem in problems]
    return "\n".join(lines)


def _short(problem: str, limit: int = 240) -> str:
    """One line of a problem (the losses it lists are in the JSON)."""
    line = " ".join(problem.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def render(readme: str, block: str) -> str:
    return render_zoo.render(readme, block, START, END)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    current = README.read_text(encoding="utf-8")
    block = table(json.loads(TRAINING.read_text()), json.loads(PLAIN.read_text()))
    updated = render(current, block)
    if args.check:
        if updated != current:
            print("README.md's scale table is stale; run python benchmarks/render_scale.py")
            return 1
        return 0
    README.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
