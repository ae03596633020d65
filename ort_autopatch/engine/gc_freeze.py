"""The process's objects kept out of the garbage collector's way while a graph builds.

A build allocates objects by the hundred thousand (fake tensors, FX nodes, the exporter's
IR), which sets off CPython's collections; once enough of them survive, a full collection
walks every object the process holds: torch's modules, the user's model and data. In a fresh
process with torch and aot_autograd imported (340,000 objects) one full collection took
0.15 s, a seventh of a TransformerEncoderLayer's first call on the plain backend; a script
holding its dataset as Python objects pays in proportion. Whether one lands inside the build
is a matter of the allocation history (a change to the decomposition table's making moved
one in, and the first call went from 0.95 to 1.15 s).

`frozen_heap` moves what the process held before the build into the collector's permanent
generation (`gc.freeze`) for the build's length, and back after (`gc.unfreeze`): the build's
collections walk only the build's own objects, and garbage among the older objects waits
for the first full collection after it. Builds of several threads share one freeze (the
first to start freezes, the last to end unfreezes). A process that froze objects itself
(a forking server, the tool's own children: `sandbox`) is left as it is, as is one whose
collector is off.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_builds = 0  # builds under way inside `frozen_heap`
_froze = False  # whether their freeze is ours to undo


def _forget() -> None:
    """In a forked child: the parent's builds are not its own, and another thread may have
    held the lock at the fork (the child froze its objects anyway: `sandbox`)."""
    global _lock, _builds, _froze
    _lock = threading.Lock()
    _builds = 0
    _froze = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The process's objects out of the collector's reach while the block runs."""
    global _builds, _froze
    with _lock:
        if _builds == 0 and gc.isenabled() and gc.get_freeze_count() == 0:
            gc.freeze()
            _froze = True
        _builds += 1
    try:
        yield
    finally:
        with _lock:
            _builds -= 1
            if _builds == 0 and _froze:
                _froze = False
                gc.unfreeze()
