"""Running Python and the launcher in subprocesses, with a clean, bounded environment."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable
LAUNCHER = (PY, "-m", "ort_autopatch")
#: A line of ONNX Runtime's C++ logger (`2026-01-01 00:00:00.0 [W:onnxruntime:, file.cc:1 f] ...`).
ORT_LOG_LINE = re.compile(r"^.*\[[VIWEF]:onnxruntime:.*$", re.M)
#: The tool's own word that a slow first build is still working (after 2 s: a loaded machine,
#: the plain backend's trace of forward and backward); a clean stderr may hold it.
PROGRESS_LINE = re.compile(r"^\[ort_autopatch\] WARNING .*: still building its .*\n?", re.M)


#: Graphs built by the calls that need them, which then run in ONNX Runtime (tests/conftest.py):
#: every environment a test makes from scratch takes it
FOREGROUND_BUILDS = {"ORT_AUTOPATCH_BACKGROUND_BUILDS": "0"}


def without_progress(stderr: str) -> str:
    """A run's stderr without the tool's progress lines."""
    return PROGRESS_LINE.sub("", stderr)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment minus our variables, with the repo importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ORT_AUTOPATCH", "ORTMODULE_"))
        and k not in ("PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONSAFEPATH")
    }
    env.update(PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE", PYTHONHASHSEED="0")
    env.update(FOREGROUND_BUILDS)
    env.update(extra or {})
    return env


def run(
    args: Sequence[str],
    cwd: os.PathLike[str] | str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(args),
        cwd=cwd,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    found = ORT_LOG_LINE.search(done.stderr or "")
    assert found is None, f"ONNX Runtime's C++ logger wrote to stderr: {found[0]}"
    return done


def run_side_by_side(
    commands: Sequence[Sequence[str]],
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
) -> list[subprocess.CompletedProcess[str]]:
    """`run` for independent processes started together: the waiting test process leaves the
    second core free, so two of them take the wall time of one."""
    started = [
        subprocess.Popen(
            list(args),
            env=clean_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    done = []
    try:
        for process in started:
            out, err = process.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    finally:
        for process in started:
            process.kill()
            process.wait()
    for finished in done:
        found = ORT_LOG_LINE.search(finished.stderr or "")
        assert found is None, f"ONNX Runtime's C++ logger wrote to stderr: {found[0]}"
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def torchrun() -> list[str]:
    """torchrun from this Python's environment."""
    script = pathlib.Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [PY, "-m", "torch.distributed.run"]


def rendezvous(nproc: int = 2) -> list[str]:
    """torchrun options for `nproc` local ranks on a free port."""
    port = str(free_port())
    return ["--nproc_per_node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", port]


def ended(pid: int, seconds: float = 10.0) -> bool:
    """Whether process `pid` is gone (or gone within `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
