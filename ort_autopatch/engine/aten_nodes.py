"""Torch operators called from inside the graph without Python: ORT's `ATen` node.

ORT's training build runs `org.pytorch.aten::ATen` (attributes `operator`, `overload_name`) by
calling a registered C++ executor with DLPack tensors. The executor (`aten_executor.cpp`) finds
the operator in torch's dispatcher and calls it: about 15 us a node, against 0.1 to 0.2 ms for
a `PythonOp` (`torch_nodes`), whose round trip through Python, ctypes and autograd costs more than
the small gradient kernels it replaces. It has no autograd, so it serves nodes of the backward
pass, which ORT differentiated already (`gradient_nodes`).

The executor is compiled on first use with the machine's C++ compiler against the torch in the
running interpreter (about 15 s, once) and cached by the hash of its source, torch's version and
the compiler; concurrent processes (DDP ranks) wait for one build. Without a compiler, or with
no folder (the engine's `compile_executor=False`), `executor()` says why and the gradient nodes
go through Python instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

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


def default_folder() -> Path:
    """Where compiled executors are cached: the platform's per-user cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ort_autopatch"


def executor(folder: Path | None) -> str | None:
    """Make ORT's `ATen` nodes call torch in this process: None when they do, else why not.

    `folder` caches the compiled library; None means never compile (and so never call torch
    from an `ATen` node). The first failure is remembered: one build attempt per process.
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
            path = build(folder)
            library = ctypes.CDLL(str(path))
            from ort_autopatch.engine import runtime

            runtime.capi().register_aten_op_executor(
                str(_address(library.ort_autopatch_is_tensor_argument)),
                str(_address(library.ort_autopatch_execute)),
            )
        except Exception as exc:  # whatever stops it, training goes on through Python
            _failure = f"the ATen executor could not be built: {str(exc)[-600:]}"
            log.warning(
                "%s; torch-calling gradient nodes go through Python (slower; "
                "--no-compile-executor stops the attempt)",
                _failure,
            )
            return _failure
        _library, _registered = library, path
        log.debug("ATen executor: %s", path)
    return None


def _address(function: Any) -> int:
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


class BuildError(Exception):
    """The compiler is missing or refused the source."""


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else c++ or g++ on PATH."""
    wanted = os.environ.get("CXX")
    if wanted:
        return shutil.which(wanted)
    return shutil.which("c++") or shutil.which("g++")


def build(folder: Path) -> Path:
    """The compiled executor for this torch, built into `folder` unless already there."""
    cxx = compiler()
    if cxx is None:
        wanted = os.environ.get("CXX")
        if wanted:
            raise BuildError(f"$CXX ({wanted}) is not a compiler on PATH; set CXX to one")
        raise BuildError("no C++ compiler found (install g++, or set CXX to one)")
    command = _command(cxx)
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), torch.__version__, _version(cxx), *command]).encode()
    ).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"aten_executor-{key}.so"
    if target.exists():
        return target
    with _exclusive(folder / f"aten_executor-{key}.lock"):
        if target.exists():  # another process built it while this one waited
            return target
        log.info(
            "building the ATen executor for torch %s (once, ~15 s): %s", torch.__version__, target
        )
        fd, partial = tempfile.mkstemp(dir=folder, prefix=".aten_executor-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run(
                [*command, "-o", partial], capture_output=True, text=True, timeout=600
            )
            if done.returncode != 0:
                raise BuildError(f"{Path(cxx).name} failed: {done.stderr.strip()[-2000:]}")
            os.replace(partial, target)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(partial)
    return target


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


def _version(cxx: str) -> str:
    try:
        return subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One builder at a time across processes (others wait, then find the library)."""
    if sys.platform == "win32":  # pragma: no cover - ORT training runs on Linux here
        yield
        return
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
