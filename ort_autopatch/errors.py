"""Exceptions ort_autopatch raises on purpose.

One base class lets a launcher tell "the tool refused this" from a bug in the tool or the script.
"""

from __future__ import annotations


class OrtAutopatchError(Exception):
    """Base of every error ort_autopatch raises deliberately."""


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
        super().__init__(f"{variable}={value!r} is not valid: {reason}. Accepted: {accepted}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, object, str, str]]:
        # Exception pickles through self.args (the message) by default, which does not fit
        # __init__; spawned workers and torchrun ranks send errors back pickled.
        return (type(self), (self.variable, self.value, self.reason, self.accepted))
