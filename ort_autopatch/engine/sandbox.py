"""Running a step that may abort the process (ONNX Runtime's gradient builder asserts on some
graphs) in a forked child, where an abort costs a fallback instead of the user's training run."""

from __future__ import annotations

import faulthandler
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: A child still running after this long is presumed stuck (a lock held by another thread at
#: fork time) and killed; the step then runs in this process.
TIMEOUT_SECONDS = 600.0


class Crashed(Exception):
    """The child died: `signal_name` says how, `detail` is the last line it wrote to stderr."""

    def __init__(self, signal_name: str, detail: str) -> None:
        self.signal_name = signal_name
        self.detail = detail
        super().__init__(f"{signal_name}: {detail}" if detail else signal_name)


class _Failed:
    """An exception raised in the child, carried back as its type name and message."""

    def __init__(self, exc: BaseException) -> None:
        self.type_name = type(exc).__name__
        self.message = str(exc)


class ChildError(Exception):
    """The step raised in the child; the message is the child's."""


def available() -> bool:
    """fork exists and is safe enough here (Linux; macOS frameworks break after fork)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def run(
    step: Callable[[], T],
    meanwhile: Callable[[], None] | None = None,
    child: Prestarted | None = None,
) -> T:
    """`step()` in a forked child (`child`, when one was prestarted); its result comes back
    pickled.

    `meanwhile()` runs here while the child works (the second core is otherwise idle while this
    process waits): first-use work the caller needs next. Its exception, if any, is raised once
    the child is reaped. Raises `Crashed` when the child dies from a signal, `ChildError` when
    `step` raised there. Falls back to running `step` here when forking is not possible or the
    child hangs.
    """
    if child is not None:
        return child.run(step, meanwhile)
    if not available():
        if meanwhile is not None:
            meanwhile()
        return step()
    result_read, result_write = os.pipe()
    error_read, error_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(step, result_read, result_write, error_read, error_write)
    os.close(result_write)
    os.close(error_write)
    try:
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            payload, stderr_text, status = _collect(pid, result_read, error_read)
    finally:
        os.close(result_read)
        os.close(error_read)
    return _result((payload, stderr_text, status), step)


def _result(outcome: tuple[bytes, str, int | None], step: Callable[[], T]) -> T:
    """What a reaped child's pipes and status say: its value, or the matching exception."""
    payload, stderr_text, status = outcome
    if status is None:
        return step()  # stuck child, killed: this process builds after all
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        lines = [line.strip() for line in stderr_text.splitlines() if line.strip()]
        raise Crashed(name, lines[-1][-300:] if lines else "")
    value: Any = pickle.loads(payload) if payload else _Failed(RuntimeError(stderr_text[-300:]))
    if isinstance(value, _Failed):
        raise ChildError(f"{value.type_name}: {value.message}")
    result: T = value
    return result


class Prestarted:
    """A forked child that ran its setup ahead and waits for its one step (`prestart`)."""

    def __init__(self, pid: int, task_write: int, result_read: int, error_read: int) -> None:
        self._pid = pid
        self._task_write = task_write
        self._result_read = result_read
        self._error_read = error_read
        self._done = False

    def run(self, step: Callable[[], T], meanwhile: Callable[[], None] | None = None) -> T:
        """`step()` in the child, as `run` does it (`step` is pickled: a module-level function
        or a `functools.partial` of one); callable once."""
        self._done = True
        try:
            try:
                data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
                _write_all(self._task_write, len(data).to_bytes(8, "little") + data)
            except BrokenPipeError:
                pass  # the child died in its setup: its status says how
            os.close(self._task_write)
            try:
                if meanwhile is not None:
                    meanwhile()
            finally:
                outcome = _collect(self._pid, self._result_read, self._error_read)
        finally:
            self._close()
        return _result(outcome, step)

    def cancel(self) -> None:
        """Kill the child unless its task ran; the task is never run then."""
        if self._done:
            return
        self._done = True
        os.kill(self._pid, signal.SIGKILL)
        os.waitpid(self._pid, 0)
        os.close(self._task_write)
        self._close()

    def _close(self) -> None:
        os.close(self._result_read)
        os.close(self._error_read)


def prestart(prepare: Callable[[], Any]) -> Prestarted | None:
    """Fork now a child that runs `prepare()` (a first import, say) while this process goes on,
    then waits for the step `Prestarted.run` sends and runs it as `run` would. None where
    forking is not available. An exception of `prepare` is left for the step to meet again."""
    if not available():
        return None
    task_read, task_write = os.pipe()
    result_read, result_write = os.pipe()
    error_read, error_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(task_write)

        def step() -> Any:
            try:
                prepare()
            except Exception:  # the step meets it again, with its reason
                pass
            # Sized, not read to EOF: a process forked meanwhile (a DataLoader worker) holds
            # the pipe's write end too.
            size = int.from_bytes(_read_exactly(task_read, 8), "little")
            sent: Callable[[], Any] = pickle.loads(_read_exactly(task_read, size))
            return sent()

        _child(step, result_read, result_write, error_read, error_write)
    os.close(task_read)
    os.close(result_write)
    os.close(error_write)
    return Prestarted(pid, task_write, result_read, error_read)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        data = os.read(fd, min(size, 1 << 20))
        if not data:
            os._exit(0)  # the parent closed the pipe without a task
        chunks.append(data)
        size -= len(data)
    return b"".join(chunks)


def _child(
    step: Callable[[], Any], result_read: int, result_write: int, error_read: int, error_write: int
) -> None:
    code = 0
    try:
        os.close(result_read)
        os.close(error_read)
        os.dup2(error_write, 2)  # assertion messages come back as the crash's detail
        faulthandler.disable()  # its dump of a crash would go to the user's stderr
        try:
            value: Any = step()
        except BaseException as exc:  # everything goes back to the parent
            value = _Failed(exc)
        _write_all(result_write, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException:
        code = 1
    finally:
        os._exit(code)  # no atexit handlers, no flushing of the parent's buffers


def _collect(pid: int, result_read: int, error_read: int) -> tuple[bytes, str, int | None]:
    """Read both pipes until the child closes them, then reap it; None status if it hung."""
    chunks: list[bytes] = []
    errors: list[bytes] = []
    open_fds = {result_read: chunks, error_read: errors}
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return b"", "", None
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            data = os.read(fd, 1 << 20)
            if data:
                open_fds[fd].append(data)
            else:
                del open_fds[fd]
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks), b"".join(errors).decode(errors="replace"), status
