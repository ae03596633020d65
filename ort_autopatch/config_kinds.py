"""Kinds of option values: how each reads a value from text (an environment variable, a flag)
or from a Python value (TOML, `load_config(cli=...)`), validates it, names what it accepts (for
errors, `--help` and the README) and writes it back as text (`Config.to_env`).

The option table in config.py gives every option one of these; docs/options.md lists them and
says how to add one. Nothing here imports torch, onnxruntime or any user module.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

from ort_autopatch.errors import ConfigError
from ort_autopatch.policy import Fallback, SkipCheck, names, parse_fallback, parse_skip_check

__all__ = [
    "Choice",
    "CommaList",
    "Folder",
    "Integer",
    "Kind",
    "Operators",
    "Patterns",
    "Policy",
    "ReportPath",
    "Switch",
]


class Kind:
    """How one kind of value is read from text (environment, flag) or from a Python value (TOML,
    `load_config(cli=...)`), validated, described, and written back as text for `to_env`."""

    type_name = "a string"  # what a Python value must be: the `expected ...` of an error
    accepted = ""  # what is accepted, for errors, `--help` and the README
    metavar = "VALUE"
    repeatable = False  # the flag may be given several times (values joined)
    empty_allowed = False  # '' is a value (an empty list), not an error, from TOML/CLI

    def parse(self, text: str, where: str) -> Any:
        """The value of `text`, or ConfigError naming `where`."""
        return text.strip()

    def from_python(self, raw: object) -> tuple[bool, object]:
        """(True, value) if `raw` already is a final value; (False, text) to parse `text`, which
        is not a str when `raw` has the wrong type."""
        if isinstance(raw, os.PathLike):
            return False, os.fspath(raw)
        return False, raw

    def text(self, value: Any) -> str:
        """The environment form of `value` (`''` = unset); `parse(text(v)) == v`."""
        return "" if value is None else str(value)

    def relative_to(self, value: Any, base: pathlib.Path) -> Any:
        """A value from a file, resolved next to that file (paths only)."""
        return value


class Switch(Kind):
    type_name = "a boolean"
    _true = ("1", "true", "yes", "on")
    _false = ("0", "false", "no", "off")
    accepted = ", ".join(f"{t}/{f}" for t, f in zip(_true, _false, strict=True))
    metavar = "BOOL"

    def parse(self, text: str, where: str) -> bool:
        word = text.strip().lower()
        if word in self._true:
            return True
        if word in self._false:
            return False
        raise ConfigError(where, text, "not a boolean", self.accepted)

    def from_python(self, raw: object) -> tuple[bool, object]:
        return (True, raw) if isinstance(raw, bool) else (False, raw)

    def text(self, value: Any) -> str:
        return "1" if value else "0"


class CommaList(Kind):
    """A comma list of entries (a repeatable flag, a TOML list); '' is the empty list. A
    subclass says what one entry may be (`entry`)."""

    type_name = "a string or a list of strings"
    repeatable = True
    empty_allowed = True

    def parse(self, text: str, where: str) -> tuple[str, ...]:
        if not text.strip():
            return ()
        try:
            return tuple(self.entry(part.strip()) for part in text.split(","))
        except ValueError as problem:
            raise ConfigError(where, text, str(problem), self.accepted) from None

    def entry(self, entry: str) -> str:
        """One entry as the value holds it; ValueError says what is wrong with it."""
        raise NotImplementedError

    def from_python(self, raw: object) -> tuple[bool, object]:
        return False, ",".join(raw) if _is_str_sequence(raw) else raw  # type: ignore[arg-type]

    def text(self, value: Any) -> str:
        return ",".join(value)


class Patterns(CommaList):
    accepted = (
        "a comma list of 'module.path:Class' entries, fnmatch wildcards allowed on both "
        "sides (e.g. 'mypkg.models:Net,__main__:*Head')"
    )
    metavar = "PATTERNS"

    def entry(self, entry: str) -> str:
        if not entry:
            raise ValueError("empty entry in the comma list")
        module, colon, cls = entry.partition(":")
        if not colon:
            raise ValueError(f"entry {entry!r} has no ':Class'")
        if ":" in cls:
            raise ValueError(f"entry {entry!r} has more than one ':'")
        if not module.strip() or not cls.strip():
            raise ValueError(f"entry {entry!r} has an empty side")
        if any(ch.isspace() for ch in entry):
            raise ValueError(f"entry {entry!r} contains whitespace")
        return entry


class Operators(CommaList):
    accepted = (
        "a comma list of ATen operator names as the report shows them (e.g. "
        "'aten::einsum,aten::cummax'; 'aten::' may be left out; fnmatch wildcards allowed)"
    )
    metavar = "OPS"

    def entry(self, entry: str) -> str:
        if not entry or any(ch.isspace() for ch in entry):
            raise ValueError(f"bad operator name {entry!r}")
        name = entry if "::" in entry else f"aten::{entry}"
        if not name.startswith("aten::"):
            raise ValueError(f"{entry!r} is not an ATen operator")
        return name


class Policy(Kind):
    type_name = "a string or a list of names"
    metavar = "NAMES"

    def __init__(self, flags: type[SkipCheck] | type[Fallback], none: str) -> None:
        self.flags = flags
        self.none = none  # the name of the empty policy, so that `text` is never ''
        self.accepted = ", ".join(names(flags(~0))) + " (join several with '|')"
        self._parse = parse_skip_check if flags is SkipCheck else parse_fallback

    def parse(self, text: str, where: str) -> Any:
        return self._parse(text, where)

    def from_python(self, raw: object) -> tuple[bool, object]:
        if raw.__class__ is self.flags:
            return True, raw
        return False, "|".join(raw) if _is_str_sequence(raw) else raw  # type: ignore[arg-type]

    def text(self, value: Any) -> str:
        return "|".join(names(value)) or self.none


class Integer(Kind):
    type_name = "an integer"
    metavar = "N"

    def __init__(self, valid: Callable[[int], bool], accepted: str) -> None:
        self.valid = valid
        self.accepted = accepted

    def parse(self, text: str, where: str) -> int:
        try:
            number = int(text.strip(), 10)
        except ValueError:
            raise ConfigError(where, text, "not an integer", self.accepted) from None
        if not self.valid(number):
            raise ConfigError(where, text, "out of range", self.accepted)
        return number

    def from_python(self, raw: object) -> tuple[bool, object]:
        if isinstance(raw, bool):
            return False, raw  # True is an int to Python, never a count to a user
        return (False, str(raw)) if isinstance(raw, int) else (False, raw)


class Choice(Kind):
    metavar = "NAME"

    def __init__(self, choices: Iterable[str], what: str) -> None:
        self.choices = tuple(choices)
        self.what = what
        self.accepted = ", ".join(self.choices)

    def parse(self, text: str, where: str) -> str:
        """The choice as declared, whatever the case it was written in."""
        word = {c.upper(): c for c in self.choices}.get(text.strip().upper())
        if word is None:
            raise ConfigError(where, text, f"unknown {self.what}", self.accepted)
        return word


class Folder(Kind):
    type_name = "a path string"
    accepted = "a path"
    metavar = "DIR"

    def parse(self, text: str, where: str) -> pathlib.Path:
        return pathlib.Path(text.strip()).expanduser()

    def relative_to(self, value: Any, base: pathlib.Path) -> Any:
        return value if value.is_absolute() else base / value


class ReportPath(Kind):
    type_name = "a path string"
    accepted = "a path, or '-' for a text summary on stderr"
    metavar = "PATH"

    def relative_to(self, value: Any, base: pathlib.Path) -> Any:
        return value if value == "-" or pathlib.Path(value).is_absolute() else str(base / value)


def _is_str_sequence(raw: object) -> bool:
    return isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw)
