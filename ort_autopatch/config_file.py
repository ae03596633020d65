"""Where the configuration file is and what it holds: the options table of a TOML file.

`$ORT_AUTOPATCH_CONFIG` names a file (its keys at top level or in a `[tool.ort_autopatch]`
table); without it, the `[tool.ort_autopatch]` table of `./pyproject.toml` counts, when there is
one. config.py parses the table's values as it parses the other sources'; this module knows
files, not options.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Mapping
from typing import Any

from ort_autopatch.errors import ConfigError

#: Path of a TOML file to read instead of `./pyproject.toml`; `none` reads no file at all (what
#: `Config.to_env` exports, so a child started in another folder cannot pick up another file).
ENV_CONFIG_FILE = "ORT_AUTOPATCH_CONFIG"
NO_FILE = "none"
TABLE = "[tool.ort_autopatch]"


@dataclasses.dataclass(frozen=True)
class Table:
    """The options table of a TOML file."""

    values: Mapping[str, Any]
    where: str  # the file (and the table in it) as errors name it
    base: pathlib.Path  # the file's folder: relative paths in it are relative to it


def find_table(environ: Mapping[str, str], cwd: pathlib.Path) -> Table | None:
    """The options table of the TOML file: `$ORT_AUTOPATCH_CONFIG` (an error if it is missing
    or unreadable; `none` reads no file), else the `[tool.ort_autopatch]` table of
    `cwd/pyproject.toml` if there is one; None when there is no table."""
    explicit = environ.get(ENV_CONFIG_FILE, "").strip()
    if explicit.lower() == NO_FILE:
        return None
    if explicit:
        path = pathlib.Path(explicit).expanduser()
        if not path.is_absolute():
            path = cwd / path
        if not path.is_file():
            raise ConfigError(
                ENV_CONFIG_FILE,
                explicit,
                "no such file",
                f"the path of an existing TOML file, or '{NO_FILE}' to read none",
            )
        document = _read_toml(path, ENV_CONFIG_FILE, explicit)
        # A dedicated file may hold the keys at top level or, like pyproject.toml, in the table.
        table = _tool_table(document)
        if table is None:
            return Table(document, f"{path}", path.parent)
        return Table(table, f"{path} {TABLE}", path.parent)

    path = cwd / "pyproject.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    # A pyproject.toml that never mentions us is none of our business, even if it is broken:
    # activation runs in every child process, whatever folder it happens to start in.
    if "ort_autopatch" not in text:
        return None
    document = _read_toml(path, "pyproject.toml", str(path), text=text)
    table = _tool_table(document)
    if table is None:
        return None
    return Table(table, f"pyproject.toml {TABLE}", path.parent)


def _read_toml(
    path: pathlib.Path, variable: str, shown: str, text: str | None = None
) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10: a declared dependency there
        import tomli as tomllib
    try:
        if text is None:
            text = path.read_text(encoding="utf-8")
        return tomllib.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        reason = f"cannot read it as TOML ({exc})"
        raise ConfigError(variable, shown, reason, "a TOML file") from exc


def _tool_table(document: Mapping[str, Any]) -> dict[str, Any] | None:
    tool = document.get("tool")
    if isinstance(tool, dict):
        table = tool.get("ort_autopatch")
        if isinstance(table, dict):
            return table
    return None
