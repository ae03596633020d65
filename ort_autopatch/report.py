"""Counters per selected class: what ran where, and why. (The exit report builds on these.)"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClassStats:
    instances: int = 0
    ort_calls: int = 0
    eager_calls: Counter[str] = field(default_factory=Counter)
    exports: int = 0
    rebuilds: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[tuple[str, str]] = field(default_factory=Counter)
    export_seconds: float = 0.0
    ignored_writes: int = 0

    def as_dict(self) -> dict[str, Any]:
        """DESIGN.md's per-class report keys."""
        return {
            "instances": self.instances,
            "ort_calls": self.ort_calls,
            "eager_calls": sum(self.eager_calls.values()),
            "eager_reasons": [{"reason": r, "count": c} for r, c in self.eager_calls.items()],
            "exports": self.exports,
            "rebuilds": [{"reason": r, "count": c} for r, c in self.rebuilds.items()],
            "fallbacks": [
                {"reason": r, "detail": d, "count": c} for (r, d), c in self.fallbacks.items()
            ],
            "export_seconds": round(self.export_seconds, 4),
            "ignored_writes": self.ignored_writes,
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
