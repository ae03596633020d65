"""Compiling the ATen executor into the cache: one compiler run per library, whoever asks.

Standard library only, so that it also runs as a script (`python -I -S aten_build.py ...`): the
engine starts it in the background from the first CPU training graph that wants the executor,
and that graph (and every one built until the library exists) runs the slower path instead of
waiting. The lock file makes concurrent processes (DDP ranks, the test suite's session start)
share one compiler run; the compiler writes a temporary file renamed over the library only when
it is complete, so no process ever loads half a library; a failure leaves a `.failed` note with
the compiler's message, so later processes say why instead of compiling again.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path


class BuildError(Exception):
    """The compiler is missing or refused the source."""


def lock_path(target: Path) -> Path:
    return target.with_suffix(".lock")


def failure_path(target: Path) -> Path:
    return target.with_suffix(".failed")


@contextlib.contextmanager
def exclusive(path: Path, wait: bool) -> Iterator[bool]:
    """Hold `path`'s lock (True), or yield False at once when another process holds it and
    `wait` is off."""
    if sys.platform == "win32":  # pragma: no cover - ORT training runs on Linux here
        yield True
        return
    import fcntl

    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def building(target: Path) -> bool:
    """Whether some process is compiling `target` now (it holds the lock)."""
    with exclusive(lock_path(target), wait=False) as free:
        return not free


def compile_to(command: Sequence[str], target: Path, wait: bool) -> bool:
    """Run `command` (a compiler line without `-o`) into `target` unless it exists; False when
    another process is compiling it and `wait` is off. Raises BuildError when it fails."""
    with exclusive(lock_path(target), wait) as held:
        if not held:
            return False
        if target.exists():  # another process built it while this one waited
            return True
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".aten_executor-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run(
                [*command, "-o", partial], capture_output=True, text=True, timeout=600
            )
            if done.returncode != 0:
                name = Path(command[0]).name
                raise BuildError(f"{name} failed: {done.stderr.strip()[-2000:]}")
            os.replace(partial, target)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(partial)
    with contextlib.suppress(OSError):
        failure_path(target).unlink()
    return True


def main(argv: Sequence[str]) -> int:
    """`aten_build.py TARGET COMPILER ARGS...`: the background build (niced, so the training
    it runs beside keeps the CPU); a failure is written beside the target."""
    target, command = Path(argv[0]), list(argv[1:])
    with contextlib.suppress(OSError):
        os.nice(10)
    try:
        compile_to(command, target, wait=False)
    except (BuildError, OSError, subprocess.SubprocessError) as exc:
        note = failure_path(target)
        partial = note.with_name(f".{note.name}.{os.getpid()}")
        partial.write_text(str(exc))
        os.replace(partial, note)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
