"""Everything that touches ONNX Runtime lives here, and imports it lazily.

Public surface: `ModuleEngine` runs one module's calls through cached ORT graphs; `is_exporting`
tells patched classes to step aside while the engine traces them.
"""

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
