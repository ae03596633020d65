"""Exceptions ort_autopatch raises on purpose.

One root lets a launcher or a user tell "the tool refused this" from a bug in the tool or the
script: `except ort_autopatch.OrtAutopatchError` catches configuration errors, a class that cannot
be patched and every engine failure (`ort_autopatch.engine.errors.EngineError` derives from it,
and from RuntimeError as before). Every one carries `cause` (what went wrong) and `remedy` (what
the user can do). This module imports nothing, so the engine can use it.
"""

from __future__ import annotations


class OrtAutopatchError(Exception):
    """Base of every error ort_autopatch raises deliberately."""

    cause: str = ""
    remedy: str = ""


class ConfigError(OrtAutopatchError, ValueError):
    """A configuration value was rejected before the user's script started.

    The message names where the value came from (an environment variable, a CLI flag or a TOML
    key), the value itself and what would have been accepted, so the user can fix it without
    reading our code. It subclasses ValueError because it is one, for callers that catch that.
    """

    def __init__(self, variable: str, value: object, reason: str, accepted: str) -> None:
        self.variable = variable
        self.value = value
        self.reason = reason
        self.accepted = accepted
        self.cause = f"{variable}={value!r} is not valid: {reason}"
        self.remedy = f"Accepted: {accepted}"
        super().__init__(f"{self.cause}. {self.remedy}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, object, str, str]]:
        # Exception pickles through self.args (the message) by default, which does not fit
        # __init__; spawned workers and torchrun ranks send errors back pickled.
        return (type(self), (self.variable, self.value, self.reason, self.accepted))


class NotPatchableError(OrtAutopatchError, TypeError):
    """`patch()` was given something that is not a `torch.nn.Module` subclass."""

    def __init__(self, target: object) -> None:
        self.target = target
        self.cause = f"{target!r} is not a torch.nn.Module subclass"
        self.remedy = "Patch the torch.nn.Module subclass itself (the class, not an instance)"
        super().__init__(f"{self.cause}. {self.remedy}")

    def __reduce__(self) -> tuple[type[NotPatchableError], tuple[object]]:
        return (type(self), (self.target,))
