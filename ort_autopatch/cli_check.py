"""`python -m ort_autopatch --check`: can this interpreter accelerate, and with which settings.

A short diagnosis, printed instead of running anything: Python, torch (and whether this tool is
tested with it), the ONNX Runtime builds installed and the backend they give, its providers,
whether torch's and ONNX Runtime's CUDA libraries pair, the parsed configuration and what the
allowlist selects. Unlike the rest of the launcher it imports
torch and onnxruntime, since the question is whether they work.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ort_autopatch.config import BY_NAME, OPTIONS, Config
from ort_autopatch.versions import __version__


def _check_selection(config: Config, row: Callable[..., str]) -> list[str]:
    """What the allowlist selects. The modules it names literally are imported to look for the
    classes (as the script would import them); `__main__` and wildcard modules can only be
    checked by a run, which warns at exit about every pattern that matched nothing."""
    if not config.modules:
        return [
            row("selection", "nothing selected: give --modules PATTERNS or ORT_AUTOPATCH_MODULES")
        ]
    import importlib

    from ort_autopatch import feedback
    from ort_autopatch.hook import Selector

    selector = Selector(config.modules, config.exclude)
    warnings: list[str] = []
    at_run: list[str] = []
    failed: list[str] = []
    for pattern in config.modules:
        module = pattern.partition(":")[0]
        if module in ("__main__", "__mp_main__") or any(ch in module for ch in "*?["):
            at_run.append(pattern)
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # the user's module failing to import is a finding
            failed.append(pattern)
            warnings.append(f"pattern {pattern!r}: cannot import {module!r}: {exc}")
    candidates = feedback.imported_classes()
    selected = [name for name in candidates if selector.matches(*name.split(":", 1)) and name]
    lines = [row("selection", ", ".join(selected) or "no class found yet")]
    for pattern in selector.unmatched():
        if pattern not in at_run and pattern not in failed:
            warnings.append(feedback.unmatched_message(pattern, candidates))
    lines.extend(f"  WARNING {w}" for w in warnings)
    lines.extend(
        f"  (checked when the script runs: {p})" for p in at_run if p in selector.unmatched()
    )
    return lines


def _backend_lines(config: Config, backend: str, row: Callable[..., str]) -> list[str]:
    """What the backend that will run has to say of its own parts (`Backend.doctor`: the
    training build compiles its ATen executor now, if it is not cached)."""
    from ort_autopatch.engine import backend as backend_registry
    from ort_autopatch.engine.recipe import EngineOptions

    options = EngineOptions(**config.engine_values())
    return [row(label, status) for label, status in backend_registry.doctor(backend, options)]


def _torch_cuda() -> str | None:
    """The CUDA version torch is built for (None: a CPU build, or torch does not import)."""
    try:
        import torch
    except Exception:  # said by check() already
        return None
    return torch.version.cuda


def check(config: Config) -> tuple[str, bool]:
    """A short diagnosis: can this interpreter accelerate, and with which settings.

    Returns the text and whether acceleration is possible. Imports torch and (through the
    engine's loader) onnxruntime, since the question is whether they work.
    """
    import platform

    lines = [f"ort_autopatch {__version__} --check"]
    row = "  {:<14}{}".format
    lines.append(row("Python", f"{platform.python_version()} ({sys.executable})"))
    problems: list[str] = []
    notes: list[str] = []  # what runs, though not as tested
    try:
        import torch

        cuda = "CUDA available" if torch.cuda.is_available() else "no CUDA device"
        lines.append(row("torch", f"{torch.__version__} ({cuda})"))
        from ort_autopatch import versions

        untested = versions.untested_torch_reason(str(torch.__version__))
        if untested is not None and config.untested_torch:
            notes.append(f"{untested}; tried anyway ({BY_NAME['untested_torch'].flag})")
        elif untested is not None:
            opt = BY_NAME["untested_torch"]
            problems.append(f"{untested}, or set {opt.env}=1 ({opt.flag}) to try this one")
    except Exception as exc:  # a broken torch is exactly what --check is for
        lines.append(row("torch", f"cannot import: {exc}"))
        problems.append(f"torch does not import: {exc}")
    from ort_autopatch.engine import backend as backend_registry
    from ort_autopatch.engine import runtime

    found = runtime.installed_distributions()
    training = [n for n in found if n in runtime.TRAINING_DISTRIBUTIONS]
    inference = [n for n in found if n in runtime.INFERENCE_DISTRIBUTIONS]
    if not found:
        lines.append(row("ONNX Runtime", "not installed"))
    for name in found:
        kind = "training build" if name in training else "inference-only build"
        lines.append(row("ONNX Runtime", f"{name} {found[name]} ({kind})"))
    if training and inference:
        problems.append(
            f"{', '.join(inference)} and {', '.join(training)} are both installed and share the "
            f"'onnxruntime' package; the last one installed wins. Uninstall {', '.join(inference)}"
        )
    reason = backend_registry.unavailable_reason(config.backend)
    backend = backend_registry.resolve(config.backend)
    if reason is not None:
        problems.append(reason)
    else:
        version = backend_registry.version(backend)
        lines.append(row("backend", f"{backend} (ONNX Runtime {version})"))
        try:
            providers = runtime.available_providers()
            lines.append(row("providers", ", ".join(providers)))
        except Exception as exc:
            problems.append(f"ONNX Runtime does not load: {exc}")
        pairing = runtime.cuda_mismatch(_torch_cuda(), backend)  # GPU libraries of each side
        if pairing is not None:
            said, is_problem = pairing
            (problems if is_problem else notes).append(said)
    ok = not problems
    if ok:
        lines.extend(_backend_lines(config, backend, row))
    lines.append(row("accelerate", "yes" if ok else "no"))
    lines.extend(f"  problem: {p}" for p in problems)
    lines.extend(f"  note: {n}" for n in notes)
    lines.append("  configuration (options > ORT_AUTOPATCH_* > pyproject.toml > defaults):")
    environment = config.to_env()
    lines.extend(f"    {opt.env}={environment[opt.env]}" for opt in OPTIONS)
    lines.extend(_check_selection(config, row))
    return "\n".join(lines), ok
