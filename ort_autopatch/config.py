"""One frozen `Config`, read once, from CLI > environment > TOML file > defaults.

Every option is declared once, as a field of `Config` whose metadata is an `Option`: the
environment variable, the launcher flag, the kind of value (`config_kinds.py`: it parses,
validates, names what is accepted and writes the value back as text) and the help line.
Everything else is derived from those declarations: reading the environment, TOML (the file
`config_file.py` finds) and CLI values, `Config.to_env`, the launcher's argparse options and
`--help`, the engine's options (`Config.engine_values`) and the README's option table
(`markdown_table`, checked by a test). docs/options.md says how to add one.

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
from collections.abc import Mapping
from typing import Any

from ort_autopatch.config_file import ENV_CONFIG_FILE, NO_FILE, find_table
from ort_autopatch.config_kinds import (
    Choice,
    Folder,
    Integer,
    Kind,
    Operators,
    Patterns,
    Policy,
    ReportPath,
    Switch,
)
from ort_autopatch.engine import backend as backend_registry
from ort_autopatch.errors import ConfigError
from ort_autopatch.policy import DEFAULT_FALLBACK, DEFAULT_SKIP_CHECK, Fallback, SkipCheck

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
        help="on CPU, once a graph is built for one input shape (the first call's, one that "
        "keeps coming back, see static_after, or the first shape of a model that specialises "
        "on sizes), the process's heap keeps a step's freed buffers for the next step, "
        "PyTorch's and ORT's alike (no page faults each step): glibc's mmap threshold at 32 MiB "
        "and trim threshold at 1 GiB, and no block mapped apart while such a graph runs, "
        "unless MALLOC_MMAP_MAX_, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or "
        "GLIBC_TUNABLES set them; without glibc such graphs allocate from one ONNX Runtime "
        "arena shared by the process, held until it exits; off: glibc's own thresholds, "
        "ORT's buffers freed with each step's tensors",
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
    background_builds: bool = option(
        True,
        env="ORT_AUTOPATCH_BACKGROUND_BUILDS",
        flag="--foreground-builds",
        flag_sets=False,
        kind=Switch(),
        help="on the plain backend (Linux, CPU), a forked helper process builds and checks each "
        "new graph while its calls run in PyTorch, so no step waits for a build (the report "
        "counts those calls); off: the call that needs a graph waits for its build",
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
        env[ENV_CONFIG_FILE] = NO_FILE
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
    table = find_table(environ, cwd)
    if table is not None:
        values.update(_parse_table(table.values, table.where, table.base))
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
