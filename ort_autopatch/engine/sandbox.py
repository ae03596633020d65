"""Running a step that may abort the process (ONNX Runtime's gradient builder asserts on some
graphs) in a forked child, where an abort costs a fallback instead of the user's training run."""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

#: A child still running after this long is presumed stuck (a lock held by another thread at
#: fork time) and killed; the step then runs in this process.
TIMEOUT_SECONDS = 600.0
#: The same where another thread was working at the fork (`working_thread`), when a lock it
#: held may stay held in the child: a gradient graph takes seconds to build, and a stall of
#: `TIMEOUT_SECONDS` in the user's run is worse than building here after a minute.
RISKY_TIMEOUT_SECONDS = 60.0


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


def collective_possible() -> bool:
    """Whether a module's forward may take part in a collective (torch.distributed is
    initialised: SyncBatchNorm's all-reduce). A child running that forward would make it on
    this process's connections, inside the other ranks' exchange: no child runs a forward
    then."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and bool(dist.is_available() and dist.is_initialized())


#: `autograd_forkable` has run in this process (a forked child inherits it)
_autograd_started = False


def autograd_forkable() -> None:
    """Start autograd's engine on the CPU, once per process, before a trace runs a backward on
    fake tensors (aot_autograd's joint trace). A process's first backward decides once
    whether the engine starts device threads, and a first backward on fake tensors starts
    them where a real one on CPU tensors does not: 8 threads on a machine without a GPU,
    with torch 2.14's and 2.15's PyPI wheels (CUDA builds; 2.13's CPU build starts none).
    From then on no forked child may run a backward (torch's "Unable to handle autograd's
    threading in combination with fork-based multiprocessing"): not the first-call check's
    eager child, nor the user's own (a Hogwild trainer's), which without the tool would
    have come after the user's first backward, on real tensors. Started here on one real
    CPU tensor, the engine starts as the user's own backward would have started it."""
    global _autograd_started
    if _autograd_started:
        return
    import torch

    try:
        with torch.enable_grad():
            torch.zeros((), requires_grad=True).backward()
    except RuntimeError:  # a child forked after the threads started: its trace says so
        pass
    # set once the backward is done: a thread that finds it set traces after it (two
    # threads' first traces at once may both run it, which costs nothing)
    _autograd_started = True


#: Threads of this package's own (progress, reaping, the kept child's timer): none holds a
#: lock the child takes.
OWN_THREADS = "ort_autopatch-"
#: `threading`'s functions a thread at rest waits in: `Condition.wait` and `Thread.join`'s
_AT_REST = ("wait", "_wait_for_tstate_lock")


def working_thread() -> str | None:
    """The name of a thread of this process, other than the calling one, that may hold a lock
    the child would need, or None when all are at rest: ours, or blocked in `threading`'s
    `Condition.wait` (an `Event`, a `queue.Queue`, a timer: tqdm's monitor, a data loader's
    queue) or `Thread.join`, which take no lock while they wait. A thread anywhere else
    (running, or waiting on a lock, an import, a kernel) may hold one: no fork then."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    if not others:
        return None
    # where each thread is, as names only: the frames themselves (this one's among them) kept
    # in a local would make a cycle holding the caller's frames and their tensors until the
    # cyclic collector runs (a training step's inputs, 192 MB over eight steps without it)
    frames = sys._current_frames()
    try:
        where = {ident: (f.f_code.co_filename, f.f_code.co_name) for ident, f in frames.items()}
    finally:
        del frames
    for thread in others:
        if thread.name.startswith(OWN_THREADS) or thread.ident is None:
            continue
        place = where.get(thread.ident)
        if place is None:  # ended since it was listed
            continue
        if place[0] == threading.__file__ and place[1] in _AT_REST:
            continue
        return thread.name
    return None


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in this process (a lookup in the child could wait on the
    dynamic loader's lock, held at the fork by another thread); None off Linux's glibc."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1
_prctl_function = _prctl() if available() else None


def _die_with_parent(parent: int) -> None:
    """In the child: be killed when the parent ends. A child stuck for good (on a lock held at
    the fork) would otherwise outlive a parent that exits, holding the pipes it inherited
    (a test runner's output, a CI job's) open. The signal comes when the forking thread
    ends: a child forked from a thread other than the main one ends with that thread."""
    if _prctl_function is not None:
        _prctl_function(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the call
        os._exit(1)


#: The memory of a parent's tensors a child lets go of (`shared_pages`): smaller ones cost
#: the parent few copies, and keep no whole page of their own.
SHARED_MIN_BYTES = 1 << 20


def shared_pages(tensors: Iterable[Any]) -> list[tuple[int, int]]:
    """(start, length) of the whole pages inside each CPU tensor's storage (one entry per
    storage, `SHARED_MIN_BYTES` or more), for `let_go` in a child forked after this.

    A forked child shares this process's memory copy-on-write: while the child lives, the
    first write here to each page it shares copies that page, with a TLB shootdown on every
    core this process runs on. A training step writes every parameter: BERT-base's first
    AdamW step took 3.0 s with the lowering child alive against 0.9 s after it had exited
    (110,000 pages of parameters). Whole pages only: the allocator's own bookkeeping lies in
    the partial pages at an allocation's ends, which the child keeps."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    found: dict[int, int] = {}
    for tensor in tensors:
        try:
            if tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
        except Exception:  # a tensor subclass without storage of its own (fake, sharded)
            continue
        start = -(-address // page) * page
        end = (address + size) // page * page
        if address and end - start >= SHARED_MIN_BYTES:
            found[start] = max(found.get(start, 0), end - start)
    return sorted(found.items())


def let_go(pages: Iterable[tuple[int, int]]) -> None:
    """In a forked child, drop its mapping of `pages` (`shared_pages` of the parent's tensors,
    whose data the child never reads again): the parent's pages are then its own again, and
    its writes copy nothing. The child reads zeros there from now on. Linux only (elsewhere
    `MADV_DONTNEED` may only advise); a failure leaves the pages shared, as before."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import mmap

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for start, length in pages:
        madvise(start, length, mmap.MADV_DONTNEED)


def _fork() -> int:
    """`os.fork`, with this process's objects never collected in the child: a finalizer run
    there (an ONNX Runtime session's, whose thread pool's threads did not survive the fork)
    would wait for those threads forever. The collector is off across the fork, so it cannot
    run in the child before the objects are frozen."""
    parent = os.getpid()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings():
            # Python 3.12 warns of forking with threads running (the child may find a lock
            # held forever); children are written for that, and the parent's waits time out.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            gc.freeze()
            _die_with_parent(parent)
    finally:
        if enabled:
            gc.enable()
    return pid


def run(
    step: Callable[[], T],
    meanwhile: Callable[[], None] | None = None,
    while_waiting: Callable[[], bool] | None = None,
) -> T:
    """`step()` in a forked child; its result comes back pickled.

    `meanwhile()` runs here while the child works (the second core is otherwise idle while this
    process waits): first-use work the caller needs next. Then `while_waiting()` is called
    again and again, each call a small piece of work, for as long as it returns True and the
    child has not answered (work worth doing only where it costs no waiting, so never without
    a child). An exception of either is raised once the child is reaped. Raises
    `Crashed` when the child dies from a signal, `ChildError` when `step` raised there. Falls
    back to running `step` here when forking is not possible or the child hangs (sooner where
    another thread was working at the fork: `RISKY_TIMEOUT_SECONDS`).
    """
    if not available():
        if meanwhile is not None:
            meanwhile()
        return step()
    busy = working_thread()
    timeout = TIMEOUT_SECONDS if busy is None else RISKY_TIMEOUT_SECONDS
    result_read, result_write = os.pipe()
    error_read, error_write = os.pipe()
    pid = _fork()
    if pid == 0:  # the child: never returns
        _child(step, result_read, result_write, error_read, error_write)
    os.close(result_write)
    os.close(error_write)
    try:
        try:
            if meanwhile is not None:
                meanwhile()
            if while_waiting is not None:
                while not _answered(result_read, error_read) and while_waiting():
                    pass
        finally:
            payload, stderr_text, status = _collect(pid, result_read, error_read, timeout)
    finally:
        os.close(result_read)
        os.close(error_read)
    return _result((payload, stderr_text, status), step)


def _answered(*fds: int) -> bool:
    """Whether the child wrote (or closed) either pipe: its result, or its end."""
    ready, _, _ = select.select(list(fds), [], [], 0)
    return bool(ready)


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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


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
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        _write_all(result_write, len(data).to_bytes(8, "little") + data)
        # The parent reads to EOF: close now, not at exit (`_collect`).
        for fd in (result_write, error_write, 2):
            os.close(fd)
    except BaseException:
        code = 1
    finally:
        os._exit(code)  # no atexit handlers, no flushing of the parent's buffers


def _collect(
    pid: int, result_read: int, error_read: int, timeout: float
) -> tuple[bytes, str, int | None]:
    """Read both pipes until the child closes them, then reap it; None status if it hung
    (no end within `timeout` seconds).

    A child whose whole result arrived has nothing left to do but exit, and its exit first
    unmaps its share of this process's memory (10-15 ms for a process holding torch): it is
    reaped by a background thread then, and its status given as a normal exit.
    """
    chunks: list[bytes] = []
    errors: list[bytes] = []
    open_fds = {result_read: chunks, error_read: errors}
    deadline = time.monotonic() + timeout
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
    received = b"".join(chunks)
    stderr_text = b"".join(errors).decode(errors="replace")
    size = int.from_bytes(received[:8], "little")
    if len(received) >= 8 and len(received) == 8 + size:
        if os.waitpid(pid, os.WNOHANG)[0] == 0:
            threading.Thread(
                target=_reap, args=(pid,), name="ort_autopatch-reap", daemon=True
            ).start()
        return received[8:], stderr_text, 0
    _, status = os.waitpid(pid, 0)
    return b"", stderr_text, status


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped already (a SIGCHLD handler of the user's)
        pass


class Child:
    """A forked child that serves requests: started early (its own first-use work, such as
    imports, overlaps this process's), given work later, one pickled message at a time in
    each direction. `serve(receive, send)` runs in the child; the child exits when it
    returns, raises, or this process closes it."""

    def __init__(self, pid: int, to_child: int, from_child: int) -> None:
        self.pid = pid
        self._to_child = to_child
        self._from_child = from_child
        self._reader = _Reader(from_child)
        self._closed = False

    @classmethod
    def spawn(
        cls, serve: Callable[[Callable[[], Any], Callable[[Any], None]], None]
    ) -> Child | None:
        """A child running `serve`; None where forking is not available."""
        if not available():
            return None
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        pid = _fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.close(request_write)
                os.close(reply_read)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)  # its warnings and prints are not the user's
                os.dup2(null, 2)
                faulthandler.disable()
                reader = _Reader(request_read)

                def send(value: Any) -> None:
                    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                    _write_all(reply_write, len(data).to_bytes(8, "little") + data)

                try:
                    serve(reader.receive, send)
                except BaseException as exc:  # the parent learns of it, then does the work
                    send(_Failed(exc))
            except BaseException:
                code = 1
            finally:
                os._exit(code)  # no atexit handlers, no flushing of the parent's buffers
        os.close(request_read)
        os.close(reply_write)
        os.set_blocking(request_write, False)  # `send` writes what the pipe takes
        return cls(pid, request_write, reply_read)

    def send(self, value: Any, timeout: float | None = None) -> None:
        """Pickle `value` to the child (raises OSError if it is gone, EOFError if it closed
        its end, TimeoutError if it took in nothing for `timeout` seconds). What the child
        writes meanwhile is read into the buffer `receive` reads from: a child answering an
        earlier request with more than a pipe holds, while this process sends the next,
        would wait on this process while this process waits on it (a BERT's graphs, sent one
        by one, hung so)."""
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(len(data).to_bytes(8, "little") + data)
        while view:
            readable, writable, _ = select.select([self._from_child], [self._to_child], [], timeout)
            if not readable and not writable:
                raise TimeoutError("the child took in nothing in time")
            if readable:
                self._reader.take()
            if writable:
                try:
                    view = view[os.write(self._to_child, view) :]
                except BlockingIOError:  # (select's promise is a page; the rest waits)
                    continue

    def receive(self, timeout: float) -> Any:
        """The child's next message; `ChildError` when it raised, `TimeoutError` when none
        came in time, EOFError when it is gone."""
        value = self._reader.receive(timeout)
        if isinstance(value, _Failed):
            raise ChildError(f"{value.type_name}: {value.message}")
        return value

    def answered(self) -> bool:
        """Whether a message (or the child's end) is there to be read, without waiting."""
        return bool(self._reader.buffer) or _answered(self._from_child)

    def close(self, reap: bool = True) -> None:
        """End the child (if still running) and reap it in the background: its exit unmaps
        its share of this process's memory, which need not be waited for (`reap=False`: not
        reaped, a zombie until this process ends)."""
        if self._closed:  # its descriptors' numbers may belong to other files by now
            return
        self._closed = True
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not reap:
            return
        threading.Thread(
            target=_reap, args=(self.pid,), name="ort_autopatch-reap", daemon=True
        ).start()


class _Reader:
    """Length-prefixed pickles from a pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def take(self) -> None:
        """Read what the pipe holds now (waiting for something, unless select said so)."""
        data = os.read(self.fd, 1 << 20)
        if not data:
            raise EOFError("the child is gone")
        self.buffer += data

    def receive(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.buffer) < 8 or len(self.buffer) < 8 + int.from_bytes(
            self.buffer[:8], "little"
        ):
            if deadline is not None:
                left = max(deadline - time.monotonic(), 0.0)  # 0: what has arrived only
                if not select.select([self.fd], [], [], left)[0]:
                    raise TimeoutError("no message from the child in time")
            self.take()
        size = int.from_bytes(self.buffer[:8], "little")
        data, self.buffer = self.buffer[8 : 8 + size], self.buffer[8 + size :]
        return pickle.loads(data)
