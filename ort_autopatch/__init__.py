"""ort_autopatch: train selected torch.nn.Module classes through ONNX Runtime, unchanged scripts.

    import ort_autopatch
    ort_autopatch.install()          # reads ORT_AUTOPATCH_* (docs/options.md)
    ort_autopatch.patch(MyNet)       # or patch one class by hand

Importing this package imports neither torch nor onnxruntime; `install()` imports torch only
when a selected class needs patching, and onnxruntime only at the first patched call.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import TYPE_CHECKING, Any

from ort_autopatch import report
from ort_autopatch.config import BY_NAME, Config, load_config
from ort_autopatch.errors import ConfigError, NotPatchableError, OrtAutopatchError
from ort_autopatch.versions import __version__ as __version__

if TYPE_CHECKING:
    from types import ModuleType

    from ort_autopatch.hook import ImportHook

__all__ = [
    "Config",
    "ConfigError",
    "NotPatchableError",
    "OrtAutopatchError",
    "install",
    "installed_config",
    "is_patched",
    "load_config",
    "mark_stale",
    "patch",
    "refused_reason",
    "uninstall",
    "unmatched_patterns",
    "unpatch",
]

_log = logging.getLogger("ort_autopatch")
_lock = threading.Lock()
_hook: ImportHook | None = None
_active_config: Config | None = None
_refused: str | None = None  # why the last install() accelerated nothing (for the report)


def install(config: Config | None = None) -> bool:
    """Patch the configured classes now and as they appear; False if already installed or
    disabled (`ORT_AUTOPATCH_ENABLED=0` installs nothing, not even a finder)."""
    global _hook, _active_config, _refused
    config = config or load_config()
    with _lock:
        if _hook is not None:
            _log.debug("ort_autopatch is already installed")
            return False
        if not config.enabled:
            return False
        from ort_autopatch import versions
        from ort_autopatch.engine.backend import unavailable_reason

        untested = versions.untested_torch_reason(versions.installed_torch())
        if untested is not None and config.untested_torch:
            _log.warning("ort_autopatch: %s; trying it, as asked", untested)
            untested = None
        elif untested is not None:
            opt = BY_NAME["untested_torch"]
            untested += f", or set {opt.env}=1 ({opt.flag}) to try this one"
        reason = untested or unavailable_reason(config.backend)
        if reason is not None:
            # Said once, here, instead of one fallback warning per class later.
            _log.warning(
                "ort_autopatch: nothing is accelerated, the script runs in PyTorch: %s", reason
            )
            _refused = reason
            return False
        _refused = None
        from ort_autopatch.hook import ImportHook, Selector

        on_class = functools.partial(_patch_found_class, config)
        hook = ImportHook(
            Selector(config.modules, config.exclude),
            on_class,
            # torch.compile, when it loads, learns to count the calls of selected classes
            after_import={"torch._dynamo": _count_compiled_calls},
        )
        hook.install()
        _hook = hook
        _active_config = config
        report.installed_backend(config.backend)
        return True


def _count_compiled_calls(dynamo: ModuleType) -> None:
    from ort_autopatch import compiled_calls

    compiled_calls.count_compiled_calls(loaded=True)


def uninstall() -> None:
    """Remove the finder and the class-creation hook and restore every patched class."""
    global _hook, _active_config
    with _lock:
        if _hook is not None:
            _hook.uninstall()
            _hook = None
            _active_config = None
            report.installed_backend(None)
    import sys

    patcher = sys.modules.get("ort_autopatch.patcher")
    if patcher is not None:
        patcher.unpatch_all()


def unmatched_patterns() -> list[str]:
    """Allowlist entries that have matched no class so far (for the exit report)."""
    with _lock:
        return _hook.selector.unmatched() if _hook is not None else []


def named_outright(name: str) -> bool:
    """Whether an allowlist pattern spells out the class `module:qualname` (no wildcard on its
    class side), for the exit report's list of classes."""
    module, _, qualname = name.partition(":")
    with _lock:
        return _hook is not None and _hook.selector.names_exactly(module, qualname)


def refused_reason() -> str | None:
    """Why the last `install()` accelerated nothing (an untested torch, no usable ONNX
    Runtime), for the exit report; None when it installed or was never asked to."""
    return _refused


def installed_config() -> Config | None:
    """The configuration `install()` activated, or None when not installed."""
    return _active_config


def patch(cls: type, config: Config | None = None) -> bool:
    """Patch one torch.nn.Module subclass in place; False if it already was.

    Its calls use `config`, else the configuration `install()` activated, else the one
    `install()` would read now (ORT_AUTOPATCH_* > pyproject.toml > defaults): patching by hand
    follows the same policies and engine options as patching from the allowlist.
    """
    from ort_autopatch import patcher

    config = config or installed_config() or load_config()
    return patcher.patch(cls, patcher.Settings.from_config(config))


def unpatch(cls: type) -> bool:
    from ort_autopatch import patcher

    return patcher.unpatch(cls)


def is_patched(cls: type) -> bool:
    from ort_autopatch import patcher

    return patcher.is_patched(cls)


def mark_stale(module: Any) -> None:
    """Forget `module`'s graphs, for writes no mechanism can see."""
    from ort_autopatch import patcher

    patcher.mark_stale(module)


def _patch_found_class(config: Config, cls: type) -> None:
    # Imported here: the patcher imports torch, which install() itself must not.
    from ort_autopatch import patcher

    settings = patcher.Settings.from_config(config)
    patcher.patch(cls, settings)
    patcher.prepare(settings)  # the import hook found a class: a first build will come
