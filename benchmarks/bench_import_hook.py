"""What the import hook costs at startup: ``import torch, transformers`` with and without it.

Every sample is a fresh interpreter (imports are cached per process, so only a new process
measures them). The hook is installed with an allowlist that matches nothing, the common case for
the thousands of modules torch and transformers load: it shows the cost of the finder's fast
"no" and of the ``__init_subclass__`` chained onto torch.nn.Module. A second statement also
materialises two transformers model modules, which creates many more Module subclasses.
Runs alternate between the variants so that drift (page cache, CPU frequency) hits both alike.

    python benchmarks/bench_import_hook.py [--repeat 5]

Prints a table and writes benchmarks/results/import_hook.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "import_hook.json"

SETUP = {
    "without hook": "",
    "with hook": (
        "from ort_autopatch.hook import ImportHook, Selector\n"
        "ImportHook(Selector(['nothing_matches_this.models:Nope'], []), lambda cls: None)"
        ".install()\n"
    ),
}

STATEMENTS = {
    "import torch, transformers": "import torch, transformers\n",
    "import torch, transformers + BertModel, GPT2LMHeadModel": (
        "import torch, transformers\nfrom transformers import BertModel, GPT2LMHeadModel\n"
    ),
}

PROBE = """\
import time
_t0 = time.perf_counter()
{setup}{statement}_t1 = time.perf_counter()
import sys
_module_subclasses = 0
if "torch" in sys.modules:
    import torch
    _todo = [torch.nn.Module]
    while _todo:
        _cls = _todo.pop()
        _module_subclasses += 1
        _todo.extend(type.__subclasses__(_cls))
print("RESULT", _t1 - _t0, len(sys.modules), _module_subclasses)
"""


def sample(setup: str, statement: str) -> dict[str, float]:
    """One fresh interpreter: in-process import seconds, whole-process seconds, module count."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ORT_AUTOPATCH_")}
    environment["PYTHONPATH"] = str(REPO)
    environment.setdefault("TRANSFORMERS_VERBOSITY", "error")
    code = PROBE.format(setup=setup, statement=statement)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
        timeout=600,
    )
    process_seconds = time.perf_counter() - start
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    _, import_seconds, modules, subclasses = line.split()
    return {
        "import_s": float(import_seconds),
        "process_s": process_seconds,
        "modules": int(modules),
        "module_subclasses": int(subclasses),
    }


MICRO = """\
import sys, time, torch
from ort_autopatch.hook import ImportHook, Selector
names = [f"pkg{i % 3000}.sub.mod" for i in range(300_000)]
hook = ImportHook(Selector(["nothing_matches_this.models:Nope"], []), lambda cls: None)

def create_classes(count):
    start = time.perf_counter()
    for i in range(count):
        type(f"C{i}", (torch.nn.Module,), {"__module__": "some.library"})
    return (time.perf_counter() - start) / count

plain_class_s = min(create_classes(2000) for _ in range(5))
hook.install()
finder = sys.meta_path[0]
start = time.perf_counter()
for name in names:
    finder.find_spec(name, None)
find_spec_s = (time.perf_counter() - start) / len(names)
hooked_class_s = min(create_classes(2000) for _ in range(5))
print("RESULT", find_spec_s, plain_class_s, hooked_class_s)
"""


def micro() -> dict[str, float]:
    """Per-call costs, stable where whole-import timings are noisy."""
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", MICRO], capture_output=True, text=True, check=True, env=environment
    )
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    find_spec_s, plain_s, hooked_s = (float(x) for x in line.split()[1:])
    return {
        "find_spec_unmatched_ns": find_spec_s * 1e9,
        "module_subclass_creation_us_without_hook": plain_s * 1e6,
        "module_subclass_creation_us_with_hook": hooked_s * 1e6,
    }


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="samples per variant (median)")
    args = parser.parse_args()

    results: dict[str, dict[str, Any]] = {}
    for label, statement in STATEMENTS.items():
        for setup in SETUP.values():
            sample(setup, statement)  # warm the page cache; not counted
        samples: dict[str, list[dict[str, float]]] = {variant: [] for variant in SETUP}
        for _ in range(args.repeat):
            for variant, setup in SETUP.items():
                samples[variant].append(sample(setup, statement))
        summary: dict[str, Any] = {}
        for variant, runs in samples.items():
            summary[variant] = {
                "median_import_s": statistics.median(r["import_s"] for r in runs),
                "median_process_s": statistics.median(r["process_s"] for r in runs),
                "min_import_s": min(r["import_s"] for r in runs),  # least disturbed by noise
                "modules_loaded": runs[-1]["modules"],
                "module_subclasses": runs[-1]["module_subclasses"],
                "samples_import_s": [round(r["import_s"], 4) for r in runs],
            }
        base = summary["without hook"]["median_import_s"]
        hooked = summary["with hook"]["median_import_s"]
        summary["overhead_s"] = hooked - base
        summary["overhead_ratio"] = hooked / base
        results[label] = summary

    per_call = micro()
    report = {
        "benchmark": "import_hook",
        "repeat": args.repeat,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "results": results,
        "per_call": per_call,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    print(
        f"python {report['python']}, torch {report['torch']}, "
        f"transformers {report['transformers']}, median of {args.repeat} fresh processes"
    )
    for label, summary in results.items():
        print(f"\n{label}")
        for variant in SETUP:
            row = summary[variant]
            print(
                f"  {variant:13s} import {row['median_import_s']:.3f} s  "
                f"(min {row['min_import_s']:.3f} s)  process {row['median_process_s']:.3f} s  "
                f"({row['modules_loaded']} modules, "
                f"{row['module_subclasses']} nn.Module classes)"
            )
        print(
            f"  overhead      {summary['overhead_s'] * 1000:+.1f} ms "
            f"({(summary['overhead_ratio'] - 1) * 100:+.1f} %)"
        )
    print(
        f"\nper call: finder 'no' {per_call['find_spec_unmatched_ns']:.0f} ns; "
        f"nn.Module subclass creation {per_call['module_subclass_creation_us_without_hook']:.1f}"
        f" -> {per_call['module_subclass_creation_us_with_hook']:.1f} us"
    )
    print(f"wrote {RESULT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
