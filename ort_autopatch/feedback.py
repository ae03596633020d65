"""What the user is told about the selection, so that a typo never runs silently unaccelerated.

At exit (and in `--check`) every allowlist pattern that matched no class gets one warning with
the closest class names among the modules the process imported ("did you mean
model:RNNModel?"), and a run in which nothing ran in ONNX Runtime says so, and why, in one line.
Only reads `sys.modules`: it imports nothing heavy (torch never).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ort_autopatch.engine.errors import BUILDING, WAITING

__all__ = ["imported_classes", "nothing_ran", "suggestions", "unmatched_message"]

_MAIN_ALIASES = {"__mp_main__": "__main__"}


def imported_classes(modules: Mapping[str, ModuleType | None] | None = None) -> list[str]:
    """`module:Class` of every `torch.nn.Module` subclass defined at the top of an imported
    module (nothing when torch was never imported: then no class could have matched)."""
    modules = sys.modules if modules is None else modules
    torch = modules.get("torch")
    base = getattr(getattr(torch, "nn", None), "Module", None)
    if not isinstance(base, type):
        return []
    names: list[str] = []
    for module_name, module in list(modules.items()):
        try:
            namespace = vars(module)
        except TypeError:
            continue
        shown = _MAIN_ALIASES.get(module_name, module_name)
        for value in list(namespace.values()):
            # type(value), not isinstance: some modules hold proxies whose __class__ warns.
            if (
                issubclass(type(value), type)
                and issubclass(value, base)
                and value.__module__ == module_name
            ):
                names.append(f"{shown}:{value.__qualname__}")
    return sorted(set(names))


def suggestions(pattern: str, candidates: list[str], limit: int = 3) -> list[str]:
    """The candidates closest to `pattern`: a close class name in a close (or the same) module,
    or the very class name in another module (`train:Net` for a class of the script, which is
    `__main__:Net`). Case is ignored: Python names rarely differ by case alone."""
    module, _, cls = pattern.lower().partition(":")
    scored: list[tuple[float, str]] = []
    for candidate in candidates:
        their_module, _, their_cls = candidate.lower().partition(":")
        by_class = _ratio(cls, their_cls)
        if by_class < 0.6:
            continue
        by_module = _ratio(module, their_module)
        if (
            by_class == 1.0
            or (by_class >= 0.8 and by_module >= 0.5)
            or (by_module == 1.0 and by_class >= 0.7)
        ):
            scored.append((by_class + by_module, candidate))
    scored.sort(key=lambda item: -item[0])
    return [candidate for _, candidate in scored[:limit]]


def _ratio(a: str, b: str) -> float:
    matcher = difflib.SequenceMatcher(None, a, b)
    return matcher.ratio() if matcher.real_quick_ratio() >= 0.6 else 0.0


def unmatched_message(
    pattern: str, candidates: list[str], modules: Mapping[str, Any] | None = None
) -> str:
    """One warning line for an allowlist pattern that matched no class."""
    modules = sys.modules if modules is None else modules
    module = pattern.partition(":")[0]
    text = f"--modules pattern {pattern!r} matched no class"
    close = suggestions(pattern, candidates)
    if close:
        return f"{text}; did you mean {' or '.join(close)}?"
    if not any(ch in module for ch in "*?[") and module not in modules:
        return f"{text}: module {module!r} was never imported"
    return f"{text} among the modules this process imported"


def nothing_ran(
    classes: Mapping[str, Mapping[str, Any]], selected: bool, uncalled: int = 0
) -> str | None:
    """One line saying why nothing ran in ONNX Runtime, or None when something did.
    `uncalled`: classes a wildcard selected that were never called (left out of `classes`)."""
    if any(stats.get("ort_calls", 0) for stats in classes.values()):
        return None
    if not selected:
        return (
            "nothing ran in ONNX Runtime: no class is selected (give --modules or "
            "ORT_AUTOPATCH_MODULES)"
        )
    if not classes and uncalled:
        return f"nothing ran in ONNX Runtime: none of the {uncalled} selected classes was called"
    if not classes:
        return "nothing ran in ONNX Runtime: no selected class was found (see the patterns above)"
    compiled = sum(stats.get("compiled_calls", 0) for stats in classes.values())
    traces = sum(stats.get("compiled_traces", 0) for stats in classes.values())
    if (compiled or traces) and not any(stats.get("instances", 0) for stats in classes.values()):
        return (
            f"nothing ran in ONNX Runtime: the selected classes ran under torch.compile "
            f"({compiled} calls counted, {traces} traces)"
        )
    if not any(stats.get("instances", 0) for stats in classes.values()):
        names = ", ".join(sorted(classes))
        return f"nothing ran in ONNX Runtime: the selected classes ({names}) were never called"
    reasons: dict[str, int] = {}
    for stats in classes.values():
        for item in stats.get("eager_reasons", ()):
            reasons[item["reason"]] = reasons.get(item["reason"], 0) + int(item["count"])
    if reasons and set(reasons) <= {BUILDING, WAITING}:
        return (
            f"nothing ran in ONNX Runtime yet: the run ended before a helper process had built "
            f"its graphs ({sum(reasons.values())} calls ran in PyTorch meanwhile); a longer run "
            "moves to ONNX Runtime once each graph is built, --cache-dir keeps them for the "
            "next run, and --foreground-builds makes the first call wait for its graph"
        )
    why = ", ".join(f"{r} ({n})" for r, n in sorted(reasons.items(), key=lambda i: -i[1])[:3])
    return f"nothing ran in ONNX Runtime: every call ran in PyTorch ({why or 'no reason recorded'})"
