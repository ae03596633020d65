"""The process's heap keeps what a step frees for the next step, and PyTorch and ONNX Runtime
share it.

Why: a training step frees most of what it allocates (activations, a backward's temporaries),
then allocates the same sizes again. glibc gives a freed block of more than its mmap threshold
back to the system, and the top of its heap once more than its trim threshold is free there,
so the next step faults every such page in again (ResNet-50, batch 2: 67,000 page faults and
about 70 ms of a 600 ms step). Its thresholds adapt to the largest block freed, up to 32 MiB
and 64 MiB, which a step's 130 MiB of backward temporaries still exceeds.

ONNX Runtime's own arena (`session.shared_arena`) removed those faults but kept a second heap:
memory ORT's buffers freed stayed in the arena while PyTorch's optimizer step allocated from
glibc, and ORT could not reuse what PyTorch freed. Peak RSS of a step (torch 2.14, 2 threads,
batch 2, the ORT arena against this): ResNet-50 1825 -> 1577 MB and BERT-base MLM 3884 -> 3256
MB on the plain backend, ResNet-50 1405 -> 1339 MB on the training build, steps no slower;
eager's are 1330 and 2850 MB.

So where the C library is glibc, `keep_freed_memory` sets its mmap threshold to the largest it
allows (32 MiB, the ceiling its own adaptation reaches) and its trim threshold to 1 GiB, once
per process: freed blocks up to 32 MiB stay in the heap, for ORT's next step and PyTorch's
alike. This is less than the ORT arena kept (all of it, for the process's lifetime), and is
what `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` would say; a user who set either
(or glibc's tunables for them) keeps their own settings. Setting either threshold ends glibc's
adaptation of both, which is why both are set.

Blocks of more than 32 MiB are still mapped apart and faulted in afresh: a GPT-2 small step's
150 MiB embedding gradient and 50 MiB logits took up to 450,000 faults, and its step ran 14 %
slower than from the ORT arena, which kept them. So while a graph built for one input shape
runs (`WHOLE_HEAP`, around its session's runs), glibc maps no block apart (`M_MMAP_MAX` 0):
ORT's large buffers come from the heap too, and as that graph asks for the same sizes every
step, the next run finds them there. So does every optimizer step, whose temporaries are the
parameters' sizes (`_optimizer_steps_inside`). Outside such runs large blocks are mapped as glibc
always does: the whole process served from the heap, 64 MiB inputs of varying size grew RSS by
1.4 GiB in eight steps, as no freed block fit the next one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from typing import Any

log = logging.getLogger("ort_autopatch")

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
#: glibc's own limit on blocks mapped apart, restored after `WHOLE_HEAP`
DEFAULT_MMAP_MAX = 65536
#: the largest mmap threshold glibc accepts on 64-bit systems (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD = 32 << 20
#: free memory at the heap's top beyond this goes back to the system
TRIM_THRESHOLD = 1 << 30
#: environment variables and tunables with which a user sets the same thresholds
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
USER_TUNABLES = (
    "glibc.malloc.mmap_max",
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.trim_threshold",
)

_lock = threading.Lock()
_kept: bool | None = None
_mallopt: Any = None  # glibc's mallopt, once `keep_freed_memory` set the thresholds
_depth = 0  # runs inside `WHOLE_HEAP` (threads may overlap)


def glibc() -> Any:
    """The C library when it is glibc (a `ctypes.CDLL`), else None: other C libraries keep
    their own rules, and glibc's calls mean nothing there."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        return ctypes.CDLL(None)
    except (AttributeError, OSError, ValueError):
        return None


def user_settings() -> str | None:
    """The user's own setting of glibc's thresholds, if any (named as they set it)."""
    for name in USER_SETTINGS:
        if name in os.environ:
            return name
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return next((t for t in USER_TUNABLES if t in tunables), None)


def keep_freed_memory() -> bool:
    """Whether the process's heap keeps a step's freed buffers (see the module's docstring);
    the first call sets glibc's thresholds. False where the C library is not glibc: sessions
    then allocate from ORT's shared arena instead (`session.shared_arena`). True, and nothing
    changed, where the user set the thresholds: their heap, their rule."""
    global _kept
    with _lock:
        if _kept is None:
            _kept = _set_thresholds()
        return _kept


def run_scope() -> contextlib.AbstractContextManager[Any]:
    """What a graph built for one input shape runs inside: `WHOLE_HEAP` where this module set
    glibc's thresholds (`keep_freed_memory`, called first), else a no-op."""
    return WHOLE_HEAP if keep_freed_memory() and _mallopt is not None else NO_SCOPE


class _WholeHeap:
    """`with WHOLE_HEAP:` glibc maps no block apart until the last thread inside leaves."""

    def __enter__(self) -> None:
        global _depth
        with _lock:
            _depth += 1
            if _depth == 1:
                _mallopt(M_MMAP_MAX, 0)

    def __exit__(self, *exc: object) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0:
                _mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)


WHOLE_HEAP = _WholeHeap()
NO_SCOPE = contextlib.nullcontext()

_optimizing = threading.local()  # whether this thread's optimizer step is inside WHOLE_HEAP


def _optimizer_step_begins(*args: object) -> None:
    if not getattr(_optimizing, "inside", False):  # a step that raised never left: stay once
        WHOLE_HEAP.__enter__()
        _optimizing.inside = True


def _optimizer_step_ends(*args: object) -> None:
    if getattr(_optimizing, "inside", False):
        _optimizing.inside = False
        WHOLE_HEAP.__exit__()


def _optimizer_steps_inside() -> None:
    """Every optimizer step runs inside `WHOLE_HEAP` too (torch's global step hooks). Its
    temporaries are the parameters' sizes, the same every step, and glibc mapped those of more
    than 32 MiB afresh whenever no free block of the heap fitted them: AdamW's for GPT-2
    small's 147 MiB embedding took 37,700 page faults every step once backward left no such
    block free. Inside, they come from the heap and stay there for the next step."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(_optimizer_step_begins)
    register_optimizer_step_post_hook(_optimizer_step_ends)


def _set_thresholds() -> bool:
    global _mallopt
    libc = glibc()
    if libc is None:
        return False
    own = user_settings()
    if own is not None:
        log.debug("glibc's heap thresholds left as %s sets them", own)
        return True
    try:
        mallopt = libc.mallopt
    except AttributeError:
        return False
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    # mmap first: were the trim threshold set and the other refused, glibc would stop adapting
    # its mmap threshold at 128 KiB and map every larger block afresh
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return False
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return False
    _mallopt = mallopt
    _optimizer_steps_inside()
    log.debug("glibc's heap keeps freed blocks up to 32 MiB and 1 GiB at its top")
    return True


def release_freed() -> None:
    """Give the free pages inside glibc's heap back to the system (`malloc_trim`), after a
    build: its trace, lowering and check free hundreds of MB in blocks scattered among what
    stays, which no threshold returns, and a step's buffers then fit the holes badly; peak
    RSS of ResNet-50's steps after its first call (plain backend) 1742 -> 1577 MB. The pages
    a step then asks for are faulted in once more."""
    libc = glibc()
    if libc is None:
        return
    try:
        trim = libc.malloc_trim
    except AttributeError:
        return
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
    trim(0)
