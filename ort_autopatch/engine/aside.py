"""Building a graph in a forked child while its calls run in PyTorch (`background_builds`).

A plain-backend build costs seconds (aot_autograd's import and trace, the exporter's lowering,
the first-call check), and a short run paid them all before its first step: 30 steps of an
LSTM language model, a DCGAN or a char-level transformer took 1.6-2x as long through the tool
as without it. Here a call that misses forks a child that builds the graph exactly as this
process would (`Builder.build`: trace, lowering, sessions, the first-call check against eager)
and stores it; the call, and each call of that key until the child is done, runs in PyTorch
(`BuildingAside`, counted by the patcher). A later call finds the child done and loads the
graph from the store as a warm start does. So no step waits for a build: a run too short to
finish one is as fast as without the tool but for the child's CPU, and a longer one moves to
ONNX Runtime once its graph is checked.

The child stores into the user's persistent cache, or, without one, a private folder of this
process's (`handoff_store`, removed at exit). A child that fails, dies or hangs leaves the key
to be built in this process as without it (the same error, hazards and fallback as before;
the hazards and checks the child found are told here all the same), except a build over its
budget, which is refused as here. A graph the store cannot keep (torch-calling nodes of this
process's own) is built here too, once the child says so.

One child at a time per process (`_slot`): a second key that misses while one builds runs in
PyTorch until the child is done. No child where the fork is unsafe or useless (`refusal`):
another thread working (a lock it holds would stay held in the child, `sandbox`), CUDA or
torch.distributed initialised, a child of ours already. The child sets torch's thread count to
1 before any torch work (OpenMP's pool does not survive a fork: a parallel kernel there hangs),
makes no arena sessions, and writes to no stream of the user's.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ort_autopatch.engine import sandbox
from ort_autopatch.engine.errors import BuildOverBudget

if TYPE_CHECKING:
    from ort_autopatch.engine.hazards import Hazard
    from ort_autopatch.engine.recipe import BuildRecord
    from ort_autopatch.engine.store import GraphStore
    from ort_autopatch.engine.verify import Verification

log = logging.getLogger("ort_autopatch")

#: A child still building after this long is presumed stuck and killed; the key is then built
#: in this process (the child's own build budget stops a slow build well before).
TIMEOUT_SECONDS = 900.0


@dataclass
class Outcome:
    """What a child's build left: the store key its graph is under (None: none stored), what
    it told its listener, what it learned of sizes, and why it failed."""

    stored: str | None = None
    records: list[BuildRecord] = field(default_factory=list)
    verifications: list[Verification] = field(default_factory=list)
    hazards: list[Hazard] = field(default_factory=list)
    per_shape: bool = False
    cause: str = ""
    over_budget: BuildOverBudget | None = None  # refused for good, as it would be here
    failure: str = ""  # what else went wrong, for the debug log ("the helper ..."): built here


class Collected:
    """The child's listener: what it hears goes back to this process in the `Outcome`."""

    def __init__(self) -> None:
        self.records: list[BuildRecord] = []
        self.verifications: list[Verification] = []
        self.hazards: list[Hazard] = []

    def built(self, record: BuildRecord) -> None:
        self.records.append(record)

    def found(self, hazard: Hazard) -> None:
        self.hazards.append(hazard)

    def verified(self, verification: Verification) -> None:
        self.verifications.append(verification)


class Pending:
    """One child's build, polled by the calls of its key (`poll`)."""

    def __init__(self, child: sandbox.Child) -> None:
        self._child: sandbox.Child | None = child
        self._started = time.monotonic()
        self._owner = os.getpid()

    def ours(self) -> bool:
        """Whether this process forked the child (a data loader's worker forked from it
        inherits the object, not the child: its answer and its end are the parent's)."""
        return os.getpid() == self._owner

    def finished(self) -> bool:
        """Whether the child has answered (or is gone): it needs no core any more."""
        return self._child is None or self._child.answered()

    def poll(self) -> Outcome | None:
        """The child's outcome once it has one (a failed child's says so), else None."""
        child = self._child
        if child is None:
            return Outcome(failure="was given up")
        try:
            outcome = child.receive(0.0)
        except TimeoutError:
            if time.monotonic() - self._started < TIMEOUT_SECONDS:
                return None
            outcome = Outcome(failure=f"gave no answer in {TIMEOUT_SECONDS:.0f} s")
        except (sandbox.ChildError, EOFError, OSError) as exc:
            outcome = Outcome(failure=f"died ({exc})")
        self.close()
        if not isinstance(outcome, Outcome):
            outcome = Outcome(failure=f"answered {type(outcome).__name__}")
        return outcome

    def close(self, reap: bool = True) -> None:
        """End the child, done or not, and free the process's slot. `reap=False` starts no
        thread to reap it (a finalizer's close, which may run while the interpreter exits and
        a thread's start would wait forever): the process's own end reaps it."""
        child, self._child = self._child, None
        if child is not None and self.ours():
            child.close(reap)
        with _slot_lock:
            if _slot and _slot[0] is self:
                _slot.clear()

    def __del__(self) -> None:  # a module dropped while its graph was building
        try:
            self.close(reap=False)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


_slot_lock = threading.RLock()  # re-entered by `Pending.__del__` under `start`
_slot: list[Pending] = []  # the child building now, if any
_in_child: list[bool] = []  # this process is a build child


def _forget_slot() -> None:
    """In a forked process: the parent's child is not this one's, and our lock may have
    been held at the fork."""
    global _slot_lock
    _slot_lock = threading.RLock()
    _slot.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_slot)


def refusal(device: torch.device) -> str | None:
    """Why no child may build now (None: one may): the fork would be unsafe here, or the
    graph is for a device a child cannot touch."""
    if _in_child:
        return "this is a build child"
    if not sandbox.available():
        return "fork is not available here"
    if device.type != "cpu":
        return f"the graph is for {device.type}"
    if torch.cuda.is_initialized():
        return "CUDA is initialised (it does not survive a fork)"
    if sandbox.collective_possible():
        return "torch.distributed is initialised (ranks would train on different paths)"
    busy = sandbox.working_thread()
    if busy is not None:
        return f"thread {busy!r} is working"
    return None


def start(work: Callable[[], Outcome]) -> Pending | None:
    """A child running `work()` (whose `Outcome` `Pending.poll` returns), or None while
    another child builds (one at a time per process)."""
    with _slot_lock:
        if _slot and not _slot[0].finished():
            return None
        _slot.clear()  # a finished child's slot: its key's next call reads its answer

        def serve(receive: Callable[[], object], send: Callable[[object], None]) -> None:
            _in_child.append(True)
            torch.set_num_threads(1)  # before any torch work: OpenMP's pool did not survive
            send(work())

        child = sandbox.Child.spawn(serve)
        if child is None:
            return None
        pending = Pending(child)
        _slot.append(pending)
        return pending


_handoff: list[GraphStore] = []


def handoff_store() -> GraphStore | None:
    """This process's private store for graphs its children build (where the user keeps no
    persistent cache): a temporary folder, removed when this process exits."""
    from ort_autopatch.engine.store import GraphStore

    with _slot_lock:
        if not _handoff:
            root = Path(tempfile.mkdtemp(prefix="ort_autopatch-builds-"))
            owner = os.getpid()

            def remove() -> None:
                if os.getpid() != owner:  # a forked child that runs atexit handlers
                    return
                for pending in list(_slot):  # a child still writing there ends first
                    pending.close(reap=False)  # (no thread starts while Python exits)
                shutil.rmtree(root, ignore_errors=True)

            atexit.register(remove)
            _handoff.append(GraphStore(root))
        store = _handoff[0]
    return store if store.usable else None
