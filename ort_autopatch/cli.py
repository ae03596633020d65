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
"""

from __future__ import annotations

import argparse
import builtins
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from ort_autopatch.config import (
    BY_NAME,
    ENV_VARS,
    OPTIONS,
    Config,
    add_arguments,
    cli_values,
    load_config,
)
from ort_autopatch.errors import ConfigError
from ort_autopatch.versions import __version__

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
    main_module = _fresh_main_module()
    if kind == "script":
        prepared = _prepare_script(main_module, target, args)
    elif kind == "code":
        prepared = _prepare_code(main_module, target, args)
    else:
        prepared = _prepare_module(main_module, target, args)
    if isinstance(prepared, int):
        return prepared
    export_environment(config)
    from ort_autopatch.activation import activate

    activate(config, own_output=True)
    _execute(prepared, main_module)
    return 0


def _fresh_main_module() -> types.ModuleType:
    """A real `__main__` registered in sys.modules, as the interpreter makes one."""
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __builtins__=builtins, __annotations__={}, __file__=None, __cached__=None
    )
    sys.modules["__main__"] = module
    return module


def _set_path0(entry: str) -> None:
    # Under -P / PYTHONSAFEPATH python prepends nothing, and neither does the launcher's own
    # entry exist to be replaced.
    if getattr(sys.flags, "safe_path", False):
        return
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.insert(0, entry)


def _prepare_script(
    module: types.ModuleType, path: str, args: Sequence[str]
) -> types.CodeType | int:
    filename = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    sys.argv = [path, *args]
    if os.path.isdir(path) or _is_zipfile(path):
        # A folder or zip archive with __main__.py: it goes on sys.path and its __main__ runs.
        _set_path0(filename)
        return _prepare_module(module, "__main__", args, argv0=path)
    try:
        with open(path, "rb") as handle:
            source = handle.read()
    except OSError as exc:
        print(
            f"{sys.executable}: can't open file {filename!r}: [Errno {exc.errno}] {exc.strerror}",
            file=sys.stderr,
        )
        return 2
    _set_path0(os.path.dirname(os.path.realpath(path)))
    from importlib.machinery import SourceFileLoader, SourcelessFileLoader

    loader: Any
    if path.endswith(".pyc"):
        # The loader checks the magic number and flags, as python does for a .pyc script.
        loader = SourcelessFileLoader("__main__", filename)
        try:
            code: Any = loader.get_code("__main__")
        except ImportError as exc:
            print(f"{sys.executable}: can't run {filename!r}: {exc}", file=sys.stderr)
            return 1
    else:
        loader = SourceFileLoader("__main__", filename)
        code = _compile(source, filename)
        if code is None:
            return 1
    module.__dict__.update(
        __file__=filename, __loader__=loader, __spec__=None, __package__=None, __cached__=None
    )
    return code


def _compile(source: str | bytes, filename: str) -> types.CodeType | None:
    try:
        return compile(source, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        exc.__traceback__ = None  # python shows no frames for code that does not compile
        sys.excepthook(type(exc), exc, None)
        return None


def _prepare_code(module: types.ModuleType, code: str, args: Sequence[str]) -> types.CodeType | int:
    """`-c CODE`: as python runs it (`sys.argv[0] == '-c'`, the current folder first on
    `sys.path`, a `__main__` without `__file__`)."""
    from importlib.machinery import BuiltinImporter

    sys.argv = ["-c", *args]
    _set_path0("")
    compiled = _compile(code, "<string>")
    if compiled is None:
        return 1
    for name in ("__file__", "__cached__"):
        module.__dict__.pop(name, None)
    module.__dict__.update(__loader__=BuiltinImporter, __spec__=None, __package__=None)
    return compiled


def _is_zipfile(path: str) -> bool:
    if not os.path.isfile(path) or path.endswith((".py", ".pyc")):
        return False
    import zipfile

    return zipfile.is_zipfile(path)


class _NotRunnable(Exception):
    """Why `-m name` cannot run; printed as python prints it."""


def _prepare_module(
    module: types.ModuleType, name: str, args: Sequence[str], argv0: str | None = None
) -> types.CodeType | int:
    if argv0 is None:
        sys.argv = ["-m", *args]  # what python shows while it imports the parent packages
        _set_path0(os.getcwd())
    # Resolved now, before install(): the import hook must not wrap this module's loader.
    saved = sys.modules.pop("__main__") if name == "__main__" else None
    try:
        spec, code = _find_module(name)
    except _NotRunnable as exc:
        print(f"{sys.executable}: {exc}", file=sys.stderr)
        return 1
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
    module.__dict__.update(
        __file__=spec.origin if spec.has_location else None,
        __cached__=spec.cached,
        __loader__=spec.loader,
        __package__=spec.parent,
        __spec__=spec,
    )
    if argv0 is None:
        sys.argv[0] = spec.origin if spec.origin is not None else name
    return code


def _find_module(name: str) -> tuple[Any, types.CodeType]:
    """The spec and code `python -m name` runs, through public importlib: parent packages are
    imported first, a package runs its `__main__`, and failures read as python's own."""
    import importlib.util

    if name.startswith("."):
        raise _NotRunnable("Relative module names not supported")
    parent = name.rpartition(".")[0]
    if parent:
        try:
            importlib.import_module(parent)
        except ImportError as exc:
            # A missing parent is reported below as the module not being found; an ImportError
            # raised by the parent's own code propagates, as under python.
            if exc.name is None or (exc.name != parent and not parent.startswith(exc.name + ".")):
                raise
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        message = (
            f"Error while finding module specification for {name!r} ({type(exc).__name__}: {exc})"
        )
        if name.endswith(".py"):
            message += f". Try using '{name[:-3]}' instead of '{name}' as the module name."
        raise _NotRunnable(message) from exc
    if spec is None:
        raise _NotRunnable(f"No module named {name}")
    if spec.submodule_search_locations is not None:
        if name == "__main__" or name.endswith(".__main__"):
            raise _NotRunnable("Cannot use package as __main__ module")
        try:
            return _find_module(f"{name}.__main__")
        except _NotRunnable as exc:
            if name not in sys.modules:
                raise
            raise _NotRunnable(
                f"{exc}; {name!r} is a package and cannot be directly executed"
            ) from exc
    if spec.loader is None:
        raise _NotRunnable(f"{name!r} is a namespace package and cannot be executed")
    get_code = getattr(spec.loader, "get_code", None)
    if get_code is None:
        raise _NotRunnable(f"No code object available for {name}")
    try:
        code = get_code(name)
    except ImportError as exc:
        raise _NotRunnable(str(exc)) from exc
    if code is None:
        raise _NotRunnable(f"No code object available for {name}")
    return spec, code


def _execute(code: types.CodeType, module: types.ModuleType) -> None:
    """Run the user's code; on an uncaught exception, hand python a traceback that starts there."""
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        _trim_traceback_for_excepthook(exc, code)
        raise  # the interpreter prints it, exits 1, or dies of SIGINT for KeyboardInterrupt


def _trim_traceback_for_excepthook(exc: BaseException, code: types.CodeType) -> None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not code:
        tb = tb.tb_next
    if tb is None:
        return  # not raised through the user's code: show every frame
    trimmed = tb
    previous = sys.excepthook  # the script may have installed its own; it still gets called

    def excepthook(kind: type[BaseException], value: BaseException, full: Any) -> None:
        sys.excepthook = previous
        if value is exc:
            value.__traceback__ = full = trimmed
        previous(kind, value, full)

    sys.excepthook = excepthook


def export_environment(config: Config) -> None:
    """Make every child Python activate with this configuration (see bootstrap/)."""
    os.environ.update(config.to_env())
    current = os.environ.get("PYTHONPATH", "")
    if current.split(os.pathsep)[0] != BOOTSTRAP_DIR:
        os.environ["PYTHONPATH"] = (
            BOOTSTRAP_DIR + os.pathsep + current if current else BOOTSTRAP_DIR
        )


# -- --check --------------------------------------------------------------------------------------


def _check_selection(config: Config, row: Callable[..., str]) -> list[str]:
    """What the allowlist selects. The modules it names literally are imported to look for the
    classes (as the script would import them); `__main__` and wildcard modules can only be
    checked by a run, which warns at exit about every pattern that matched nothing."""
    if not config.modules:
        return [
            row("selection", "nothing selected: give --modules PATTERNS or ORT_AUTOPATCH_MODULES")
        ]
    import importlib

    from ort_autopatch import feedback
    from ort_autopatch.hook import Selector

    selector = Selector(config.modules, config.exclude)
    warnings: list[str] = []
    at_run: list[str] = []
    failed: list[str] = []
    for pattern in config.modules:
        module = pattern.partition(":")[0]
        if module in ("__main__", "__mp_main__") or any(ch in module for ch in "*?["):
            at_run.append(pattern)
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # the user's module failing to import is a finding
            failed.append(pattern)
            warnings.append(f"pattern {pattern!r}: cannot import {module!r}: {exc}")
    candidates = feedback.imported_classes()
    selected = [name for name in candidates if selector.matches(*name.split(":", 1)) and name]
    lines = [row("selection", ", ".join(selected) or "no class found yet")]
    for pattern in selector.unmatched():
        if pattern not in at_run and pattern not in failed:
            warnings.append(feedback.unmatched_message(pattern, candidates))
    lines.extend(f"  WARNING {w}" for w in warnings)
    lines.extend(
        f"  (checked when the script runs: {p})" for p in at_run if p in selector.unmatched()
    )
    return lines


def _torch_cuda() -> str | None:
    """The CUDA version torch is built for (None: a CPU build, or torch does not import)."""
    try:
        import torch
    except Exception:  # said by check() already
        return None
    return torch.version.cuda


def check(config: Config) -> tuple[str, bool]:
    """A short diagnosis: can this interpreter accelerate, and with which settings.

    Returns the text and whether acceleration is possible. Imports torch and (through the
    engine's loader) onnxruntime, since the question is whether they work.
    """
    import platform

    lines = [f"ort_autopatch {__version__} --check"]
    row = "  {:<14}{}".format
    lines.append(row("Python", f"{platform.python_version()} ({sys.executable})"))
    problems: list[str] = []
    notes: list[str] = []  # what runs, though not as tested
    try:
        import torch

        cuda = "CUDA available" if torch.cuda.is_available() else "no CUDA device"
        lines.append(row("torch", f"{torch.__version__} ({cuda})"))
        from ort_autopatch import versions

        untested = versions.untested_torch_reason(str(torch.__version__))
        if untested is not None and config.untested_torch:
            notes.append(f"{untested}; tried anyway ({BY_NAME['untested_torch'].flag})")
        elif untested is not None:
            opt = BY_NAME["untested_torch"]
            problems.append(f"{untested}, or set {opt.env}=1 ({opt.flag}) to try this one")
    except Exception as exc:  # a broken torch is exactly what --check is for
        lines.append(row("torch", f"cannot import: {exc}"))
        problems.append(f"torch does not import: {exc}")
    from ort_autopatch.engine import backend as backend_registry
    from ort_autopatch.engine import runtime

    found = runtime.installed_distributions()
    training = [n for n in found if n in runtime.TRAINING_DISTRIBUTIONS]
    inference = [n for n in found if n in runtime.INFERENCE_DISTRIBUTIONS]
    if not found:
        lines.append(row("ONNX Runtime", "not installed"))
    for name in found:
        kind = "training build" if name in training else "inference-only build"
        lines.append(row("ONNX Runtime", f"{name} {found[name]} ({kind})"))
    if training and inference:
        problems.append(
            f"{', '.join(inference)} and {', '.join(training)} are both installed and share the "
            f"'onnxruntime' package; the last one installed wins. Uninstall {', '.join(inference)}"
        )
    reason = backend_registry.unavailable_reason(config.backend)
    backend = backend_registry.resolve(config.backend)
    if reason is not None:
        problems.append(reason)
    else:
        version = backend_registry.version(backend)
        lines.append(row("backend", f"{backend} (ONNX Runtime {version})"))
        try:
            providers = runtime.available_providers()
            lines.append(row("providers", ", ".join(providers)))
        except Exception as exc:
            problems.append(f"ONNX Runtime does not load: {exc}")
        pairing = runtime.cuda_mismatch(_torch_cuda(), backend)  # GPU libraries of each side
        if pairing is not None:
            said, is_problem = pairing
            (problems if is_problem else notes).append(said)
    ok = not problems
    if ok:  # the chosen backend's own lines (the training build: its ATen executor)
        from ort_autopatch.engine.recipe import EngineOptions

        options = EngineOptions(**config.engine_values())
        for label, status in backend_registry.backend_class(backend).doctor(options):
            lines.append(row(label, status))
    lines.append(row("accelerate", "yes" if ok else "no"))
    lines.extend(f"  problem: {p}" for p in problems)
    lines.extend(f"  note: {n}" for n in notes)
    lines.append("  configuration (options > ORT_AUTOPATCH_* > pyproject.toml > defaults):")
    environment = config.to_env()
    lines.extend(f"    {opt.env}={environment[opt.env]}" for opt in OPTIONS)
    lines.extend(_check_selection(config, row))
    return "\n".join(lines), ok
