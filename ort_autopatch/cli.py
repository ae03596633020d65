"""`python -m ort_autopatch [options] script.py [args]`: run a script exactly as `python` would.

The script must not notice the launcher, because users copy their normal command line after it:
it gets a fresh, real `__main__` module in `sys.modules` (pickling classes defined in the script
and multiprocessing's spawn need one), the `sys.argv`/`sys.path[0]`/`__file__`/`__spec__`
python would give it, its exit status and SystemExit codes, and tracebacks that start in its own
code. The order matters and is why this is not `runpy`: the `__main__` module exists before
anything imports multiprocessing (torch does; multiprocessing aliases `__mp_main__` to whatever
`__main__` is then), the `-m` spec is resolved before the import hook is installed (the hook
wraps loaders of selected modules), and the environment for child processes (PYTHONPATH with the
bootstrap folder, the configuration as ORT_AUTOPATCH_* variables) is set before the script starts.

This module reads the command line and does things in that order; making and running `__main__`
as python does is `cli_script.py`, and `--check`'s diagnosis is `cli_check.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ort_autopatch import cli_script
from ort_autopatch.cli_check import check
from ort_autopatch.config import ENV_VARS, Config, add_arguments, cli_values, load_config
from ort_autopatch.errors import ConfigError

__all__ = ["BOOTSTRAP_DIR", "build_parser", "check", "export_environment", "main"]

#: Folder holding the child-process `sitecustomize.py`; put first on PYTHONPATH for children.
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


_EPILOG = """\
examples:
  python -m ort_autopatch --modules '__main__:Net,mypkg.models:*Head' train.py --epochs 3
  python -m ort_autopatch --modules 'transformers.models.bert.*:Bert*' -m mypkg.finetune
  torchrun --nproc_per_node 2 -m ort_autopatch --report 'report-{rank}.json' train_ddp.py

Every option has an environment variable (ORT_AUTOPATCH_MODULES for --modules, and so on; see
the README), and a given option wins over its variable. The settings travel to every child
Python (DataLoader workers, multiprocessing, torchrun ranks, subprocess calls to python) through
the environment. Options go before the script; everything after it belongs to the script.
"""


def build_parser(prog: str = "python -m ort_autopatch") -> argparse.ArgumentParser:
    """The launcher's options; each mirrors one ORT_AUTOPATCH_* variable."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [options] script.py [args ...]\n"
        f"       {prog} [options] -m module [args ...]\n"
        f"       {prog} [options] -c code [args ...]",
        description="Run a PyTorch script unchanged; the selected torch.nn.Module classes train "
        "through ONNX Runtime.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_arguments(parser)
    add = parser.add_argument
    add(
        "--check",
        action="store_true",
        help="diagnose this environment (Python, torch, ONNX Runtime build, providers, the "
        "parsed configuration) and exit; runs nothing",
    )
    add(
        "--clear-cache",
        action="store_true",
        help="empty the persistent graph cache (--cache-dir or ORT_AUTOPATCH_CACHE_DIR) and exit",
    )
    add("--version", action="store_true", help="print versions of the tool, torch and ORT")
    return parser


class _UsageError(Exception):
    pass


def split_argv(
    argv: Sequence[str], parser: argparse.ArgumentParser | None = None
) -> tuple[list[str], tuple[str, str] | None, list[str]]:
    """Cut the command line into (our options, ("script"|"module"|"code", target), the script's
    args).

    argparse cannot do this itself: the script's own options (`--epochs 3`) must never be read
    as ours, so the cut happens at the first positional argument, at `-m` or at `-c`, as python
    cuts its own command line. Which options take no value comes from the parser itself.
    """
    flags = {
        option
        for action in (parser or build_parser())._actions
        if action.nargs == 0
        for option in action.option_strings
    }
    options: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            if i + 1 >= len(argv):
                raise _UsageError("'--' must be followed by a script")
            return options, ("script", argv[i + 1]), list(argv[i + 2 :])
        for short, kind, what in (("-m", "module", "a module name"), ("-c", "code", "code")):
            if token == short or (token.startswith(short) and not token.startswith("--")):
                target = token[2:] or (argv[i + 1] if i + 1 < len(argv) else None)
                if target is None or (kind == "module" and not target):
                    raise _UsageError(f"argument {short}: expected {what}")
                rest = argv[i + 1 :] if token != short else argv[i + 2 :]
                return options, (kind, target), list(rest)
        if token.startswith("-") and token != "-":
            options.append(token)
            if "=" not in token and token not in flags and i + 1 < len(argv):
                options.append(argv[i + 1])
                i += 1
            i += 1
            continue
        return options, ("script", token), list(argv[i + 1 :])
    return options, None, []


def _prog() -> str:
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m ort_autopatch" if argv0 in ("", "__main__.py", "-m", "-c") else argv0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m ort_autopatch` and the `ort-autopatch` console script.

    Returns the exit status for the launcher's own outcomes; the script's SystemExit and uncaught
    exceptions propagate so that the interpreter ends the process exactly as it would without us.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = _prog()
    parser = build_parser(prog)
    try:
        options, target, script_args = split_argv(argv, parser)
    except _UsageError as exc:
        parser.error(str(exc))
    ns = parser.parse_args(options)
    if ns.version:
        print(version_text())
        return 0
    try:
        config = load_config(cli=cli_values(ns))
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if ns.check:
        text, ok = check(config)
        print(text)
        return 0 if ok else 1
    if ns.clear_cache:
        return clear_cache(config, prog)
    if target is None:
        parser.error("nothing to run: give a script (script.py [args]) or -m module [args]")
    kind, name = target
    return run(kind, name, script_args, config)


def clear_cache(config: Config, prog: str) -> int:
    """Remove every entry of the persistent graph cache; status 2 when none is configured."""
    if config.cache_dir is None:
        print(
            f"{prog}: error: --clear-cache needs a cache folder: give --cache-dir DIR or set "
            f"{ENV_VARS['cache_dir']}",
            file=sys.stderr,
        )
        return 2
    from ort_autopatch.engine.store import GraphStore

    removed = GraphStore(config.cache_dir).clear() if config.cache_dir.exists() else 0
    print(f"removed {removed} cached graph group(s) from {config.cache_dir}")
    return 0


def version_text() -> str:
    """Versions from package metadata: importing torch or onnxruntime here would cost seconds."""
    from ort_autopatch import report

    v = report.versions()
    return (
        f"ort_autopatch {v['version']} (Python {sys.version.split()[0]}, "
        f"torch {v['torch'] or 'not installed'}, onnxruntime {v['onnxruntime'] or 'not installed'})"
    )


# -- running the script -----------------------------------------------------------------------


def run(kind: str, target: str, args: Sequence[str], config: Config) -> int:
    """Set up `__main__` like python, activate, and execute the script or module."""
    main_module = cli_script.fresh_main_module()
    if kind == "script":
        prepared = cli_script.prepare_script(main_module, target, args)
    elif kind == "code":
        prepared = cli_script.prepare_code(main_module, target, args)
    else:
        prepared = cli_script.prepare_module(main_module, target, args)
    if isinstance(prepared, int):
        return prepared
    export_environment(config)
    from ort_autopatch.activation import activate

    activate(config, own_output=True)
    cli_script.execute(prepared, main_module)
    return 0


def export_environment(config: Config) -> None:
    """Make every child Python activate with this configuration (see bootstrap/)."""
    os.environ.update(config.to_env())
    current = os.environ.get("PYTHONPATH", "")
    if current.split(os.pathsep)[0] != BOOTSTRAP_DIR:
        os.environ["PYTHONPATH"] = (
            BOOTSTRAP_DIR + os.pathsep + current if current else BOOTSTRAP_DIR
        )
