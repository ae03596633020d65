"""What a call of a patched module is, for every backend: its flat inputs (`CallSpec`), what
forward returned (`OutputSpec`, `BufferUpdates`), and the thread state that tells patched calls
to step aside while the engine runs forward itself (`EXPORT_LOCK`, `is_exporting`,
`untraced_run`, `preserved_state`).

Shared types at the bottom of the engine: the call key, the recipe, the entry and both
backends' captures name them, and none of them needs an exporter.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ort_autopatch.engine import objects, trees
from ort_autopatch.engine.errors import UnsupportedModelError

#: Held for the whole of every export: the process-wide rebindings above are undone in order.
EXPORT_LOCK = threading.RLock()
_state = threading.local()


def is_exporting() -> bool:
    """True while this thread runs an export started by the engine (patched calls step aside)."""
    return getattr(_state, "depth", 0) > 0


def in_untraced_run() -> bool:
    """True while this thread runs forward for the engine outside any trace (`untraced_run`)."""
    return getattr(_state, "untraced", 0) > 0


@contextlib.contextmanager
def untraced_run() -> Iterator[None]:
    """Forward runs in this thread for the engine but is no trace: the plain backend's check
    of a graph's first call against eager, `--verify`'s eager side. What it reads is no guard
    of any graph (the patcher learns guards from traces only): eager's own paths read more
    (TransformerEncoderLayer's fast-path checks in eval), and guarding those sent every
    training call after one eval call to a new build."""
    _state.untraced = getattr(_state, "untraced", 0) + 1
    try:
        yield
    finally:
        _state.untraced -= 1


@contextlib.contextmanager
def stepping_aside() -> Iterator[None]:
    """Patched calls in this thread run their original code (as during an export)."""
    with exporting():
        yield


@contextlib.contextmanager
def exporting() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


@dataclass
class CallSpec:
    """How to rebuild a call's (args, kwargs) from the flat tensors fed to the graph."""

    spec: pytree.TreeSpec
    leaves: list[Any]  # non-tensor leaves in place, None where a tensor goes
    tensor_positions: list[int]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(self.leaves)
        for pos, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[pos] = tensor
        args, kwargs = trees.unflatten(leaves, self.spec)
        return args, kwargs


@dataclass
class OutputSpec:
    """The structure of what forward returned, with its non-tensor leaves as constants.

    Leaves at `carriers` are objects holding tensors (objects.Carrier); their tensors follow
    the tensor leaves among the graph outputs.
    """

    spec: pytree.TreeSpec
    leaves: list[Any]
    tensor_positions: list[int]
    carriers: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, result: Any) -> tuple[OutputSpec, list[torch.Tensor]]:
        """The spec of what forward returned, and its tensors in graph-output order (the
        tensor leaves, then the tensors of each carrier)."""
        leaves, spec = trees.flatten(result)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        outputs = [leaves[i] for i in positions]
        carriers = []
        for i, leaf in enumerate(constants):
            found = objects.carrier_of(leaf)
            if found is not None:
                constants[i], carried = found
                outputs.extend(carried)
                carriers.append(i)
        return cls(spec, constants, positions, carriers), outputs

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        if self.spec.is_leaf() and self.tensor_positions and not self.carriers:
            return tensors[0]  # forward returned one tensor: no tree to rebuild
        leaves = list(self.leaves)
        count = len(self.tensor_positions)
        for pos, tensor in zip(self.tensor_positions, tensors[:count], strict=True):
            leaves[pos] = tensor
        if self.carriers:
            rest = iter(tensors[count:])
            for pos in self.carriers:
                leaves[pos] = leaves[pos].fill(rest)
        return trees.unflatten(leaves, self.spec)


@dataclass
class BufferUpdates:
    """What forward returned, and the new values of the buffers it updated in place (a
    running average, a step counter), by qualified name: the graph computes them like any
    output, and each call copies them into the buffers, as forward's in-place update would."""

    output: Any
    buffers: dict[str, torch.Tensor]


def buffer_versions(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Version counters of the buffers a trace may update in place (BatchNorm's statistics
    have their own outputs and update, `graph.batch_norm_statistics`)."""
    found = {}
    seen = set()
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            # a shared buffer goes by its first name, as in ModuleState
            if buffer is None or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            if not isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                found[f"{prefix}.{name}" if prefix else name] = (buffer, buffer._version)
    return found


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Restore buffers and every RNG state after running the module for an export.

    Tracing runs forward once: BatchNorm would take one extra step of running statistics and
    dropout would advance the generators. Parameters are checked rather than copied (an export
    never writes them unless forward mutates them in place, which is refused).
    """
    buffers = [(b, b._version, b.detach().clone()) for b in module.buffers()]
    versions = [(name, p, p._version) for name, p in module.named_parameters()]
    torch_rng = torch.random.get_rng_state()
    cuda_rng = (
        torch.cuda.get_rng_state_all()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    py_rng = random.getstate()
    np_random = sys.modules.get("numpy.random")
    np_rng = np_random.get_state() if np_random is not None else None
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, version, saved in buffers:
                # Only buffers the trace wrote (kernels such as batch_norm update running
                # stats without bumping the version, so values are compared too): a needless
                # copy_ would bump the version of a buffer an eager autograd graph saved,
                # breaking the user's pending backward.
                if buf.shape == saved.shape and (
                    buf._version != version or not torch.equal(buf, saved)
                ):
                    buf.copy_(saved)
        torch.random.set_rng_state(torch_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np_random is not None and np_rng is not None:
            np_random.set_state(np_rng)
    changed = [name for name, p, v in versions if p._version != v]
    if changed:
        raise UnsupportedModelError(
            type(module).__qualname__,
            f"forward modifies parameter(s) {', '.join(changed)} in place",
            "Such a module cannot be replayed from a graph; exclude it (ORT_AUTOPATCH_EXCLUDE)",
        )
