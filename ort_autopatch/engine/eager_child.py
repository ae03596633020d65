"""The first-call check's eager runs, made in a forked child while this process builds.

A plain-backend graph is trusted once its first call matched eager's (`verify`): the call
runs through the graph and eagerly, each with a backward. Made after the build, eager's run
was a fifth of a cold first call (BERT-base, batch 2: 1.3 s of 11), on a machine whose second
core had idled through much of the trace: aot_autograd traces on one core, and the lowering
child (`offload`) is done importing long before the trace is. So where a backend says a core
is spare (`Progress.core_free`), the builder forks a child that makes eager's runs there
(`verify.eager_side`), from the module and call as the call found them, while this process
traces; the check asks for them after the graph's own run (`verify.Made`). The child makes
the plain run, then the first seed's run of eager's spread, which the check needs where the
strict comparison fails (BatchNorm's models: ResNet-50 on every first call): a run made for
nothing costs a core that was idle.

What it gives is what the check would have made here, on one thread instead of the
process's (a forked child must not enter OpenMP's pool): another eager, as a run on another
thread count is. It is used only where it can stand in for the run here:
- the state it ran from is the state the check runs from (`fresh`: every parameter, buffer
  and input tensor the same object and storage, unwritten since, a buffer of the same
  values: a build in a thread while the user trained on would not be);
- the run is done, or past its forward, when the check asks: a child still in a forward then
  is closed, and eager runs here on every thread (waiting for a child on one thread would
  cost more than it saves: a large batch, whose run outlasts the trace); one past its
  forward is waited for as long as its backward should take (`WAIT_RATIO`). It goes on
  while the graph runs for the check, on every core: stopped then (SIGSTOP), it left the
  check waiting longer for its runs than its lowest priority cost the graph's (the check
  took 1.54-1.67 s going on against 1.71-1.87 s stopped on BERT-base, 0.65-0.74 against
  0.68-0.80 s on ResNet-50, fresh processes alternated);
- its outputs and gradients cross in shared memory (a memfd the child fills and this
  process maps): BERT-base's gradients are 440 MB, which a pipe would copy three times.

The child runs at the lowest priority (`_lowest_priority`): on a machine with no core to
spare it takes only what the trace and the lowering leave. It is forked only where a fork is safe
(`sandbox.working_thread`), for CPU calls, never where torch.distributed is initialised
(`sandbox.collective_possible`), and where the machine's free memory holds another copy of
the module's tensors and their gradients (`_fits`). Everything else, and any failure of the
child, means eager's runs are made here, as without the child.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ort_autopatch.engine import calls, sandbox, verify

if TYPE_CHECKING:
    from ort_autopatch.engine.recipe import Miss

log = logging.getLogger("ort_autopatch")

#: The child's `os.nice` increment where Linux's idle scheduling class is missing.
NICENESS = 10
#: How long this process waits for a child past its forward: this many times the CPU time
#: its forward took (a backward takes about twice a forward's), and at least `WAIT_SECONDS`.
#: A child starved on a busy machine (it runs only on idle CPU) or stuck on a lock held at
#: the fork is closed then, and eager's run is made here.
WAIT_RATIO = 4.0
WAIT_SECONDS = 1.0
#: The free memory (MemAvailable) a child needs, in multiples of the module's and the call's
#: tensor bytes: its gradients and their copy in shared memory, twice (the plain run's and
#: the spread's), the spread's nudged parameters, and its activations.
MEMORY_FACTOR = 6
#: Each tensor's offset in the shared memory is a multiple of this (any dtype's alignment).
ALIGN = 64

#: The seed of the spread's run the child makes after its plain run (`verify.NUDGE_SEEDS`'s
#: first: the one that covers a graph where any does, on ResNet-50).
SEED = verify.NUDGE_SEEDS[0]

#: what the child says once the forward of a run has run (with the CPU seconds it took)
_FORWARD_DONE = "forward done"

#: (offset, shape, dtype) of a tensor in the shared memory, or None for a missing gradient
_Place = tuple[int, tuple[int, ...], torch.dtype] | None


class EagerChild:
    """A child making one call's eager runs for the first-call check (see the module's
    docstring; `verify.Made`): `start` forks it, `side` and `nudged` give its runs to the
    check, `close` ends it."""

    def __init__(self, child: sandbox.Child, memory: int, miss: Miss, state: _State) -> None:
        self._child = child
        self._memory = memory  # the memfd the child fills
        self.miss = miss
        self._state = state  # what the child ran from
        self._forward_done = False  # the child is past the forward of the run it makes now
        self._closed = False

    @classmethod
    def start(cls, miss: Miss, forward: Callable[..., Any]) -> EagerChild | None:
        """A child making `miss`'s eager runs (`forward(module, *args, **kwargs)`, a training
        call's backward included); None where none may be forked (see the module's
        docstring)."""
        tensors = _tensors(miss)
        if not sandbox.available() or sandbox.collective_possible():
            return None
        if any(t.device.type != "cpu" for t in tensors) or torch.cuda.is_initialized():
            return None  # (CUDA does not survive a fork: a forward touching it would hang)
        busy = sandbox.working_thread()
        if busy is not None:
            log.debug("eager child: not forked while thread %r works", busy)
            return None
        try:
            if not _fits(tensors):
                return None
            state = _State(miss)
        except Exception as exc:  # a tensor subclass without storage of its own (sharded)
            log.debug("eager child: not forked (%s: %s)", type(exc).__name__, exc)
            return None
        trainable = verify.trainable_of(miss.state, miss.has_backward)
        try:
            memory = os.memfd_create("ort_autopatch-eager")
        except (OSError, AttributeError):  # no memfd here (an old kernel, a seccomp filter)
            return None

        def serve(receive: Callable[[], Any], send: Callable[[Any], None]) -> None:
            _serve(send, memory, miss, forward, trainable)

        try:
            child = sandbox.Child.spawn(serve)
        except OSError:
            child = None
        if child is None:
            os.close(memory)
            return None
        return cls(child, memory, miss, state)

    def fresh(self) -> bool:
        """Whether the state the child ran from is the state the call has now: every tensor
        the same, unwritten since (closed when not)."""
        try:
            holds = not self._closed and self._state.holds(self.miss)
        except Exception:  # (a tensor added since, or one without storage)
            holds = False
        if not holds:
            self.close()
        return holds

    def side(self) -> verify.Side | None:
        """The child's plain eager run (`verify.Made.side`)."""
        return self._next(None)

    def nudged(self, seed: int) -> verify.Side | None:
        """The child's run for the first seed's spread (`verify.Made.nudged`); None for
        another seed."""
        return self._next(seed) if seed == SEED else None

    def _next(self, seed: int | None) -> verify.Side | None:
        """The child's next run, where it is done or past its forward; None (the child
        closed) where it is not, failed, or was closed."""
        if self._closed:
            return None
        deadline = time.monotonic()
        try:
            while True:
                if not self._forward_done and not self._child.answered():
                    log.debug("eager child: still in a forward; eager runs here")
                    break
                message = self._child.receive(max(deadline - time.monotonic(), 0.0))
                if message[0] == _FORWARD_DONE:
                    self._forward_done = True
                    deadline = time.monotonic() + max(WAIT_SECONDS, WAIT_RATIO * message[1])
                    continue
                self._forward_done = False
                made_seed, *written = message
                if made_seed != seed:
                    raise ValueError(f"the child made seed {made_seed}'s run, not {seed}'s")
                return _read(self._memory, written)
        except (sandbox.ChildError, TimeoutError, EOFError, OSError, ValueError) as exc:
            log.debug("eager child: no run (%s); eager runs here", exc)
        self.close()
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._child.close()
        os.close(self._memory)


def _tensors(miss: Miss) -> list[torch.Tensor]:
    """The tensors eager's side reads: the module's parameters and buffers, and the call's."""
    return [*miss.state.tensors, *miss.call.tensors]


class _State:
    """The state a child runs from: each tensor's identity and storage, a parameter's and an
    input's version, a buffer's values. A buffer is compared by value: a trace writes
    BatchNorm's statistics and puts them back (`calls.preserved_state`, the count run made
    here), which moves the versions and leaves the values."""

    def __init__(self, miss: Miss) -> None:
        self.where = _where(miss)
        self.versions = [t._version for t in _versioned(miss)]
        self.buffers = [b.detach().clone() for b in _buffers(miss)]

    def holds(self, miss: Miss) -> bool:
        """Whether `miss`'s tensors are still those, unwritten (buffers: of those values)."""
        return (
            _where(miss) == self.where
            and [t._version for t in _versioned(miss)] == self.versions
            and all(
                torch.equal(b, saved) for b, saved in zip(_buffers(miss), self.buffers, strict=True)
            )
        )


def _where(miss: Miss) -> list[tuple[int, int]]:
    return [(id(t), t.data_ptr()) for t in _tensors(miss)]


def _versioned(miss: Miss) -> list[torch.Tensor]:
    """The parameters and the call's tensors."""
    return [*miss.state.params, *miss.call.tensors]


def _buffers(miss: Miss) -> list[torch.Tensor]:
    return [
        t for t, param in zip(miss.state.tensors, miss.state.is_param, strict=True) if not param
    ]


def _fits(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the machine's free memory holds what the child allocates (`MEMORY_FACTOR`)."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 >= MEMORY_FACTOR * size
    except (OSError, ValueError, IndexError):
        pass
    return False


def _serve(
    send: Callable[[Any], None],
    memory: int,
    miss: Miss,
    forward: Callable[..., Any],
    trainable: Sequence[torch.Tensor],
) -> None:
    """The child: eager's plain run of `miss`, then its run for `SEED`'s spread (the check
    asks for it where the plain comparison fails: BatchNorm's models), each written to
    `memory` after the last, with its places sent."""
    # one thread: ATen's parallel loops run inline, never entering an OpenMP region, whose
    # thread pool (libgomp's) does not survive a fork
    torch.set_num_threads(1)
    _lowest_priority()
    calls.EXPORT_LOCK = threading.RLock()  # maybe held at the fork by another thread
    end = 0
    for seed in (None, SEED):
        outputs, gradients = verify.eager_side(
            miss.module,
            miss.call,
            forward,
            trainable,
            miss.has_backward,
            forward_done=functools.partial(_forward_done, send, time.process_time()),
            seed=seed,
        )
        written = _write(memory, end, [*outputs, *gradients], len(outputs))
        del outputs, gradients
        send((seed, *written))
        end = written[0] + written[1]


def _forward_done(send: Callable[[Any], None], start: float) -> None:
    send((_FORWARD_DONE, time.process_time() - start))


def _lowest_priority() -> None:
    """This process runs only on CPU time nobody else wants: Linux's idle scheduling class
    (a niced child still slowed ResNet-50's trace, 3.79 s against 3.62 s at SCHED_IDLE,
    medians of 6), niced as well where the class is missing."""
    os.nice(NICENESS)
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def _write(
    memory: int, start: int, tensors: Sequence[torch.Tensor | None], outputs: int
) -> tuple[int, int, int, list[_Place]]:
    """`tensors` copied into the memfd `memory` from `start` on (a multiple of the page
    size): (`start`, the size written rounded to pages, how many are outputs, each one's
    place)."""
    places: list[_Place] = []
    size = 0
    for t in tensors:
        if t is None:
            places.append(None)
            continue
        places.append((size, tuple(t.shape), t.dtype))
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    size = -(-size // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
    if size:
        os.ftruncate(memory, start + size)
        mapped = mmap.mmap(memory, size, offset=start)  # unmapped as the child exits
        for t, place in zip(tensors, places, strict=True):
            if t is not None and place is not None and t.numel():
                _view(mapped, place).copy_(t)
    return start, size, outputs, places


def _read(memory: int, written: list[Any]) -> verify.Side:
    """A run of the child's from what it sent (`_write`'s) and the memfd it filled: views
    of the shared memory, which lives as long as they do."""
    start, size, outputs, places = written
    mapped = mmap.mmap(memory, size, offset=start) if size else None
    tensors: list[torch.Tensor | None] = []
    for place in places:
        if place is None:
            tensors.append(None)
        elif mapped is None or _numel(place[1]) == 0:
            tensors.append(torch.empty(place[1], dtype=place[2]))
        else:
            tensors.append(_view(mapped, place))
    found = [t for t in tensors[:outputs] if t is not None]
    if len(found) != outputs:
        raise ValueError("an output is missing from the child's run")
    return found, tensors[outputs:]


def _view(mapped: mmap.mmap, place: _Place) -> torch.Tensor:
    assert place is not None
    offset, shape, dtype = place
    return torch.frombuffer(mapped, dtype=dtype, count=_numel(shape), offset=offset).view(shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
