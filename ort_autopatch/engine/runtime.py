"""Loading ONNX Runtime, lazily and cheaply, and which of its builds are installed.

`import onnxruntime` runs a package validation that tries to import ORTModule; on torch >= 2.6 that
import fails after ~0.4 s and, where it succeeds, replaces `torch.manual_seed` and
`torch.utils.checkpoint.checkpoint`. The engine only needs the C++ primitives, so it hides
`onnxruntime.training` for the duration of the first import: the validation then sees a
non-ORTModule build, torch stays untouched and the import costs a few tens of milliseconds.
Which build a backend needs is the backend's to ask for (`load(training=...)`, `backends/`).
"""

from __future__ import annotations

import functools
import sys
import threading
from types import ModuleType
from typing import Any

from ort_autopatch.engine.errors import RuntimeUnavailableError

TRAINING_DISTRIBUTIONS = ("onnxruntime-training", "onnxruntime-training-cpu")
INFERENCE_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")

_lock = threading.Lock()
_capi: ModuleType | None = None
_ort: ModuleType | None = None


def installed_distributions() -> dict[str, str]:
    """Installed ONNX Runtime distributions and their versions, from package metadata."""
    return dict(_read_distributions())


@functools.cache
def _read_distributions() -> tuple[tuple[str, str], ...]:
    """Read once a process: each read walks every `sys.path` entry's metadata (1.25 ms here),
    and every call computes a store key while its graph builds aside (`persist.static_key`)."""
    from importlib import metadata

    found: list[tuple[str, str]] = []
    for name in TRAINING_DISTRIBUTIONS + INFERENCE_DISTRIBUTIONS:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return tuple(found)


def training_build_missing() -> str | None:
    """Why ONNX Runtime's training build cannot run here (which package to install), or
    None. Reads package metadata only."""
    return _training_reason(installed_distributions())


def plain_build_missing() -> str | None:
    """Why the maintained, inference-only onnxruntime (with onnxscript) cannot run here, or
    None. Reads package metadata only."""
    return _plain_reason(installed_distributions())


def _training_reason(found: dict[str, str]) -> str | None:
    if any(name in found for name in TRAINING_DISTRIBUTIONS):
        return None
    if sys.version_info >= (3, 12):
        return (
            f"onnxruntime-training has no wheels for Python {sys.version_info.major}."
            f"{sys.version_info.minor} (its last release, 1.19.2, stops at 3.11); "
            "use the plain backend (--backend ort, ort-autopatch[cpu]) or Python <= 3.11"
        )
    if found:
        names = ", ".join(f"{k}=={v}" for k, v in found.items())
        return (
            f"{names} is an inference-only build; the training build needs "
            "ort-autopatch[training-cpu] (onnxruntime-training-cpu) or "
            "ort-autopatch[training-gpu] (onnxruntime-training) instead"
        )
    return (
        "no ONNX Runtime training build is installed; install ort-autopatch[training-cpu] or "
        "ort-autopatch[training-gpu]"
    )


def _plain_reason(found: dict[str, str]) -> str | None:
    import importlib.util

    training = [name for name in found if name in TRAINING_DISTRIBUTIONS]
    if training:
        return (
            f"{training[0]}=={found[training[0]]} is installed, whose 'onnxruntime' package "
            "replaces the maintained one; uninstall it and install ort-autopatch[cpu] "
            "(onnxruntime) or ort-autopatch[gpu] (onnxruntime-gpu)"
        )
    if not found:
        return (
            "no ONNX Runtime is installed; install ort-autopatch[cpu] (onnxruntime) or "
            "ort-autopatch[gpu] (onnxruntime-gpu)"
        )
    if importlib.util.find_spec("onnxscript") is None:
        return (
            "the plain backend needs onnxscript beside onnxruntime; install ort-autopatch[cpu] "
            "or ort-autopatch[gpu]"
        )
    return None


def load(training: bool = True) -> tuple[ModuleType, ModuleType]:
    """Import onnxruntime and its C API once; raise RuntimeUnavailableError with the reason.

    `training=False` accepts an inference-only build (what the plain backend and sessions
    need); otherwise a build without the training primitives is refused."""
    global _capi, _ort
    if _capi is None or _ort is None:
        with _lock:
            if _capi is None or _ort is None:
                _ort, _capi = _import()
    if training and not hasattr(_capi, "OrtModuleGraphBuilder"):
        reason = training_build_missing() or "this onnxruntime has no training support"
        raise RuntimeUnavailableError("", reason, "Install a training build")
    return _ort, _capi


def _import() -> tuple[ModuleType, ModuleType]:
    hide = "onnxruntime" not in sys.modules and "onnxruntime.training" not in sys.modules
    if hide:
        # A None entry makes `import onnxruntime.training...` raise ImportError at once.
        sys.modules["onnxruntime.training"] = None  # type: ignore[assignment]
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state as capi
    except ImportError as exc:
        found = installed_distributions()
        reason = (_training_reason(found) and _plain_reason(found)) or (
            f"importing onnxruntime failed: {exc}"
        )
        raise RuntimeUnavailableError("", reason, "Run the model eagerly") from exc
    finally:
        if hide and sys.modules.get("onnxruntime.training", 0) is None:
            del sys.modules["onnxruntime.training"]
    # ORT's C++ logger writes straight to stderr (warnings about unassigned nodes, kernel
    # errors before they are raised); those errors reach users through the tool's messages.
    onnxruntime.set_default_logger_severity(4)
    return onnxruntime, capi


def version(distributions: tuple[str, ...] = ()) -> str | None:
    """ONNX Runtime's version without importing it: that of the first of `distributions`
    installed, or of any (a training build's first)."""
    found = installed_distributions()  # training builds first
    if distributions:
        found = {k: v for k, v in found.items() if k in distributions}
    return next(iter(found.values()), None)


def gpu_remedy() -> str:
    """What to install for GPU tensors, for the build this interpreter has: the maintained
    onnxruntime-gpu (the plain backend), or the training build's CUDA package where that build
    is the one installed. Reads package metadata only."""
    found = installed_distributions()
    if "onnxruntime-training-cpu" in found:
        return (
            "Install ort-autopatch[training-gpu] (onnxruntime-training 1.19.2, CUDA 11.8) in "
            "place of onnxruntime-training-cpu, or use the plain backend's "
            "ort-autopatch[gpu] (onnxruntime-gpu) in a fresh environment, or run on CPU"
        )
    if "onnxruntime-training" in found:  # the CUDA build, its provider missing or unloadable
        return (
            "onnxruntime-training's CUDA provider needs the CUDA 11.8 and cuDNN 8 libraries "
            "(nvidia-*-cu11 wheels, as benchmarks/gpu_check.sh installs); or use the plain "
            "backend's ort-autopatch[gpu] (onnxruntime-gpu) in a fresh environment, or run on CPU"
        )
    if "onnxruntime-gpu" in found:
        return (
            "onnxruntime-gpu is installed but offers no CUDA provider here: check that the "
            "CUDA libraries it was built for are installed (python -m ort_autopatch --check), "
            "or run on CPU"
        )
    return (
        "Install ort-autopatch[gpu] (onnxruntime-gpu) in place of onnxruntime "
        "(pip uninstall onnxruntime first: both install the 'onnxruntime' package), "
        "or run on CPU"
    )


def cuda_version() -> str | None:
    """The CUDA version ("13.0") the installed ONNX Runtime's CUDA provider is built for, from
    its build info (`onnxruntime/capi/build_and_package_info.py`, read, not imported); None for
    a build without CUDA, or when no ONNX Runtime is installed."""
    import ast
    import importlib.util
    import os

    spec = importlib.util.find_spec("onnxruntime")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "capi", "build_and_package_info.py")
        try:
            with open(path, encoding="utf-8") as file:
                tree = ast.parse(file.read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "cuda_version" for t in node.targets)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and node.value.value
            ):
                return node.value.value
    return None


#: torch's wheel index for each CUDA major an onnxruntime-gpu may be built for (PyPI's
#: onnxruntime-gpu 1.31.1: CUDA 13.0 and cuDNN 9; older releases: CUDA 12).
TORCH_CUDA_INDEX = {
    "12": "https://download.pytorch.org/whl/cu126",
    "13": "https://download.pytorch.org/whl/cu130",
}


def cuda_mismatch(torch_cuda: str | None, backend: str | None) -> tuple[str, bool] | None:
    """Whether torch's CUDA build (`torch.version.cuda`) and ONNX Runtime's CUDA provider are
    built for different CUDA majors: (what to say, whether it is a problem), or None when they
    match or either side has no CUDA. On the plain backend it is a problem: onnxruntime-gpu
    finds its CUDA libraries beside torch's, and a different major has none. The training
    build's CUDA 11.8 is never torch's (torch has no CUDA 11 build in the tested range): it
    needs CUDA 11 libraries of its own, a note."""
    ort_cuda = cuda_version()
    if not ort_cuda or not torch_cuda:
        return None
    ort_major, torch_major = ort_cuda.split(".")[0], torch_cuda.split(".")[0]
    if ort_major == torch_major:
        return None
    name = next(iter(installed_distributions()), "onnxruntime")
    both = f"torch is built for CUDA {torch_cuda}, {name}'s CUDA provider for CUDA {ort_cuda}"
    if backend == "ort-training":
        return (
            f"{both}: the training build loads CUDA {ort_major} libraries of its own "
            f"(nvidia-*-cu{ort_major} wheels on LD_LIBRARY_PATH, as benchmarks/gpu_check.sh "
            "installs them)",
            False,
        )
    index = TORCH_CUDA_INDEX.get(ort_major, f"the cu{ort_major}x index of your torch release")
    return (
        f"{both}, so GPU tensors cannot run in ONNX Runtime; install torch's CUDA {ort_major} "
        f"build (pip install torch --index-url {index}), or an onnxruntime-gpu built for "
        f"CUDA {torch_major}",
        True,
    )


def available_providers() -> list[str]:
    ort, _ = load(training=False)
    providers: list[str] = ort.get_available_providers()
    return providers


def capi() -> Any:
    """The C API of whichever build is installed (sessions and values need no training)."""
    return load(training=False)[1]
