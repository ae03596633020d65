"""One picture of the benchmark results: benchmarks/results/*.json -> report.png.

    python benchmarks/render_report.py [--out benchmarks/results/report.png]

Panels: step time ratio ORT/eager per model (engine benchmark and zoo), first-call time per
model, and the tool's overheads (import hook, launcher, dispatch, warm graph cache). A missing
results file leaves its panel saying so rather than failing the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _missing(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} results", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def step_ratios(
    engine: dict[str, Any] | None, zoo: dict[str, Any] | None
) -> list[tuple[str, float]]:
    rows = []
    for name, m in (engine or {}).get("models", {}).items():
        rows.append((f"{name} (engine)", float(m["ratio_engine_over_eager"])))
    for m in (zoo or {}).get("models", []):
        if m.get("step_ratio") is not None:
            rows.append((m["model"], float(m["step_ratio"])))
    return rows


def first_calls(
    engine: dict[str, Any] | None, zoo: dict[str, Any] | None
) -> list[tuple[str, float]]:
    rows = []
    for name, m in (engine or {}).get("models", {}).items():
        rows.append((f"{name} (engine)", float(m["first_call_in_process_s"])))
    for m in (zoo or {}).get("models", []):
        if m.get("status") == "ort":
            rows.append((m["model"], float(m["first_call_s"])))
    return rows


def overheads(results: dict[str, dict[str, Any] | None]) -> list[tuple[str, float]]:
    """Relative overheads in percent (negative: faster than without the tool)."""
    rows = []
    hook = results.get("import_hook")
    if hook:
        for name, r in hook["results"].items():
            label = "import hook: torch+transformers" + (" + 2 models" if "+" in name else "")
            rows.append((label, 100 * (float(r["overhead_ratio"]) - 1)))
    launcher = results.get("launcher")
    if launcher:
        rows.append(("launcher: 50 eager steps", 100 * float(launcher["overhead"])))
    dispatch = results.get("dispatch")
    if dispatch:
        share = float(dispatch["hit_path_share_of_eager_step_all_checks"])
        rows.append(("dispatch: share of MLP step", 100 * share))
    cache = results.get("cache")
    if cache:
        rows.append(("warm cache: build vs cold", 100 * float(cache["warm_over_cold_build"])))
    return rows


def _bars(
    ax: Axes, rows: list[tuple[str, float]], title: str, xlabel: str, line: float | None
) -> None:
    names = [r[0] for r in rows]
    values = [r[1] for r in rows]
    colors = ["tab:green" if line is None or v <= line else "tab:red" for v in values]
    ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    if line is not None:
        ax.axvline(line, color="black", linewidth=0.8, linestyle="--")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)


def render(out: Path) -> Path:
    names = ("engine", "zoo", "import_hook", "launcher", "dispatch", "cache")
    results = {name: _load(name) for name in names}
    engine, zoo = results["engine"], results["zoo"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 7), constrained_layout=True)
    ratios = step_ratios(engine, zoo)
    if ratios:
        _bars(axes[0], ratios, "Training step time, ORT / eager", "ratio (< 1: ORT faster)", 1.0)
    else:
        _missing(axes[0], "step time")
    calls = first_calls(engine, zoo)
    if calls:
        _bars(axes[1], calls, "First call (export, gradient build, sessions)", "seconds", None)
    else:
        _missing(axes[1], "first-call")
    costs = overheads(results)
    if costs:
        _bars(axes[2], costs, "Overheads of the tool (percent)", "percent", None)
    else:
        _missing(axes[2], "overhead")
    env = (zoo or {}).get("torch") or (engine or {}).get("environment", {}).get("torch", "?")
    fig.suptitle(f"ort_autopatch benchmarks (torch {env}; benchmarks/results/*.json)", fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS / "report.png")
    args = parser.parse_args(argv)
    print(render(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
