"""Heap pages for the process's first training step, faulted in while the gradient child builds.

A first training step writes its activations into memory the process never touched: a
TransformerEncoderLayer's (d256, x(16,64,256)) first ORT forward took 8,800 page faults and
its backward 3,900, where later steps take none; that was 15-20 ms of its first call. glibc
serves such buffers from fresh `mmap`s until a large one has been freed (its dynamic mmap
threshold), and gives the top of its heap back to the system at every `free` past its trim
threshold, so nothing the process did before is reused. While the forked child builds the
gradient graph (`sandbox.run`), this process would only wait; `FirstStepPages` spends that
wait faulting in heap pages the step then reuses: one `free` of a chunk just under glibc's
largest dynamic threshold (32 MiB) raises the mmap threshold to it and the trim threshold to
twice that, as any program's first `free` of such a tensor does; then chunks of 2 MiB are
allocated, populated in one call each (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14: 29 MiB in
1.5-7 ms at load 3-7, where writing 48 MiB with memset took 70-90 ms) and freed into the
heap's top, which stays (where `engine.heap.keep_freed_memory` set the thresholds already,
the first `free` changes nothing and the chunks stay all the same). Their contents are never
read: only where memory comes from changes, not what any step computes. Done once per
process, only with glibc (another allocator keeps its own rules) and only for as long as the
child is still building.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from types import TracebackType
from typing import Any

from ort_autopatch.engine.heap import glibc

#: Freed, this raises glibc's mmap threshold to its size (below DEFAULT_MMAP_THRESHOLD_MAX,
#: 32 MiB on 64-bit systems, beyond which a free leaves the threshold alone) and its trim
#: threshold to twice that: the heap's top keeps up to 62 MiB of freed pages.
RAISE_BYTES = 31 << 20
CHUNK_BYTES = 2 << 20  # about 1 ms each: the child's answer waits at most that long
#: At most this much is faulted in (a transformer layer's first step wrote about 52 MiB);
#: freed, it stays below the trim threshold RAISE_BYTES sets.
LIMIT_BYTES = 56 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in for writing, in one call
_PAGE = mmap.PAGESIZE

_lock = threading.Lock()
_used = False  # once per process: later steps find the heap the first step left


def _glibc() -> Any:
    """The C library's malloc, free and madvise when they are glibc's, else None."""
    libc = glibc()
    if libc is None:
        return None
    try:
        malloc, free, madvise = libc.malloc, libc.free, libc.madvise
    except AttributeError:
        return None
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    madvise.restype, madvise.argtypes = (
        ctypes.c_int,
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
    )
    return malloc, free, madvise


class FirstStepPages:
    """`with FirstStepPages() as pages:` then `pages.more()` while waiting: each call writes one
    more chunk and says whether there is more to do; leaving the block frees them all."""

    def __init__(self, limit: int = LIMIT_BYTES) -> None:
        self._limit = limit
        self._chunks: list[int] = []
        self._calls: Any = None

    def __enter__(self) -> FirstStepPages:
        global _used
        with _lock:
            if _used:
                return self
            _used = True
        self._calls = _glibc()
        if self._calls is not None:
            malloc, free, _ = self._calls
            free(malloc(RAISE_BYTES))
        return self

    def more(self) -> bool:
        if self._calls is None or len(self._chunks) * CHUNK_BYTES >= self._limit:
            return False
        malloc, _, madvise = self._calls
        chunk = malloc(CHUNK_BYTES)
        if not chunk:
            return False
        self._chunks.append(chunk)
        start = -(-chunk // _PAGE) * _PAGE  # the whole pages inside the chunk
        length = (chunk + CHUNK_BYTES - start) // _PAGE * _PAGE
        if madvise(start, length, _MADV_POPULATE_WRITE) != 0:  # an older kernel: write them
            ctypes.memset(chunk, 0, CHUNK_BYTES)
        return True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._calls is not None:
            free = self._calls[1]
            while self._chunks:  # last first: each joins the heap's free top
                free(self._chunks.pop())
