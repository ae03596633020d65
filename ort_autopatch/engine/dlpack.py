"""Tensors into and out of ONNX Runtime without copies (DLPack), for every backend.

`push` makes ORT's vector of a run's feeds (reusing `KeptValues` of the module's tensors),
`pull` the torch tensors of its fetches, and `on_stream` orders a run on CUDA after the caller's
work. PyTorch calls a tensor contiguous whatever the strides of its size-1 dims (and of an
empty tensor); ORT's reader wants the canonical ones (`dense_strides`): graph feeds here, and
a torch-calling node's outputs (`backends/ort_training/torch_in_graph/nodes.py`), use this rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

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
    """Move bools as the installed build's DLPack calls want them (the plain backend calls
    this before its first session)."""
    global _BOOL_FLAG
    _BOOL_FLAG = hasattr(runtime.capi().OrtValueVector, "bool_tensor_indices")


def push(tensors: Sequence[torch.Tensor], kept: KeptValues | None = None) -> Any:
    """ORT's vector of the feeds. It runs on every call of every graph: the kept values'
    check is inlined here, not a method per feed (about 2 us a call on a small model)."""
    vector = runtime.capi().OrtValueVector()
    vector.reserve(len(tensors))
    push = vector.push_back
    values = kept.values if kept is not None else _NOTHING_KEPT
    for k, tensor in enumerate(tensors):
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
    return vector


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
