"""SkipCheck and Fallback policies, with ORTModule's exact names and values.

Users of ORTModule already set ORTMODULE_SKIPCHECK_POLICY / ORTMODULE_FALLBACK_POLICY; keeping the
same names and bit values (onnxruntime ortmodule/options.py and _fallback.py) lets those settings
carry over unchanged. This module knows nothing about where a value came from: callers pass the
name of the variable or flag so that errors can point at it.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from .errors import ConfigError


class SkipCheck(enum.IntFlag):
    """Checks a call may skip to go faster (ORTModule's `_SkipCheck`)."""

    SKIP_CHECK_DISABLED = 1
    SKIP_CHECK_DEVICE = 2
    SKIP_CHECK_BUILD_GRADIENT = 4
    SKIP_CHECK_EXECUTION_AGENT = 8


class Fallback(enum.IntFlag):
    """Failures that send a call back to eager PyTorch (ORTModule's `_FallbackPolicy`)."""

    FALLBACK_DISABLE = 1
    FALLBACK_FORCE_TORCH_FORWARD = 2
    FALLBACK_FORCE_TORCH_BACKWARD = 4
    FALLBACK_UNSUPPORTED_DEVICE = 8
    FALLBACK_UNSUPPORTED_DATA = 16
    FALLBACK_UNSUPPORTED_TORCH_MODEL = 32
    FALLBACK_UNSUPPORTED_ONNX_MODEL = 64
    FALLBACK_BAD_INITIALIZATION = 128


_F = TypeVar("_F", SkipCheck, Fallback)

#: Nothing skipped, as in ORTModule: every call re-checks device, gradient graph and agent.
DEFAULT_SKIP_CHECK = SkipCheck.SKIP_CHECK_DISABLED

#: Anything the engine cannot take runs eagerly instead of failing the user's run.
DEFAULT_FALLBACK = (
    Fallback.FALLBACK_UNSUPPORTED_DEVICE
    | Fallback.FALLBACK_UNSUPPORTED_DATA
    | Fallback.FALLBACK_UNSUPPORTED_TORCH_MODEL
    | Fallback.FALLBACK_UNSUPPORTED_ONNX_MODEL
    | Fallback.FALLBACK_BAD_INITIALIZATION
)

# ORTModule users write the enum's repr-ish form in scripts and configs; accept both spellings.
_SKIP_PREFIXES = ("_SkipCheck.", "SkipCheck.")
_FALLBACK_PREFIXES = ("_FallbackPolicy.", "FallbackPolicy.", "Fallback.")


def skips(policy: SkipCheck, flag: SkipCheck) -> bool:
    """Whether `policy` skips the check `flag`; SKIP_CHECK_DISABLED means nothing is skipped."""
    return SkipCheck.SKIP_CHECK_DISABLED not in policy and flag in policy


def falls_back(policy: Fallback, flag: Fallback) -> bool:
    """Whether `policy` falls back to eager on `flag`; FALLBACK_DISABLE means never."""
    return Fallback.FALLBACK_DISABLE not in policy and flag in policy


def names(policy: SkipCheck | Fallback) -> list[str]:
    """The member names set in `policy`, in declaration order (the inverse of the parsers)."""
    return [str(member.name) for member in type(policy) if member in policy]


def parse_skip_check(value: str, variable: str) -> SkipCheck:
    """Parse `'SKIP_CHECK_DEVICE | SKIP_CHECK_BUILD_GRADIENT'`; `variable` names the source."""
    return _parse(SkipCheck, _SKIP_PREFIXES, value, variable)


def parse_fallback(value: str, variable: str) -> Fallback:
    """Parse `'FALLBACK_UNSUPPORTED_DATA|FALLBACK_BAD_INITIALIZATION'`; `variable` names it."""
    return _parse(Fallback, _FALLBACK_PREFIXES, value, variable)


def _parse(flag_type: type[_F], prefixes: tuple[str, ...], value: str, variable: str) -> _F:
    accepted = ", ".join(m.name for m in flag_type if m.name) + " (join several with '|')"
    if not value.strip():
        raise ConfigError(variable, value, "no policy name given", accepted)
    result = flag_type(0)
    for raw in value.split("|"):
        name = raw.strip()
        for prefix in prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :].strip()
                break
        if not name:
            raise ConfigError(variable, value, "empty policy name between '|'", accepted)
        try:
            result |= flag_type[name.upper()]
        except KeyError:
            raise ConfigError(
                variable, value, f"unknown policy name {raw.strip()!r}", accepted
            ) from None
    return result
