"""Tensors into and out of ONNX Runtime without copies, for every backend.

`push` makes ORT's vector of a run's feeds: dense CPU tensors wrapped by address in one batch
on the inference build (`_by_address`), the others through DLPack (reusing `KeptValues` of the
module's tensors). `pull` makes the torch tensors of its fetches (DLPack), and `on_stream`
orders a run on CUDA after the caller's work. PyTorch calls a tensor contiguous whatever the
strides of its size-1 dims (and of an empty tensor); ORT's DLPack reader wants the canonical
ones (`dense_strides`): graph feeds here, and a torch-calling node's outputs
(`backends/ort_training/torch_in_graph/nodes.py`), use this rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy
import torch
from torch.utils.dlpack import to_dlpack

from ort_autopatch.engine import runtime


def dense_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of dense row-major storage of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its storage is dense row-major, else a dense copy."""
    if not t.is_contiguous():
        return t.contiguous()
    if (t.numel() == 0 or 1 in t.shape) and t.stride() != dense_strides(t.shape):
        return t.clone(memory_format=torch.contiguous_format)
    return t


class KeptValues:
    """ORT's views (OrtValues) of a graph's parameter and buffer feeds, kept from call to call.

    Wrapping a tensor for ORT (detach, DLPack capsule, ORT's value) costs about 2.5 us, which
    every parameter paid on every call. A kept value serves again only while the tensor fed
    now lies at the address it was made from with the same shape, strides and dtype: it then
    describes exactly that tensor's live memory, so in-place updates (an optimizer step) are
    read as they are, and `param.data = ...`, `set_` or a view with other strides gets a new
    value. Until then the old value holds the old tensor (its memory stays allocated).
    """

    __slots__ = ("positions", "values")

    def __init__(self, positions: Sequence[int]) -> None:
        self.positions = frozenset(positions)  # feed positions holding module tensors
        # position -> (address, shape, strides, dtype, value); read inline by `push`
        self.values: dict[int, tuple[int, torch.Size, tuple[int, ...], torch.dtype, Any]] = {}

    def keep(self, position: int, tensor: torch.Tensor, value: Any) -> None:
        if tensor.numel() > 0:  # an empty tensor's address says nothing
            self.values[position] = (
                tensor.data_ptr(),
                tensor.shape,
                tensor.stride(),
                tensor.dtype,
                value,
            )


_NOTHING_KEPT: dict[int, tuple[int, torch.Size, tuple[int, ...], torch.dtype, Any]] = {}

#: The training build's DLPack reader (1.19.2) predates kDLBool: bools travel as uint8 plus a
#: flag, in and out. The inference build's reads and writes them as they are and takes no flag
#: (`use_inference_dlpack`). One build per process, so one switch.
_BOOL_FLAG = True


def use_inference_dlpack() -> None:
    """Move bools as the installed build's DLPack calls want them, and CPU feeds by address
    where it can (the plain backend calls this before its first session)."""
    global _BOOL_FLAG, _CPU
    capi = runtime.capi()
    _BOOL_FLAG = hasattr(capi.OrtValueVector, "bool_tensor_indices")
    if not _BOOL_FLAG and hasattr(capi.OrtValueVector, "push_back_batch"):
        _CPU = capi.OrtDevice(capi.OrtDevice.cpu(), capi.OrtDevice.default_memory(), 0)


#: The inference build's CPU device, once `use_inference_dlpack` found its batch wrapper: CPU
#: feeds then go by address (`_by_address`). None: every feed goes through DLPack.
_CPU: Any = None

#: numpy's name of each dtype ORT's batch wrapper reads (it takes numpy's); the others
#: (bfloat16, complex) go through DLPack.
_NUMPY_TYPES: dict[torch.dtype, numpy.dtype[Any]] = {
    torch.float32: numpy.dtype(numpy.float32),
    torch.float64: numpy.dtype(numpy.float64),
    torch.float16: numpy.dtype(numpy.float16),
    torch.int64: numpy.dtype(numpy.int64),
    torch.int32: numpy.dtype(numpy.int32),
    torch.int16: numpy.dtype(numpy.int16),
    torch.int8: numpy.dtype(numpy.int8),
    torch.uint8: numpy.dtype(numpy.uint8),
    torch.bool: numpy.dtype(numpy.bool_),
}


def push(tensors: Sequence[torch.Tensor], kept: KeptValues | None = None) -> Any:
    """ORT's vector of the feeds. It runs on every call of every graph.

    The caller holds `tensors` until the run is over: feeds wrapped by address
    (`_by_address`) do not hold their memory themselves."""
    vector = runtime.capi().OrtValueVector()
    end = len(tensors)
    vector.reserve(end)
    if _CPU is None:
        _by_dlpack(vector, tensors, 0, end, kept)
        return vector
    start = 0
    while start < end:
        start = _by_address(vector, tensors, start)
        if start < end:  # one feed that cannot go by address; the rest too if off the CPU
            stop = start + 1 if tensors[start].is_cpu else end
            _by_dlpack(vector, tensors, start, stop, kept)
            start = stop
    return vector


def _by_address(vector: Any, tensors: Sequence[torch.Tensor], start: int) -> int:
    """Wrap the dense CPU tensors from `start` on into `vector` by address, in one call, up to
    the first other tensor: its position (`len(tensors)` when there is none).

    A DLPack capsule and ORT's value made from it cost about 2 us a tensor, a batch entry
    (address, shape, type) under 1 (a small CNN's step feeds 21 tensors). The entry does not
    own the memory: `push`'s caller holds the tensors through the run, and ORT copies an
    output that would alias a graph input (`test_run_plumbing`). Not by address: a tensor on
    another device, of a type numpy has no name for, not dense (its dense copy must be owned),
    empty (no address), or with a negation pending (`is_neg`: its memory holds the other
    sign)."""
    addresses: list[int] = []
    types: list[numpy.dtype[Any]] = []
    shapes: list[torch.Size] = []
    numpy_type = _NUMPY_TYPES.get
    stop, end = start, len(tensors)
    while stop < end:
        tensor = tensors[stop]
        kind = numpy_type(tensor.dtype)
        if kind is None or not tensor.is_cpu or not tensor.is_contiguous() or tensor.is_neg():
            break
        address = tensor.data_ptr()
        if not address:
            break
        addresses.append(address)
        types.append(kind)
        shapes.append(tensor.shape)
        stop += 1
    if addresses:
        vector.push_back_batch(
            tensors[start:stop], addresses, types, shapes, [_CPU] * len(addresses)
        )
    return stop


def _by_dlpack(
    vector: Any, tensors: Sequence[torch.Tensor], start: int, stop: int, kept: KeptValues | None
) -> None:
    """Push `tensors[start:stop]` as DLPack capsules, or as the kept values made from them.
    The kept values' check is inlined here, not a method per feed (about 2 us a call on a
    small model)."""
    push = vector.push_back
    values = kept.values if kept is not None else _NOTHING_KEPT
    for k in range(start, stop):
        tensor = tensors[k]
        held = values.get(k)
        if (
            held is not None
            and held[0] == tensor.data_ptr()
            and held[1] == tensor.shape
            and held[2] == tensor.stride()
            and held[3] is tensor.dtype
        ):
            push(held[4])
            continue
        keeper = kept if kept is not None and k in kept.positions else None
        t = tensor.detach()
        if not t.is_contiguous():
            t, keeper = t.contiguous(), None  # a copy: the next call makes its own
        elif (t.numel() == 0 or 1 in t.shape) and t.stride() != dense_strides(t.shape):
            # contiguous to PyTorch, not to ORT's DLPack reader (`dlpack.py`): inlined here
            t, keeper = t.clone(memory_format=torch.contiguous_format), None
        if _BOOL_FLAG:  # the training build (see `_BOOL_FLAG`)
            is_bool = t.dtype is torch.bool
            args: tuple[Any, ...] = (to_dlpack(t.view(torch.uint8) if is_bool else t), is_bool)
        else:
            args = (to_dlpack(t),)
        if keeper is None:
            push(*args)
            continue
        value = runtime.capi().OrtValue.from_dlpack(*args)
        keeper.keep(k, tensor, value)
        push(value)


_NO_STREAM = contextlib.nullcontext()


def on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Run ORT (and the graph's torch-calling nodes) on the session's CUDA stream, ordered after
    the caller's current stream's work and before its later work (`session.compute_stream`).
    Yields the caller's stream; on CPU (no stream) a shared do-nothing context yielding None,
    since every backward enters one."""
    return _NO_STREAM if stream is None else _on_cuda_stream(stream)


@contextlib.contextmanager
def _on_cuda_stream(stream: Any) -> Iterator[Any]:
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield caller
    finally:
        caller.wait_stream(stream)


def pull(vector: Any, caller: Any = None) -> list[torch.Tensor]:
    """Zero-copy tensors from an OrtValueVector; the training build's bools travel through
    DLPack as uint8.

    On CUDA, memory a torch-calling node allocated on the session's stream may come back as
    an output; `record_stream` keeps PyTorch's caching allocator from reusing it while the
    caller's stream still reads it (a no-op for ORT's own buffers)."""
    tensors: list[torch.Tensor] = vector.to_dlpacks(torch._C._from_dlpack)
    if _BOOL_FLAG:
        for k in vector.bool_tensor_indices():
            tensors[k] = tensors[k].to(torch.bool)
    if caller is not None:
        for tensor in tensors:
            tensor.record_stream(caller)
    return tensors
