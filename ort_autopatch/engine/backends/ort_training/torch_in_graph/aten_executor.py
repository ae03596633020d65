"""Torch operators called from inside the graph without Python: ORT's `ATen` node.

ORT's training build runs `org.pytorch.aten::ATen` (attributes `operator`, `overload_name`) by
calling a registered C++ executor with DLPack tensors. The executor (`aten_executor.cpp`) finds
the operator in torch's dispatcher and calls it: about 15 us a node, against 0.1 to 0.2 ms for
a `PythonOp` (`nodes`), whose round trip through Python, ctypes and autograd costs more than
the small gradient kernels it replaces. It has no autograd, so it serves nodes of the backward
pass, which ORT differentiated already (`gradients`).

The executor is compiled with the machine's C++ compiler against the torch in the running
interpreter (about 15 s, once) and cached by the hash of its source, torch's version and the
compiler. A training step never waits for it: the first graph that wants it starts the build in
the background (`aten_build`) and runs the slower path (ORT's kernels, or Python nodes for the
largest); once the compiler is done (`compiled()`), graphs built while it ran take it up at
their next call (`backends.ort_training`) and later graphs use it from the start. `python -m
ort_autopatch --check` and `build()` compile it in the foreground. Without a compiler, or with
no folder (the engine's `compile_executor=False`), `executor()` says why and the gradient nodes
go through Python.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_build

log = logging.getLogger("ort_autopatch")

DOMAIN = "org.pytorch.aten"
OP_TYPE = "ATen"
SOURCE = Path(__file__).with_name("aten_executor.cpp")
#: Compiler flags beyond include paths and torch's ABI setting (torch's headers need C++20).
FLAGS = ("-O2", "-std=c++20", "-fPIC", "-shared", "-w")

_lock = threading.Lock()
_registered: Path | None = None  # the library ORT calls (one per process: ORT keeps one)
_failure: str | None = None  # why the executor is unavailable in this process
_library: Any = None  # keeps the loaded library referenced
_announced = False  # this process said that the executor is compiling (once)
_plans: dict[Path, tuple[list[str], Path]] = {}  # folder -> (compiler line, library)
_watching = False  # a thread waits for the background compiler (this process's or another's)
#: set once the background compile this process waits for has left its library or its
#: failure note (or no compiler runs and none appeared): `compiled()`
_done = threading.Event()
#: how long no process may hold the lock, with neither library nor note there, before the
#: watch ends (a compiler killed halfway); another process's build may take that long to lock
_ORPHANED_SECONDS = 5.0

#: `executor()`'s answer while the library is being compiled: a later call may find it
COMPILING = "the ATen executor is compiling in the background"


def compiled() -> bool:
    """Whether a background compile this process answered `COMPILING` for has ended since (a
    flag, cheap enough for a training call to ask); `executor()` then says what it left."""
    return _done.is_set()


def default_folder() -> Path:
    """Where compiled executors are cached: the platform's per-user cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ort_autopatch"


def executor(folder: Path | None) -> str | None:
    """Make ORT's `ATen` nodes call torch in this process: None when they do, else why not.

    `folder` caches the compiled library; None means never compile (and so never call torch
    from an `ATen` node). Without the library, the build starts in the background and the
    answer is "not yet" until a later call finds it. A failure is remembered: one per process.
    """
    global _registered, _failure, _library
    if folder is None:
        return "compiling the ATen executor is turned off"
    if _registered is not None:
        return None
    with _lock:
        if _registered is not None or _failure is not None:
            return _failure
        try:
            command, target = _plan(folder)
            if not target.exists():
                return _in_background(command, target)
            library = ctypes.CDLL(str(target))
            from ort_autopatch.engine import runtime

            runtime.capi().register_aten_op_executor(
                str(_address(library.ort_autopatch_is_tensor_argument)),
                str(_address(library.ort_autopatch_execute)),
            )
        except Exception as exc:  # whatever stops it, training goes on through Python
            return _failed(f"the ATen executor could not be built: {str(exc)[-600:]}")
        _library, _registered = library, target
        log.debug("ATen executor: %s", target)
    return None


def _failed(reason: str) -> str:
    global _failure
    _failure = reason
    log.warning(
        "%s; torch-calling gradient nodes go through Python (slower; `python -m ort_autopatch "
        "--check` tries again, --no-compile-executor stops the attempt)",
        reason,
    )
    return reason


def _in_background(command: list[str], target: Path) -> str:
    """Start (once across processes) the build of `target`; why the executor is not there yet."""
    global _announced
    failed = aten_build.failure_path(target)
    if failed.exists():
        return _failed(f"the ATen executor could not be built: {failed.read_text()[-600:]}")
    if not aten_build.building(target):
        script = Path(aten_build.__file__)
        # -I -S: no site (so no sitecustomize activating the tool), no user paths; its own
        # session, so a Ctrl-C of the training does not kill it halfway (it renames a complete
        # file anyway)
        builder = subprocess.Popen(
            [sys.executable, "-I", "-S", str(script), str(target), *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _watch(target, builder)
    elif not _watching:  # another process compiles
        _watch(target, None)
    if not _announced:
        _announced = True
        log.info(
            "the ATen executor for torch %s is compiling in the background (once per torch "
            "install, ~15 s): until it is ready, gradient nodes run through ORT's kernels or "
            "Python, and graphs take it up once it is ready (%s)",
            torch.__version__,
            target,
        )
    return COMPILING


def _watch(target: Path, builder: subprocess.Popen[bytes] | None) -> None:
    """Set `_done` from a daemon thread (nothing waits for the compiler when the process exits)
    once `target` or its failure note exists. This process's `builder` is reaped first; it
    may have lost the race to another process's build, which holds the lock until it is done
    (and may not hold it yet when this one looks)."""
    global _watching
    _watching = True
    failed = aten_build.failure_path(target)

    def watch() -> None:
        if builder is not None:
            builder.wait()
        unlocked_since = None
        polls = 0
        while not (target.exists() or failed.exists()):
            polls += 1
            if polls % 10 == 0:  # the lock, once a second: looking takes it for a moment
                if aten_build.building(target):
                    unlocked_since = None
                elif unlocked_since is None:
                    unlocked_since = time.monotonic()
                elif time.monotonic() - unlocked_since > _ORPHANED_SECONDS:
                    break
            time.sleep(0.1)
        _done.set()

    threading.Thread(target=watch, name="ort_autopatch-aten-build", daemon=True).start()


def _address(function: Any) -> int:
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


BuildError = aten_build.BuildError


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else c++ or g++ on PATH."""
    wanted = os.environ.get("CXX")
    if wanted:
        return shutil.which(wanted)
    return shutil.which("c++") or shutil.which("g++")


def build(folder: Path) -> Path:
    """The compiled executor for this torch, built into `folder` unless already there (in the
    foreground: waits for a build another process runs)."""
    command, target = _plan(folder)
    if target.exists():
        return target
    log.info("building the ATen executor for torch %s (once, ~15 s): %s", torch.__version__, target)
    aten_build.compile_to(command, target, wait=True)
    return target


def _plan(folder: Path) -> tuple[list[str], Path]:
    """The compiler line and the library it makes in `folder` (named by its key)."""
    cached = _plans.get(folder)
    if cached is not None:
        return cached
    cxx = compiler()
    if cxx is None:
        wanted = os.environ.get("CXX")
        if wanted:
            raise BuildError(f"$CXX ({wanted}) is not a compiler on PATH; set CXX to one")
        raise BuildError("no C++ compiler found (install g++, or set CXX to one)")
    command = _command(cxx)
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), torch.__version__, _identity(cxx), *command]).encode()
    ).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    _plans[folder] = command, folder / f"aten_executor-{key}.so"
    return _plans[folder]


def _command(cxx: str) -> list[str]:
    # torch's wheel ships its headers and libraries beside its Python files; read directly, as
    # torch.utils.cpp_extension would (which imports setuptools, absent from some venvs)
    root = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    library = root / "lib"
    links = [f"-L{library}", f"-Wl,-rpath,{library}"]
    # the libraries after the source: linkers drop those named before what uses them
    return [
        cxx,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        str(SOURCE),
        *links,
        "-lc10",
        "-ltorch_cpu",
    ]


def _identity(cxx: str) -> str:
    """The compiler, as the file it is (running `--version` would cost every first call)."""
    try:
        real = os.path.realpath(cxx)
        found = os.stat(real)
    except OSError:
        return cxx
    return f"{real}:{found.st_size}:{found.st_mtime_ns}"


def node(
    operator: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str,
    overload: str = "",
) -> Any:
    """An `ATen` node calling `operator` ("aten::threshold_backward"); non-tensor arguments
    are inputs too (constants), in the operator's argument order."""
    from onnx import helper

    return helper.make_node(
        OP_TYPE,
        list(inputs),
        list(outputs),
        name=name,
        domain=DOMAIN,
        operator=operator,
        overload_name=overload,
    )
