"""One frozen `Config`, read once, from CLI > environment > TOML file > defaults.

Every option is declared once, as a field of `Config` whose metadata is an `Option`: the
environment variable, the launcher flag, the kind of value (which parses, validates, names what is
accepted and writes the value back as text) and the help line. Everything else is derived from
those declarations: reading the environment, TOML and CLI values, `Config.to_env`, the launcher's
argparse options and `--help`, the engine's options (`Config.engine_values`) and the README's
option table (`markdown_table`, checked by a test). docs/options.md says how to add one.

Activation (the launcher, `ort_autopatch.auto` and the child-process sitecustomize) calls
`load_config` before the user's script runs, so every bad value fails here, naming where it came
from, the value and what is accepted. Nothing here imports torch, onnxruntime or any user module:
reading the configuration must stay cheap and side-effect free in every process the tool starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import pathlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .engine import backend as backend_registry
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

__all__ = [
    "BY_NAME",
    "ENV_CONFIG_FILE",
    "ENV_VARS",
    "OPTIONS",
    "Config",
    "ConfigError",
    "Option",
    "add_arguments",
    "cli_values",
    "load_config",
    "markdown_table",
]

#: Path of a TOML file to read instead of `./pyproject.toml`; `none` reads no file at all (what
#: `Config.to_env` exports, so a child started in another folder cannot pick up another file).
ENV_CONFIG_FILE = "ORT_AUTOPATCH_CONFIG"
_NO_FILE = "none"
_TOML_TABLE = "[tool.ort_autopatch]"


# --- kinds of values ---------------------------------------------------------------------------


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


class Patterns(Kind):
    type_name = "a string or a list of strings"
    accepted = (
        "a comma list of 'module.path:Class' entries, fnmatch wildcards allowed on both "
        "sides (e.g. 'mypkg.models:Net,__main__:*Head')"
    )
    metavar = "PATTERNS"
    repeatable = True
    empty_allowed = True

    def parse(self, text: str, where: str) -> tuple[str, ...]:
        if not text.strip():
            return ()
        patterns = []
        for entry in (part.strip() for part in text.split(",")):
            problem = self._problem(entry)
            if problem:
                raise ConfigError(where, text, problem, self.accepted)
            patterns.append(entry)
        return tuple(patterns)

    @staticmethod
    def _problem(entry: str) -> str:
        if not entry:
            return "empty entry in the comma list"
        module, colon, cls = entry.partition(":")
        if not colon:
            return f"entry {entry!r} has no ':Class'"
        if ":" in cls:
            return f"entry {entry!r} has more than one ':'"
        if not module.strip() or not cls.strip():
            return f"entry {entry!r} has an empty side"
        if any(ch.isspace() for ch in entry):
            return f"entry {entry!r} contains whitespace"
        return ""

    def from_python(self, raw: object) -> tuple[bool, object]:
        return False, ",".join(raw) if _is_str_sequence(raw) else raw  # type: ignore[arg-type]

    def text(self, value: Any) -> str:
        return ",".join(value)


class Operators(Kind):
    type_name = "a string or a list of strings"
    accepted = (
        "a comma list of ATen operator names as the report shows them (e.g. "
        "'aten::einsum,aten::cummax'; 'aten::' may be left out; fnmatch wildcards allowed)"
    )
    metavar = "OPS"
    repeatable = True
    empty_allowed = True

    def parse(self, text: str, where: str) -> tuple[str, ...]:
        if not text.strip():
            return ()
        found = []
        for entry in (part.strip() for part in text.split(",")):
            if not entry or any(ch.isspace() for ch in entry):
                raise ConfigError(where, text, f"bad operator name {entry!r}", self.accepted)
            name = entry if "::" in entry else f"aten::{entry}"
            if not name.startswith("aten::"):
                raise ConfigError(where, text, f"{entry!r} is not an ATen operator", self.accepted)
            found.append(name)
        return tuple(found)

    def from_python(self, raw: object) -> tuple[bool, object]:
        return False, ",".join(raw) if _is_str_sequence(raw) else raw  # type: ignore[arg-type]

    def text(self, value: Any) -> str:
        return ",".join(value)


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


# --- the table ---------------------------------------------------------------------------------


class _Unset(enum.Enum):
    TAKES_VALUE = "takes a value"


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: its `Config` field name, environment variable, flag and kind of value."""

    env: str
    flag: str
    kind: Kind
    help: str
    #: For a flag that takes no value (`--disable`): the value the flag sets.
    flag_sets: object = _Unset.TAKES_VALUE
    #: Another variable read when ours is unset (ORTModule's, so its setups carry over).
    also_env: str | None = None
    #: Passed to the engine (`EngineOptions`) under the same name.
    engine: bool = False
    name: str = ""  # filled in from the `Config` field

    def describe(self, default: Any) -> str:
        """`--help`'s line: the help, the default when there is one, the variable."""
        shown = self.kind.text(default)
        if not shown or len(shown) > 40 or self.flag_sets is not _Unset.TAKES_VALUE:
            return f"{self.help} [{self.env}]"  # a long default is in the help text itself
        return f"{self.help} (default {shown}) [{self.env}]"


def option(default: Any, **declaration: Any) -> Any:
    """A `Config` field declared as an option (see `Option` for the keywords)."""
    return dataclasses.field(default=default, metadata={"option": Option(**declaration)})


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: "auto" and every backend the engine's registry declares (`engine.backend.BACKENDS`)
BACKENDS = ("auto", *backend_registry.names())
OPSET_RANGE = range(14, 21)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything activation needs, validated; build it with `load_config`.

    Each field is one option. To add one, add a field here (and use it); see docs/options.md.
    """

    enabled: bool = option(
        True,
        env="ORT_AUTOPATCH_ENABLED",
        flag="--disable",
        flag_sets=False,
        kind=Switch(),
        help="install nothing; run the script plainly (the variable: 0 does the same)",
    )
    modules: tuple[str, ...] = option(
        (),
        env="ORT_AUTOPATCH_MODULES",
        flag="--modules",
        kind=Patterns(),
        help="classes to accelerate ('__main__:Net' for a class of the script itself); repeatable",
    )
    exclude: tuple[str, ...] = option(
        (),
        env="ORT_AUTOPATCH_EXCLUDE",
        flag="--exclude",
        kind=Patterns(),
        help="classes never to accelerate (same syntax; wins over --modules); repeatable",
    )
    skip_check: SkipCheck = option(
        DEFAULT_SKIP_CHECK,
        env="ORT_AUTOPATCH_SKIPCHECK_POLICY",
        flag="--skip-check",
        also_env="ORTMODULE_SKIPCHECK_POLICY",
        kind=Policy(SkipCheck, none="SKIP_CHECK_DISABLED"),
        help="'|'-joined SKIP_CHECK_* names (ORTModule's; ORTMODULE_SKIPCHECK_POLICY is read "
        "when unset)",
    )
    fallback: Fallback = option(
        DEFAULT_FALLBACK,
        env="ORT_AUTOPATCH_FALLBACK_POLICY",
        flag="--fallback",
        also_env="ORTMODULE_FALLBACK_POLICY",
        kind=Policy(Fallback, none="FALLBACK_DISABLE"),
        help="'|'-joined FALLBACK_* names (ORTModule's; ORTMODULE_FALLBACK_POLICY is read when "
        "unset); FALLBACK_DISABLE raises instead of running a class in PyTorch (default: every "
        "FALLBACK_UNSUPPORTED_* flag and FALLBACK_BAD_INITIALIZATION)",
    )
    report: str | None = option(
        None,
        env="ORT_AUTOPATCH_REPORT",
        flag="--report",
        kind=ReportPath(),
        help="JSON report written at exit; '{rank}' in it gives one file per rank; '-' prints "
        "a text summary on stderr instead",
    )
    log_level: str = option(
        "WARNING",
        env="ORT_AUTOPATCH_LOG_LEVEL",
        flag="--log-level",
        kind=Choice(LOG_LEVELS, what="log level"),
        help="level of the tool's log records; INFO adds the summary at exit",
    )
    backend: str = option(
        "auto",
        env="ORT_AUTOPATCH_BACKEND",
        flag="--backend",
        kind=Choice(BACKENDS, what="backend"),
        engine=True,
        help="which ONNX Runtime trains: 'ort' (the maintained onnxruntime package, graphs from "
        "torch's autograd), 'ort-training' (onnxruntime-training 1.19.2, Python <= 3.11) or "
        "'auto' (whichever is installed, the training build first)",
    )
    cache_dir: pathlib.Path | None = option(
        None,
        env="ORT_AUTOPATCH_CACHE_DIR",
        flag="--cache-dir",
        kind=Folder(),
        engine=True,
        help="persistent graph cache: a second run loads its graphs instead of exporting",
    )
    save_onnx: pathlib.Path | None = option(
        None,
        env="ORT_AUTOPATCH_SAVE_ONNX",
        flag="--save-onnx",
        kind=Folder(),
        engine=True,
        help="write every exported graph and its gradient graph here (attach them to a bug report)",
    )
    opset: int = option(
        17,
        env="ORT_AUTOPATCH_OPSET",
        flag="--opset",
        kind=Integer(
            OPSET_RANGE.__contains__,
            f"an integer from {OPSET_RANGE.start} to {OPSET_RANGE.stop - 1}",
        ),
        engine=True,
        help="ONNX opset for export",
    )
    threads: int | None = option(
        None,
        env="ORT_AUTOPATCH_THREADS",
        flag="--threads",
        kind=Integer(lambda n: n > 0, "a positive integer (unset: follow torch.get_num_threads())"),
        engine=True,
        help="ONNX Runtime intra-op threads",
    )
    cache_size: int = option(
        8,
        env="ORT_AUTOPATCH_CACHE_SIZE",
        flag="--cache-size",
        kind=Integer(lambda n: n > 0, "a positive integer (graphs kept per module instance)"),
        engine=True,
        help="graphs kept in memory per module instance",
    )
    verify: int = option(
        0,
        env="ORT_AUTOPATCH_VERIFY",
        flag="--verify",
        kind=Integer(lambda n: n >= 0, "a count of calls, 0 for none"),
        engine=True,
        help="also run the first N calls of each new graph in PyTorch and compare outputs and "
        "gradients; a mismatch sends that graph's calls to PyTorch",
    )
    static_after: int = option(
        8,
        env="ORT_AUTOPATCH_STATIC_AFTER",
        flag="--static-after",
        kind=Integer(lambda n: n >= 0, "a count of calls, 0 for never"),
        engine=True,
        help="the first call's input shapes, and an input shape that comes back this many calls "
        "in a row, get a static-shape graph of their own beside the dynamic one (faster to "
        "build and to run on CPU; at most 2 shapes per train/eval and grad mode, each later one "
        "costs one more export and gradient build); 0: only the dynamic graph",
    )

    compile_executor: bool = option(
        True,
        env="ORT_AUTOPATCH_COMPILE_EXECUTOR",
        flag="--no-compile-executor",
        flag_sets=False,
        kind=Switch(),
        engine=True,
        help="on CPU, ORT's slow ReLU, GELU and LayerNorm gradient nodes call torch's backward "
        "functions through a small C++ executor, compiled once in the background with the "
        "machine's C++ compiler (about 15 s) and cached in ~/.cache/ort_autopatch; off: "
        "through Python, slower",
    )

    memory_arena: bool = option(
        True,
        env="ORT_AUTOPATCH_MEMORY_ARENA",
        flag="--no-memory-arena",
        flag_sets=False,
        kind=Switch(),
        engine=True,
        help="on CPU, graphs built for one input shape (the first call's, one that keeps "
        "coming back, see static_after, or the first shape of a model that specialises on sizes) "
        "allocate from one ONNX Runtime arena shared by the process, which keeps each step's "
        "buffers for the next (no page faults each step) and holds that memory until the "
        "process exits; off: ORT's buffers are freed with each step's tensors",
    )

    max_graph_nodes: int = option(
        10000,
        env="ORT_AUTOPATCH_MAX_GRAPH_NODES",
        flag="--max-graph-nodes",
        kind=Integer(lambda n: n >= 0, "a count of nodes, 0 for no limit"),
        engine=True,
        help="a forward that traces to more nodes (a loop unrolled over many steps) runs in "
        "PyTorch: ONNX Runtime would take longer to build its graph than the calls could save "
        "(a 12-layer GPT-2 traces to about 3,100)",
    )
    max_build_seconds: int = option(
        300,
        env="ORT_AUTOPATCH_MAX_BUILD_SECONDS",
        flag="--max-build-seconds",
        kind=Integer(lambda n: n >= 0, "a number of seconds, 0 for no limit"),
        engine=True,
        help="a graph build still running after this long stops, and its calls run in PyTorch",
    )

    untested_torch: bool = option(
        False,
        env="ORT_AUTOPATCH_UNTESTED_TORCH",
        flag="--untested-torch",
        flag_sets=True,
        kind=Switch(),
        help="accelerate even on a torch version this tool is not tested with (it runs the "
        "script in PyTorch otherwise)",
    )
    torch_ops: tuple[str, ...] = option(
        (),
        env="ORT_AUTOPATCH_TORCH_OPS",
        flag="--torch-ops",
        kind=Operators(),
        engine=True,
        help="ATen operators that always run as torch-calling nodes inside the graph (e.g. "
        "aten::scaled_dot_product_attention for torch's fused attention); repeatable",
    )
    no_torch_ops: tuple[str, ...] = option(
        (),
        env="ORT_AUTOPATCH_NO_TORCH_OPS",
        flag="--no-torch-ops",
        kind=Operators(),
        engine=True,
        help="ATen operators never run as torch-calling nodes, even when ONNX Runtime cannot "
        "export or differentiate them (the class then runs in PyTorch); 'aten::*' for all; "
        "repeatable",
    )

    def to_env(self) -> dict[str, str]:
        """Environment variables that make `load_config` in a child rebuild this Config.

        Every option's variable is present; a field that is None maps to `''`, which
        `load_config` reads as unset, so merging this over an inherited environment
        (`{**os.environ, **config.to_env()}`) also clears stale values from the parent. Policy
        variables are never empty, so ORTMODULE_* ones cannot leak in, and no TOML file is read
        (its values are already here), whatever folder the child starts in.
        """
        env = {opt.env: opt.kind.text(getattr(self, opt.name)) for opt in OPTIONS}
        env[ENV_CONFIG_FILE] = _NO_FILE
        return env

    def engine_values(self) -> dict[str, Any]:
        """The options the engine takes, by name (`EngineOptions(**config.engine_values())`)."""
        return {opt.name: getattr(self, opt.name) for opt in OPTIONS if opt.engine}


#: Every option, in declaration order.
OPTIONS: tuple[Option, ...] = tuple(
    dataclasses.replace(f.metadata["option"], name=f.name) for f in dataclasses.fields(Config)
)
#: Field name -> its option.
BY_NAME: Mapping[str, Option] = {opt.name: opt for opt in OPTIONS}
#: Field name -> environment variable (the names are a contract).
ENV_VARS: Mapping[str, str] = {opt.name: opt.env for opt in OPTIONS}
_DEFAULTS = Config()


# --- derived: argparse, the README table -------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option; `cli_values` reads them back for `load_config(cli=...)`."""
    for opt in OPTIONS:
        help_text = opt.describe(getattr(_DEFAULTS, opt.name))
        if opt.flag_sets is not _Unset.TAKES_VALUE:
            parser.add_argument(
                opt.flag, dest=opt.name, action="store_const", const=opt.flag_sets, help=help_text
            )
        elif opt.kind.repeatable:
            parser.add_argument(
                opt.flag, dest=opt.name, action="append", metavar=opt.kind.metavar, help=help_text
            )
        else:
            parser.add_argument(opt.flag, dest=opt.name, metavar=opt.kind.metavar, help=help_text)


def cli_values(ns: argparse.Namespace) -> dict[str, object]:
    """The options `add_arguments` parsed; None = not given. Repeated flags are joined."""
    values: dict[str, object] = {}
    for opt in OPTIONS:
        value = getattr(ns, opt.name, None)
        values[opt.name] = ",".join(value) if isinstance(value, list) else value
    return values


def markdown_table() -> str:
    """The README's option table (a test keeps the README equal to it)."""
    rows = [
        "| variable | flag | TOML key | default | accepted | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for opt in OPTIONS:
        default = opt.kind.text(getattr(_DEFAULTS, opt.name))
        cells = (
            f"`{opt.env}`",
            f"`{opt.flag}`",
            f"`{opt.name}`",
            f"`{default}`" if default else "unset",
            opt.kind.accepted,
            opt.help,
        )
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


# --- reading -----------------------------------------------------------------------------------


def load_config(
    cli: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: pathlib.Path | None = None,
) -> Config:
    """Merge CLI > environment > TOML file > defaults into one validated Config.

    `cli` keys are Config field names; a None value means "flag not given". `environ` defaults to
    `os.environ`; an empty variable counts as unset, as Python's own PYTHON* variables do. The
    TOML file is `$ORT_AUTOPATCH_CONFIG` (an error if it is missing or unreadable; `none` reads no
    file) or else the `[tool.ort_autopatch]` table of `cwd/pyproject.toml` if there is one.
    Raises ConfigError naming the variable, flag or TOML key, the value and what is accepted.
    """
    environ = os.environ if environ is None else environ
    cwd = pathlib.Path.cwd() if cwd is None else cwd
    values: dict[str, Any] = {}
    values.update(_from_toml(environ, cwd))
    values.update(_from_env(environ))
    values.update(_from_cli(cli or {}))
    return Config(**values)


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        variable = opt.env
        raw = environ.get(variable, "")
        if not raw.strip() and opt.also_env:
            variable = opt.also_env
            raw = environ.get(variable, "")
        if raw.strip():
            values[opt.name] = opt.kind.parse(raw, variable)
    return values


def _from_cli(cli: Mapping[str, object]) -> dict[str, Any]:
    unknown = sorted(set(cli) - set(BY_NAME))
    if unknown:
        # A programming error in the launcher, not a user error: fail loudly and differently.
        raise TypeError(f"load_config: unknown CLI keys {unknown}; accepted: {sorted(BY_NAME)}")
    return {
        name: _parse_python(BY_NAME[name], raw, BY_NAME[name].flag)
        for name, raw in cli.items()
        if raw is not None
    }


def _from_toml(environ: Mapping[str, str], cwd: pathlib.Path) -> dict[str, Any]:
    explicit = environ.get(ENV_CONFIG_FILE, "").strip()
    if explicit.lower() == _NO_FILE:
        return {}
    if explicit:
        path = pathlib.Path(explicit).expanduser()
        if not path.is_absolute():
            path = cwd / path
        if not path.is_file():
            raise ConfigError(
                ENV_CONFIG_FILE,
                explicit,
                "no such file",
                f"the path of an existing TOML file, or '{_NO_FILE}' to read none",
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


def _parse_table(table: Mapping[str, Any], where: str, base: pathlib.Path) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, raw in table.items():
        opt = BY_NAME.get(key.replace("-", "_"))
        variable = f"{where} {key}"
        if opt is None:
            raise ConfigError(variable, raw, "unknown key", ", ".join(BY_NAME))
        # Relative paths in a file mean "next to the file", as in other tools' configs.
        values[opt.name] = opt.kind.relative_to(_parse_python(opt, raw, variable), base)
    return values


def _parse_python(opt: Option, raw: object, where: str) -> Any:
    """A value from TOML or `cli=`: its natural Python type, or its string form.

    Errors quote the value as the user wrote it (`0`, `["a"]`), not our string form of it.
    """
    kind = opt.kind
    final, text = kind.from_python(raw)
    if final:
        return text
    if not isinstance(text, str):
        raise ConfigError(where, raw, f"expected {kind.type_name}", kind.accepted)
    if not text.strip() and not kind.empty_allowed:
        raise ConfigError(where, raw, "empty value", kind.accepted)
    try:
        return kind.parse(text, where)
    except ConfigError as error:
        if text is raw:
            raise
        raise ConfigError(where, raw, error.reason, error.accepted) from None
