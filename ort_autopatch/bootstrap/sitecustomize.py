"""Activation in every child Python the launcher's process tree starts.

`python -m ort_autopatch` puts this folder first on PYTHONPATH and exports its configuration
as ORT_AUTOPATCH_* variables, so DataLoader workers started with spawn, multiprocessing
spawn/forkserver pools, torchrun ranks and `subprocess` calls to python all activate here, at
interpreter start, before their own `__main__` runs. Rules, learnt from other tools' bugs:

* never fail the child: every error is logged (stderr), the child's own code still runs;
* activate once per process, and not at all in a process this activation itself starts;
* import the user's own `sitecustomize` afterwards (there can be only one module of that name),
  found on sys.path with this folder removed.

A different Python started with this PYTHONPATH (another venv, another version) only logs why it
could not activate.
"""

import os
import sys

_ACTIVATING = "ORT_AUTOPATCH_BOOTSTRAP_ACTIVATING"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _warn(message: str) -> None:
    try:
        sys.stderr.write(f"[ort_autopatch] ERROR {message}\n")
    except Exception:
        pass


def _import_package() -> object:
    """Import ort_autopatch from the folder holding this file (it may not be installed)."""
    if "ort_autopatch" in sys.modules:
        return sys.modules["ort_autopatch"]
    root = os.path.dirname(os.path.dirname(_HERE))
    sys.path.insert(0, root)
    try:
        import ort_autopatch
    finally:
        try:
            sys.path.remove(root)  # the package is loaded; submodules resolve through it
        except ValueError:
            pass
    return ort_autopatch


def _activate() -> None:
    if os.environ.get(_ACTIVATING):
        return  # a process our own activation started: no recursion
    os.environ[_ACTIVATING] = str(os.getpid())
    try:
        _import_package()
        from ort_autopatch.activation import activate_from_environment

        # A child of the launcher's run: its output is the launcher's.
        activate_from_environment(strict=False, own_output=True)
    except Exception as exc:
        _warn(
            f"activation failed in {sys.executable} (pid {os.getpid()}); it runs without "
            f"ort_autopatch: {type(exc).__name__}: {exc}"
        )
    finally:
        os.environ.pop(_ACTIVATING, None)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _chain_user_sitecustomize() -> None:
    """Run the sitecustomize python would have run without our folder first on sys.path."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    mine = os.path.realpath(os.path.abspath(__file__))
    path = [p for p in sys.path if not _same_file(p or ".", _HERE)]
    spec = PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.realpath(spec.origin) == mine:
        return  # our own file reached through another path entry: never run it twice
    module = module_from_spec(spec)
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module  # `import sitecustomize` now finds the user's
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        # Python's own site.py also reports and carries on when a sitecustomize raises.
        _warn(f"the user's sitecustomize ({spec.origin}) raised {type(exc).__name__}: {exc}")


def _remove_own_folder() -> None:
    sys.path[:] = [p for p in sys.path if not _same_file(p or ".", _HERE)]


if not getattr(sys, "_ort_autopatch_bootstrapped", False):
    sys._ort_autopatch_bootstrapped = True  # type: ignore[attr-defined]
    _remove_own_folder()  # the child's sys.path stays what it would be without us
    _activate()
    try:
        _chain_user_sitecustomize()
    except Exception as _exc:
        _warn(f"could not look for the user's sitecustomize: {_exc}")
