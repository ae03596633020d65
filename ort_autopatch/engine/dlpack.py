"""Tensors as ONNX Runtime's DLPack reader takes them: dense row-major strides.

PyTorch calls a tensor contiguous whatever the strides of its size-1 dims (and of an empty
tensor); ORT's reader wants the canonical ones. Both directions that hand torch tensors to ORT
(`bridge` for graph feeds, `torch_in_graph.nodes` for a torch-calling node's outputs) use this rule.
"""

from __future__ import annotations

import torch


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
