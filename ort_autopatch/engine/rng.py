"""The tool's own random stream: seeds for ONNX Runtime's random operators that never draw
from the user's generator, yet follow `torch.manual_seed`.

Eager PyTorch draws dropout masks from torch's default generator; ORT draws them from its own.
Seeding ORT by drawing from torch's generator (what ORTModule does) shifts every later
`torch.randint`/`randn` of the user's script, so batches sampled after a step, the initial
weights of a second model and text sampled after training all differ from a run without the
tool. Instead each seed is derived, without drawing, from the state of torch's default
generator and from how many seeds were taken since that state last changed (or since the last
`torch.manual_seed`, which a transparent wrapper reports: a reseed to the very state the stream
was in is otherwise invisible): the same script with the same `torch.manual_seed` gets the same
seeds, in one process or in two, and the user's stream stays exactly where eager leaves it.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from ort_autopatch.engine import random_ops, runtime

_lock = threading.Lock()
#: per stream ("run", "session", ...): the generator state last seen, seeds taken since
_position: dict[str, tuple[bytes, int]] = {}


def draws_per_run(model: Any) -> bool:
    """Whether a run of this model reads ORT's global generator (a `Dropout` given a
    `training_mode` input, at the top level or inside a local function), so each run must
    be seeded first."""
    return any(
        node.op_type in random_ops.ONNX_PER_RUN
        and (node.op_type != "Dropout" or len(node.input) >= 3)
        for node in random_ops.nodes(model)  # local functions' bodies too
    )


def next_seed(stream: str = "run") -> int:
    """A 63-bit seed; torch's default generator is read, never advanced.

    Streams are independent, so seeds taken for session starts (which happen on a cache miss
    only) do not shift the seeds of later runs.
    """
    _watch_manual_seed()
    state = torch.default_generator.get_state().numpy().tobytes()
    with _lock:
        last, taken = _position.get(stream, (b"", 0))
        if state != last:
            taken = 0
        _position[stream] = (state, taken + 1)
    data = state + stream.encode() + taken.to_bytes(8, "little")
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_runtime(capi: Any, stream: str = "run") -> None:
    """Seed ORT's global generator: before each run of a graph with dropout ("run"), and
    before a session starts ("session"), when other random kernels seed their own."""
    capi.set_seed(next_seed(stream))


def seed_runs(seed: int | None = None) -> int:
    """Seed ORT's generator before a run of a graph that draws (dropout): with the stream's
    next seed, or with `seed` to replay a run; the seed used. torch.manual_seed makes dropout
    reproducible, and the user's generator is never drawn from."""
    if seed is None:
        seed = next_seed()
    runtime.capi().set_seed(seed)
    return seed


def reset() -> None:
    """Start the stream over, as `torch.manual_seed` does for torch's."""
    with _lock:
        _position.clear()


def _watch_manual_seed() -> None:
    """Make `torch.manual_seed` (the one name scripts, Lightning and transformers call) also
    restart the tool's stream; it behaves as before in every other respect."""
    original: Callable[..., Any] = torch.manual_seed
    if getattr(original, "_ort_autopatch_reseeds", False):
        return

    @functools.wraps(original)
    def manual_seed(seed: int) -> Any:
        result = original(seed)
        reset()
        return result

    manual_seed._ort_autopatch_reseeds = True  # type: ignore[attr-defined]
    torch.manual_seed = manual_seed
    torch.random.manual_seed = manual_seed
