"""Calls of selected classes that torch.compile runs: counted for the report, said once.

A compiled call runs as torch.compile compiles it, never in ONNX Runtime. The patched `__call__`
(patcher.py) calls `compiled_call` when dynamo traces the frame it compiles: dynamo runs it
after its graph on every call, since it is one of dynamo's reorderable logging functions
(`count_compiled_calls`), instead of breaking the graph there. In the frames dynamo inlines (a
selected class inside another compiled module) it drops such calls, so there only
`compiled_trace`, run by `comptime` while dynamo traces, counts the trace.

A module of its own because it is the one place that knows dynamo's hooks; the patcher only
calls it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ort_autopatch import report
from ort_autopatch.config import BY_NAME

log = logging.getLogger("ort_autopatch")

#: torch._dynamo's `comptime`, once `compiled_call` is one of its reorderable logging functions
#: (None before: the patched call then makes nothing, as dynamo would break its graph on it)
dynamo_comptime: Any = None

_said: set[str] = set()  # classes told about torch.compile (again after `forget`)


def compiled_call(name: str) -> None:
    """Count a call of the class `name` that torch.compile runs, and say once what happens."""
    stats = report.stats_for(name)
    with stats.lock:
        stats.compiled_calls += 1
    _say_compiled(name)


def compiled_trace(name: str) -> None:
    """Count a call of the class `name` that torch.compile traced into a graph (the only sign
    of a selected class compiled inside another module's graph), and say once what happens."""
    stats = report.stats_for(name)
    with stats.lock:
        stats.compiled_traces += 1
    _say_compiled(name)


def forget(name: str) -> None:
    """Say it anew for the class `name` (unpatched, and maybe patched again)."""
    _said.discard(name)


def _say_compiled(name: str) -> None:
    if name not in _said:
        _said.add(name)
        log.warning(
            "%s is compiled by torch.compile: its calls run as torch.compile compiles them, "
            "not in ONNX Runtime (the report counts them as compiled_calls, and inside another "
            "compiled module only their traces, compiled_traces); leave the selected class "
            "uncompiled to train it in ONNX Runtime, or exclude it (%s) to silence this",
            name,
            BY_NAME["exclude"].env,
        )


def count_compiled_calls(loaded: bool = False) -> None:
    """Let torch.compile count the calls of selected classes, once torch._dynamo has loaded
    (the import hook calls this after its package ran; `patch` when it had): dynamo defers its
    reorderable logging functions (`compiled_call`) to after its graph, on every call,
    instead of breaking the graph there, and runs `comptime` functions while it traces.
    Importing torch._dynamo here would cost every run a second, so a class patched by hand
    without `install()` before torch.compile loads is not counted. `loaded`: its package body
    has run (importlib still marks it initializing until the import returns)."""
    global dynamo_comptime
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    if not loaded and getattr(getattr(dynamo, "__spec__", None), "_initializing", False):
        return  # still loading, on another thread (its submodules may not import yet)
    from torch._dynamo import comptime, config

    config.reorderable_logging_functions.add(compiled_call)
    dynamo_comptime = comptime.comptime
