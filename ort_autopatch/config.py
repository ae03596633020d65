"""One frozen Config, read once, from CLI > environment > TOML file > defaults.

Activation (the launcher, ``ort_autopatch.auto`` and the child-process sitecustomize) calls
``load_config`` before the user's script runs, so every bad value fails here, naming where it came
from, the value and what is accepted. Spawned children see only the environment, which is why
``Config.to_env`` exists. Nothing here imports torch, onnxruntime or any user module: reading the
configuration must stay cheap and side-effect free in every process the tool starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ConfigError
from .policy import (
    DEFAULT_FALLBACK,
    DEFAULT_SKIP_CHECK,
    Fallback,
    SkipCheck,
    names,
    parse_fallback,
    parse_skip_check,
)

__all__ = ["ENV_CONFIG_FILE", "ENV_VARS", "Config", "ConfigError", "load_config"]

_log = logging.getLogger("ort_autopatch")

#: Path of a TOML file to read instead of ``./pyproject.toml``.
ENV_CONFIG_FILE = "ORT_AUTOPATCH_CONFIG"

#: Field name -> environment variable (the names are a contract, see DESIGN.md).
ENV_VARS: Mapping[str, str] = {
    "enabled": "ORT_AUTOPATCH_ENABLED",
    "modules": "ORT_AUTOPATCH_MODULES",
    "exclude": "ORT_AUTOPATCH_EXCLUDE",
    "skip_check": "ORT_AUTOPATCH_SKIPCHECK_POLICY",
    "fallback": "ORT_AUTOPATCH_FALLBACK_POLICY",
    "report": "ORT_AUTOPATCH_REPORT",
    "log_level": "ORT_AUTOPATCH_LOG_LEVEL",
    "cache_dir": "ORT_AUTOPATCH_CACHE_DIR",
    "save_onnx": "ORT_AUTOPATCH_SAVE_ONNX",
    "opset": "ORT_AUTOPATCH_OPSET",
    "threads": "ORT_AUTOPATCH_THREADS",
    "cache_size": "ORT_AUTOPATCH_CACHE_SIZE",
}

# ORTModule's own variables, read when ours are unset so existing ORTModule setups carry over.
_ORTMODULE_ENV_VARS: Mapping[str, str] = {
    "skip_check": "ORTMODULE_SKIPCHECK_POLICY",
    "fallback": "ORTMODULE_FALLBACK_POLICY",
}

# The CLI flag that sets each field, for error messages (the launcher defines the same names).
_CLI_FLAGS: Mapping[str, str] = {
    "enabled": "--disable",
    "modules": "--modules",
    "exclude": "--exclude",
    "skip_check": "--skip-check",
    "fallback": "--fallback",
    "report": "--report",
    "log_level": "--log-level",
    "cache_dir": "--cache-dir",
    "save_onnx": "--save-onnx",
    "opset": "--opset",
    "threads": "--threads",
    "cache_size": "--cache-size",
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
OPSET_RANGE = range(14, 21)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_TOML_TABLE = "[tool.ort_autopatch]"


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything activation needs, validated; build it with ``load_config``."""

    enabled: bool = True
    modules: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skip_check: SkipCheck = DEFAULT_SKIP_CHECK
    fallback: Fallback = DEFAULT_FALLBACK
    report: str | None = None
    log_level: str = "WARNING"
    cache_dir: pathlib.Path | None = None
    save_onnx: pathlib.Path | None = None
    opset: int = 17
    threads: int | None = None
    cache_size: int = 8

    def to_env(self) -> dict[str, str]:
        """Environment variables that make ``load_config`` in a child rebuild this Config.

        Every ORT_AUTOPATCH_* field variable is present; a field that is None maps to ``''``,
        which ``load_config`` reads as unset, so merging this over an inherited environment
        (``{**os.environ, **config.to_env()}``) also clears stale values from the parent.
        The ORT_AUTOPATCH_* policy variables are always set, so ORTMODULE_* ones cannot leak in.
        """
        return {
            ENV_VARS["enabled"]: "1" if self.enabled else "0",
            ENV_VARS["modules"]: ",".join(self.modules),
            ENV_VARS["exclude"]: ",".join(self.exclude),
            ENV_VARS["skip_check"]: "|".join(names(self.skip_check)) or "SKIP_CHECK_DISABLED",
            ENV_VARS["fallback"]: "|".join(names(self.fallback)) or "FALLBACK_DISABLE",
            ENV_VARS["report"]: self.report or "",
            ENV_VARS["log_level"]: self.log_level,
            ENV_VARS["cache_dir"]: "" if self.cache_dir is None else str(self.cache_dir),
            ENV_VARS["save_onnx"]: "" if self.save_onnx is None else str(self.save_onnx),
            ENV_VARS["opset"]: str(self.opset),
            ENV_VARS["threads"]: "" if self.threads is None else str(self.threads),
            ENV_VARS["cache_size"]: str(self.cache_size),
        }


def load_config(
    cli: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: pathlib.Path | None = None,
) -> Config:
    """Merge CLI > environment > TOML file > defaults into one validated Config.

    ``cli`` keys are Config field names (plus ``disable``); a None value means "flag not given".
    ``environ`` defaults to ``os.environ``; an empty variable counts as unset, as Python's own
    PYTHON* variables do. The TOML file is ``$ORT_AUTOPATCH_CONFIG`` (an error if it is missing or
    unreadable) or else the ``[tool.ort_autopatch]`` table of ``cwd/pyproject.toml`` if there is
    one. Raises ConfigError naming the variable, flag or TOML key, the value and what is accepted.
    """
    environ = os.environ if environ is None else environ
    cwd = pathlib.Path.cwd() if cwd is None else cwd
    values: dict[str, Any] = {}
    values.update(_from_toml(environ, cwd))
    values.update(_from_env(environ))
    values.update(_from_cli(cli or {}))
    return Config(**values)


# --- sources -----------------------------------------------------------------------------------


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field, variable in ENV_VARS.items():
        raw = environ.get(variable, "")
        if not raw.strip() and field in _ORTMODULE_ENV_VARS:
            variable = _ORTMODULE_ENV_VARS[field]
            raw = environ.get(variable, "")
        if raw.strip():
            values[field] = _PARSERS[field](raw, variable)
    return values


def _from_cli(cli: Mapping[str, object]) -> dict[str, Any]:
    unknown = sorted(set(cli) - set(_CLI_FLAGS) - {"disable"})
    if unknown:
        # A programming error in the launcher, not a user error: fail loudly and differently.
        raise TypeError(f"load_config: unknown CLI keys {unknown}; accepted: {sorted(_CLI_FLAGS)}")
    values: dict[str, Any] = {}
    for key, raw in cli.items():
        if raw is None:
            continue
        if key == "disable":
            if not isinstance(raw, bool):
                raise ConfigError("--disable", raw, "expected a flag (True/False)", "True, False")
            if raw:
                values["enabled"] = False
            continue
        values[key] = _parse_typed(key, raw, _CLI_FLAGS[key])
    return values


def _from_toml(environ: Mapping[str, str], cwd: pathlib.Path) -> dict[str, Any]:
    explicit = environ.get(ENV_CONFIG_FILE, "").strip()
    if explicit:
        path = pathlib.Path(explicit).expanduser()
        if not path.is_absolute():
            path = cwd / path
        if not path.is_file():
            raise ConfigError(
                ENV_CONFIG_FILE, explicit, "no such file", "the path of an existing TOML file"
            )
        document = _read_toml(path, ENV_CONFIG_FILE, explicit)
        # A dedicated file may hold the keys at top level or, like pyproject.toml, in the table.
        table = _tool_table(document)
        if table is None:
            return _parse_table(document, f"{path}", path.parent)
        return _parse_table(table, f"{path} {_TOML_TABLE}", path.parent)

    path = cwd / "pyproject.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    # A pyproject.toml that never mentions us is none of our business, even if it is broken:
    # activation runs in every child process, whatever folder it happens to start in.
    if "ort_autopatch" not in text:
        return {}
    document = _read_toml(path, "pyproject.toml", str(path), text=text)
    table = _tool_table(document)
    if table is None:
        return {}
    return _parse_table(table, f"pyproject.toml {_TOML_TABLE}", path.parent)


def _read_toml(
    path: pathlib.Path, variable: str, shown: str, text: str | None = None
) -> dict[str, Any]:
    loads = _toml_loads()
    if loads is None:
        raise ConfigError(
            variable,
            shown,
            "reading TOML needs Python 3.11+ or the 'tomli' package",
            "a TOML file once tomli is installed, or settings in ORT_AUTOPATCH_* variables",
        )
    try:
        if text is None:
            text = path.read_text(encoding="utf-8")
        return loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        reason = f"cannot read it as TOML ({exc})"
        raise ConfigError(variable, shown, reason, "a TOML file") from exc


def _toml_loads() -> Callable[[str], dict[str, Any]] | None:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads
    try:  # pragma: no cover - Python 3.10 only
        import tomli
    except ImportError:  # pragma: no cover - Python 3.10 only
        return None
    return tomli.loads  # pragma: no cover


def _tool_table(document: Mapping[str, Any]) -> dict[str, Any] | None:
    tool = document.get("tool")
    if isinstance(tool, dict):
        table = tool.get("ort_autopatch")
        if isinstance(table, dict):
            return table
    return None


def _parse_table(table: Mapping[str, Any], where: str, base: pathlib.Path) -> dict[str, Any]:
    values: dict[str, Any] = {}
    accepted = ", ".join(ENV_VARS)
    for key, raw in table.items():
        field = key.replace("-", "_")
        variable = f"{where} {key}"
        if field not in ENV_VARS:
            raise ConfigError(variable, raw, "unknown key", accepted)
        value = _parse_typed(field, raw, variable)
        # Relative paths in a file mean "next to the file", as in other tools' configs.
        if isinstance(value, pathlib.Path) and not value.is_absolute():
            value = base / value
        elif field == "report" and value != "-" and not pathlib.Path(value).is_absolute():
            value = str(base / value)
        values[field] = value
    return values


# --- typed values (TOML and CLI pass Python objects; the environment passes strings) ----------


def _parse_typed(field: str, raw: object, variable: str) -> Any:
    """Accept the natural Python type for ``field`` as well as its string form.

    Errors quote the value as the user wrote it (``0``, ``["a"]``), not our string form of it.
    """
    if field == "enabled" and isinstance(raw, bool):
        return raw
    if field in ("skip_check", "fallback") and raw.__class__ is _POLICY_TYPES[field]:
        return raw
    text: object = raw
    if field in ("opset", "threads", "cache_size") and isinstance(raw, int):
        if isinstance(raw, bool):
            raise ConfigError(variable, raw, "expected an integer", _INT_ACCEPTED[field])
        text = str(raw)
    elif field in ("modules", "exclude") and _is_str_sequence(raw):
        text = ",".join(raw)  # type: ignore[arg-type]
    elif field in ("skip_check", "fallback") and _is_str_sequence(raw):
        text = "|".join(raw)  # type: ignore[arg-type]
    elif field in ("cache_dir", "save_onnx", "report") and isinstance(raw, os.PathLike):
        text = os.fspath(raw)
    if not isinstance(text, str):
        raise ConfigError(variable, raw, f"expected {_TYPE_NAMES[field]}", _accepted(field))
    if not text.strip() and field not in ("modules", "exclude"):
        raise ConfigError(variable, raw, "empty value", _accepted(field))
    try:
        return _PARSERS[field](text, variable)
    except ConfigError as error:
        if text is raw:
            raise
        raise ConfigError(variable, raw, error.reason, error.accepted) from None


def _is_str_sequence(raw: object) -> bool:
    return isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw)


# --- string parsers, shared by every source ----------------------------------------------------


def _parse_bool(raw: str, variable: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(variable, raw, "not a boolean", _accepted("enabled"))


def _parse_patterns(raw: str, variable: str) -> tuple[str, ...]:
    if not raw.strip():
        return ()
    accepted = _accepted("modules")
    patterns = []
    for entry in (part.strip() for part in raw.split(",")):
        if not entry:
            raise ConfigError(variable, raw, "empty entry in the comma list", accepted)
        module, colon, cls = entry.partition(":")
        if not colon:
            raise ConfigError(variable, raw, f"entry {entry!r} has no ':Class'", accepted)
        if ":" in cls:
            raise ConfigError(variable, raw, f"entry {entry!r} has more than one ':'", accepted)
        if not module.strip() or not cls.strip():
            raise ConfigError(variable, raw, f"entry {entry!r} has an empty side", accepted)
        if any(ch.isspace() for ch in entry):
            raise ConfigError(variable, raw, f"entry {entry!r} contains whitespace", accepted)
        patterns.append(entry)
    return tuple(patterns)


def _parse_level(raw: str, variable: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(variable, raw, "unknown log level", _accepted("log_level"))
    return level


def _parse_int(field: str, raw: str, variable: str, valid: Callable[[int], bool]) -> int:
    try:
        number = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(variable, raw, "not an integer", _INT_ACCEPTED[field]) from None
    if not valid(number):
        raise ConfigError(variable, raw, "out of range", _INT_ACCEPTED[field])
    return number


def _parse_path(raw: str, variable: str) -> pathlib.Path:
    return pathlib.Path(raw.strip()).expanduser()


def _parse_report(raw: str, variable: str) -> str:
    return raw.strip()


_INT_ACCEPTED: Mapping[str, str] = {
    "opset": f"an integer from {OPSET_RANGE.start} to {OPSET_RANGE.stop - 1}",
    "threads": "a positive integer (unset: follow torch.get_num_threads())",
    "cache_size": "a positive integer (graphs kept per module instance)",
}

_PARSERS: Mapping[str, Callable[[str, str], Any]] = {
    "enabled": _parse_bool,
    "modules": _parse_patterns,
    "exclude": _parse_patterns,
    "skip_check": parse_skip_check,
    "fallback": parse_fallback,
    "report": _parse_report,
    "log_level": _parse_level,
    "cache_dir": _parse_path,
    "save_onnx": _parse_path,
    "opset": lambda raw, var: _parse_int("opset", raw, var, OPSET_RANGE.__contains__),
    "threads": lambda raw, var: _parse_int("threads", raw, var, lambda n: n > 0),
    "cache_size": lambda raw, var: _parse_int("cache_size", raw, var, lambda n: n > 0),
}

_POLICY_TYPES: Mapping[str, type] = {"skip_check": SkipCheck, "fallback": Fallback}

_TYPE_NAMES: Mapping[str, str] = {
    "enabled": "a boolean",
    "modules": "a string or a list of strings",
    "exclude": "a string or a list of strings",
    "skip_check": "a string or a list of names",
    "fallback": "a string or a list of names",
    "report": "a path string",
    "log_level": "a string",
    "cache_dir": "a path string",
    "save_onnx": "a path string",
    "opset": "an integer",
    "threads": "an integer",
    "cache_size": "an integer",
}


def _accepted(field: str) -> str:
    if field == "enabled":
        return ", ".join(f"{t}/{f}" for t, f in zip(_TRUE, _FALSE, strict=True))
    if field in ("modules", "exclude"):
        return (
            "a comma list of 'module.path:Class' entries, fnmatch wildcards allowed on both "
            "sides (e.g. 'mypkg.models:Net,__main__:*Head')"
        )
    if field in ("skip_check", "fallback"):
        every = SkipCheck(~0) if field == "skip_check" else Fallback(~0)
        return ", ".join(names(every)) + " (join several with '|')"
    if field == "log_level":
        return ", ".join(LOG_LEVELS)
    if field in _INT_ACCEPTED:
        return _INT_ACCEPTED[field]
    return "a path" if field != "report" else "a path, or '-' for a text summary on stderr"
