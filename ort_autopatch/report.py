"""Counters per selected class (what ran where, and why) and the exit report built from them."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ort_autopatch.engine.hazards import Hazard
    from ort_autopatch.engine.recipe import BuildRecord
    from ort_autopatch.engine.verify import Verification


@dataclass
class ClassStats:
    """One selected class's counters. Also the engine's listener (`engine/events.py`) for
    every instance of the class: builds, trace hazards and `--verify` comparisons are counted
    as the engine tells them."""

    instances: int = 0
    ort_calls: int = 0
    compiled_calls: int = 0  # calls torch.compile ran (torch.compile(model), model.compile())
    compiled_traces: int = 0  # its traces of a call (also inside another compiled module)
    eager_calls: Counter[str] = field(default_factory=Counter)
    exports: int = 0
    cache_loads: int = 0  # graphs loaded from the persistent cache instead of exported
    rebuilds: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[tuple[str, str]] = field(default_factory=Counter)
    export_seconds: float = 0.0
    build_seconds: float = 0.0  # gradient build and session creation (or loading from disk)
    ignored_writes: int = 0
    # operators running as torch-calling nodes inside this class's graphs (most per graph)
    torch_nodes: Counter[str] = field(default_factory=Counter)
    # what traces froze, (kind, what, user's file:line) -> times seen (engine/hazards.py)
    trace_hazards: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    per_shape_graphs: int = 0  # graphs built for one input shape (the model specialises)
    static_shape_graphs: int = 0  # static-shape graphs for input shapes that kept coming back
    # --verify: calls compared with eager, the worst differences, mismatches, unverified calls
    verified_calls: int = 0
    verify_mismatches: int = 0
    verify_worst: dict[str, float] = field(default_factory=dict)
    unverified: Counter[str] = field(default_factory=Counter)
    # Threads share a class's counters; `+=` on them is not atomic.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def built(self, record: BuildRecord) -> None:
        with self.lock:
            if record.from_disk:
                self.cache_loads += 1
            else:
                self.exports += 1
            self.export_seconds += record.export_seconds
            self.build_seconds += record.build_seconds
            for label, count in record.torch_nodes.items():
                self.torch_nodes[label] = max(self.torch_nodes[label], count)
            if record.reason != "first call":
                self.rebuilds[record.reason] += 1
            if record.per_shape:
                self.per_shape_graphs += 1
            if record.hot_shape:
                self.static_shape_graphs += 1

    def found(self, hazard: Hazard) -> None:
        with self.lock:
            self.trace_hazards[(hazard.kind, hazard.what, hazard.where)] += 1

    def verified(self, verification: Verification) -> None:
        with self.lock:
            if verification.unverified is not None:
                self.unverified[verification.unverified] += 1
                return
            self.verified_calls += 1
            self.verify_mismatches += verification.mismatch is not None
            for name in ("output_diff", "output_rel", "grad_diff", "grad_rel"):
                value = getattr(verification, name)
                self.verify_worst[name] = max(self.verify_worst.get(name, 0.0), value)

    def as_dict(self) -> dict[str, Any]:
        """The per-class keys of the report (docs/report.md)."""
        return {
            "instances": self.instances,
            "ort_calls": self.ort_calls,
            "compiled_calls": self.compiled_calls,
            "compiled_traces": self.compiled_traces,
            "eager_calls": sum(self.eager_calls.values()),
            "eager_reasons": [{"reason": r, "count": c} for r, c in self.eager_calls.items()],
            "exports": self.exports,
            "cache_loads": self.cache_loads,
            "rebuilds": [{"reason": r, "count": c} for r, c in self.rebuilds.items()],
            "fallbacks": [
                {"reason": r, "detail": d, "count": c} for (r, d), c in self.fallbacks.items()
            ],
            "export_seconds": round(self.export_seconds, 4),
            "build_seconds": round(self.build_seconds, 4),
            "ignored_writes": self.ignored_writes,
            "torch_nodes": {
                "count": sum(self.torch_nodes.values()),
                "operators": dict(sorted(self.torch_nodes.items())),
            },
            "trace_hazards": [
                {"kind": k, "what": w, "where": at, "count": c}
                for (k, w, at), c in self.trace_hazards.items()
            ],
            "per_shape_graphs": self.per_shape_graphs,
            "static_shape_graphs": self.static_shape_graphs,
            "verify": {
                "calls": self.verified_calls,
                "mismatches": self.verify_mismatches,
                **{f"worst_{k}": v for k, v in sorted(self.verify_worst.items())},
                "unverified": [{"reason": r, "count": c} for r, c in self.unverified.items()],
            },
        }


_lock = threading.Lock()
_stats: dict[str, ClassStats] = {}


def stats_for(name: str) -> ClassStats:
    """The counters of the class `module:qualname` (created on first use)."""
    found = _stats.get(name)
    if found is None:
        with _lock:
            found = _stats.setdefault(name, ClassStats())
    return found


def snapshot() -> dict[str, dict[str, Any]]:
    with _lock:
        return {name: s.as_dict() for name, s in _stats.items()}


def reset() -> None:
    with _lock:
        _stats.clear()


# -- the exit report ------------------------------------------------------------------------------
# Nothing below imports torch or onnxruntime: versions come from package metadata (or from torch
# when the run already imported it), so writing a report never costs an import at exit.


def prepare() -> None:
    """Import what `build`/`write` need, so that nothing is imported at interpreter exit."""
    import importlib.metadata  # noqa: F401
    import json  # noqa: F401
    import tempfile  # noqa: F401

    import ort_autopatch.engine.runtime
    import ort_autopatch.files  # noqa: F401


def distribution_version(*names: str) -> str | None:
    """Version of the first installed distribution among `names`, from package metadata."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


#: the `backend` option of the installed configuration (`install` says it; None: nothing is
#: installed). Told rather than asked for, so this module never imports the package root.
_installed_backend: str | None = None


def installed_backend(name: str | None) -> None:
    global _installed_backend
    _installed_backend = name


def versions() -> dict[str, str | None]:
    """The tool's, torch's and ONNX Runtime's versions, without importing either library."""
    import sys

    from ort_autopatch.engine import backend as registry
    from ort_autopatch.engine import runtime
    from ort_autopatch.versions import __version__

    torch_mod = sys.modules.get("torch")
    torch_version = getattr(torch_mod, "__version__", None) or distribution_version("torch")
    # the backend this run's graphs ran on (the engine decided it); before any graph, the one
    # it will decide; None when nothing was installed (see "refused")
    ran = registry.chosen()
    backend = ran[0] if ran else None
    if backend is None and _installed_backend is not None:
        backend = registry.resolve(_installed_backend)
    return {
        "version": __version__,
        "torch": None if torch_version is None else str(torch_version),
        "onnxruntime": registry.version(backend) if backend is not None else runtime.version(),
        "backend": backend,
    }


def build(
    unmatched: list[str],
    refused: str | None = None,
    named: Callable[[str], bool] = lambda name: True,
) -> dict[str, Any]:
    """The report (docs/report.md): versions, why nothing was accelerated if the tool refused
    the run, per-class counters, patterns that matched nothing.

    A class that was never called is listed only when a pattern `named` it outright: a wildcard
    over a package selects every helper module class in it (`torchvision.models.*:*` patches
    about 130 blocks and layers that run inside the models' graphs), and those are counted.
    """
    classes = snapshot()
    listed = {name: c for name, c in classes.items() if c["instances"] or named(name)}
    return {
        **versions(),
        "refused": refused,
        "classes": listed,
        "uncalled_classes": len(classes) - len(listed),
        "unmatched": list(unmatched),
    }


def report_path(template: str, rank: int | None) -> str | None:
    """Where this process writes the report, or None: `{rank}` gives each rank its own file,
    otherwise only rank 0 (or a run without ranks) writes, so ranks never clobber one file."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank or 0))
    return template if not rank else None


def write(path: str, data: dict[str, Any]) -> None:
    """Write the JSON report atomically (a reader never sees half a file)."""
    import json
    import os

    from ort_autopatch.files import write_atomically

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))


def summary(data: dict[str, Any], max_classes: int = 12) -> str:
    """One screen of text: which classes ran in ORT, how many calls, exports, and why not."""
    lines = [
        f"ort_autopatch {data.get('version')} summary "
        f"(torch {data.get('torch')}, onnxruntime {data.get('onnxruntime')})"
    ]
    classes: dict[str, dict[str, Any]] = data.get("classes", {})
    if data.get("refused"):
        lines.append(f"  nothing accelerated, the script ran in PyTorch: {data['refused']}")
    elif not classes and data.get("uncalled_classes"):
        lines.append(f"  none of the {data['uncalled_classes']} selected classes was called")
    elif not classes:
        lines.append("  no selected class was created in this process")
    else:
        width = min(max(len(name) for name in classes), 48)
        lines.append(
            f"  {'class':<{width}} {'inst':>5} {'ORT calls':>10} {'eager':>7} "
            f"{'exports':>8} {'cached':>7} {'build s':>8}"
        )
        shown = sorted(classes.items())[:max_classes]
        for name, c in shown:
            seconds = c["export_seconds"] + c.get("build_seconds", 0.0)
            lines.append(
                f"  {_clip_left(name, width):<{width}} {c['instances']:>5} {c['ort_calls']:>10} "
                f"{c['eager_calls']:>7} {c['exports']:>8} {c.get('cache_loads', 0):>7} "
                f"{seconds:>8.2f}"
            )
            why = [f"rebuilt: {r['reason']} x{r['count']}" for r in c.get("rebuilds", [])]
            why += [
                f"eager: {r['reason']} x{r['count']}"
                for r in c.get("eager_reasons", [])
                if not r["reason"].startswith("fallback: ")
            ]
            why += [
                f"fell back: {r['reason']} ({_clip(r['detail'], 60)}) x{r['count']}"
                for r in c.get("fallbacks", [])
            ]
            if c.get("compiled_calls") or c.get("compiled_traces"):
                why.insert(
                    0,
                    f"torch.compile ran {c.get('compiled_calls', 0)} calls "
                    f"({c.get('compiled_traces', 0)} traces)",
                )
            nodes = c.get("torch_nodes", {})
            if nodes.get("count"):
                ops = ", ".join(f"{op} x{n}" for op, n in nodes["operators"].items())
                why.insert(0, f"torch-calling nodes: {nodes['count']} ({ops})")
            lines.extend(f"    {_clip(text, 96)}" for text in why[:4])
            if len(why) > 4:
                lines.append(f"    ... {len(why) - 4} more reasons in the JSON report")
        if len(classes) > max_classes:
            lines.append(f"  ... {len(classes) - max_classes} more classes in the JSON report")
        if data.get("uncalled_classes"):
            lines.append(
                f"  and {data['uncalled_classes']} classes a wildcard selected, never called "
                "(blocks of the models above run inside their graphs)"
            )
    unmatched = data.get("unmatched", [])
    if unmatched:
        lines.append(f"  patterns that matched no class: {', '.join(unmatched)}")
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _clip_left(text: str, width: int) -> str:
    # Class names keep their informative end: "...modeling_bert:BertForSequenceClassification".
    return text if len(text) <= width else "..." + text[len(text) - width + 3 :]
