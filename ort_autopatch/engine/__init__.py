"""Everything that touches ONNX Runtime lives here, and imports it lazily.

Public surface: `ModuleEngine` runs one module's calls through cached ORT graphs, configured by
`EngineOptions`; `is_exporting` tells patched classes to step aside while the engine traces them,
and `in_untraced_run` that forward runs for the engine outside a trace (its reads guard nothing);
the typed errors (`EngineError` and its subclasses) say why a call could not run in ORT.

The errors import nothing heavy and are imported here. The other names need torch, and are
imported on first use (PEP 562), so that `ort_autopatch.engine.runtime` (package metadata only)
and the errors stay importable without torch; the `TYPE_CHECKING` imports name them for type
checkers and editors, and `_LAZY` says where each lives.

Words used across the engine: a *recipe* is a built graph as plain data (what the persistent
graph cache stores); an *entry* is a recipe made runnable (sessions, feeds); the in-memory
`GraphCache` holds entries per module instance, the on-disk `GraphStore` holds recipes across
runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ort_autopatch.engine.errors import (  # noqa: F401  (re-exported)
    DataDependentError,
    EngineError,
    ExecutionError,
    ExportError,
    FailureKind,
    GradientBuildError,
    MixedDevicesError,
    RuntimeUnavailableError,
    SessionError,
    UnsupportedDeviceError,
    UnsupportedInputError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from ort_autopatch.engine.calls import in_untraced_run, is_exporting  # noqa: F401
    from ort_autopatch.engine.module_engine import ModuleEngine  # noqa: F401
    from ort_autopatch.engine.recipe import BuildRecord, EngineOptions  # noqa: F401

_LAZY = {
    "is_exporting": "calls",
    "in_untraced_run": "calls",
    "BuildRecord": "recipe",
    "EngineOptions": "recipe",
    "ModuleEngine": "module_engine",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'ort_autopatch.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ort_autopatch.engine.{where}"), name)
    globals()[name] = value
    return value
