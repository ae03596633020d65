"""Everything that touches ONNX Runtime lives here, and imports it lazily.

Public surface: `ModuleEngine` runs one module's calls through cached ORT graphs; `is_exporting`
tells patched classes to step aside while the engine traces them. Names are resolved on first
use, so `ort_autopatch.engine.runtime` (which only reads package metadata) can be imported
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ort_autopatch.engine.errors import (
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
    from ort_autopatch.engine.export import is_exporting
    from ort_autopatch.engine.module_engine import BuildRecord, EngineOptions, ModuleEngine

_WHERE = {
    **dict.fromkeys(
        (
            "EngineError",
            "ExecutionError",
            "ExportError",
            "FailureKind",
            "GradientBuildError",
            "MixedDevicesError",
            "RuntimeUnavailableError",
            "SessionError",
            "UnsupportedDeviceError",
            "UnsupportedInputError",
            "UnsupportedModelError",
        ),
        "errors",
    ),
    "is_exporting": "export",
    "BuildRecord": "module_engine",
    "EngineOptions": "module_engine",
    "ModuleEngine": "module_engine",
}

__all__ = [
    "BuildRecord",
    "EngineError",
    "EngineOptions",
    "ExecutionError",
    "ExportError",
    "FailureKind",
    "GradientBuildError",
    "MixedDevicesError",
    "ModuleEngine",
    "RuntimeUnavailableError",
    "SessionError",
    "UnsupportedDeviceError",
    "UnsupportedInputError",
    "UnsupportedModelError",
    "is_exporting",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ort_autopatch.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ort_autopatch.engine.{where}"), name)
    globals()[name] = value
    return value
