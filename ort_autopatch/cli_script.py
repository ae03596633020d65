"""The user's code run as `python` runs it: a fresh, real `__main__` module, prepared from a
script (a file, a folder or zip archive with `__main__.py`, a `.pyc`), a `-m` module or `-c` code,
with the `sys.argv`, `sys.path[0]`, `__file__` and `__spec__` python would give it, its failures
printed as python prints them, and tracebacks that start in its own code.

The launcher (`cli.run`) makes the module, prepares the code, activates the tool and then runs
it; why in that order is said in cli.py.
"""

from __future__ import annotations

import builtins
import os
import sys
import types
from collections.abc import Sequence
from typing import Any


def fresh_main_module() -> types.ModuleType:
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


def prepare_script(
    module: types.ModuleType, path: str, args: Sequence[str]
) -> types.CodeType | int:
    filename = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    sys.argv = [path, *args]
    if os.path.isdir(path) or _is_zipfile(path):
        # A folder or zip archive with __main__.py: it goes on sys.path and its __main__ runs.
        _set_path0(filename)
        return prepare_module(module, "__main__", args, argv0=path)
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


def prepare_code(module: types.ModuleType, code: str, args: Sequence[str]) -> types.CodeType | int:
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


def prepare_module(
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


def execute(code: types.CodeType, module: types.ModuleType) -> None:
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
