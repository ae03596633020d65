"""Export-time rewrites: code the TorchScript tracer cannot follow, swapped (only while the
engine exports) for code that computes the same values in a traceable way.

Each rewrite is a named context manager; `export_rewrites()` enters them all. A rewrite is
faithful (same values, same gradients), so a thread that runs the swapped code eagerly while
another thread exports still gets right results; only checkpointing's memory saving is skipped
for that moment.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

_MISSING = object()


@contextlib.contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set `owner.name = value` and put back exactly what was there (or nothing).

    Not safe against another thread swapping the same attribute (restores could interleave):
    callers run inside an export, which holds `calls.EXPORT_LOCK`."""
    # a class's own __dict__ only: an inherited attribute must stay inherited afterwards
    before = (
        owner.__dict__.get(name, _MISSING)
        if isinstance(owner, type)
        else getattr(owner, name, _MISSING)
    )
    setattr(owner, name, value)
    try:
        yield
    finally:
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)


def broadcast_for_bhqkv(mask_function: Callable[..., Any], bh_indices: bool = True) -> Any:
    """transformers' `_vmap_for_bhqkv` without vmap: the mask function sees index tensors
    shaped to broadcast against each other ([B,1,1,1], [1,H,1,1], [1,1,Q,1], [1,1,1,KV]).

    Mask functions are elementwise in their indices (comparisons, `mask[b, kv]` lookups), so
    broadcasting gives vmap's result; the tracer fails inside vmap (`unordered_map::at`).
    """

    def broadcast(
        batch_idx: Any, head_idx: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        if bh_indices:
            b = batch_idx.reshape(-1, 1, 1, 1)
            h = head_idx.reshape(1, -1, 1, 1)
            q = q_idx.reshape(1, 1, -1, 1)
            kv = kv_idx.reshape(1, 1, 1, -1)
            shape: tuple[int, ...] = (b.shape[0], h.shape[1], q.shape[2], kv.shape[3])
        else:
            b, h = batch_idx, head_idx
            q = q_idx.reshape(-1, 1)
            kv = kv_idx.reshape(1, -1)
            shape = (q.shape[0], kv.shape[1])
        return mask_function(b, h, q, kv).expand(shape)

    return broadcast


@contextlib.contextmanager
def broadcast_mask_functions() -> Iterator[None]:
    """transformers' mask builders (masking_utils) broadcast instead of vmapping.

    `TransformGetItemToIndex` turns indexing by scalar tensors into a custom op the exporter
    has no symbolic for; with broadcast index tensors plain indexing is right, so it is
    switched off too. Nothing happens unless transformers' masking_utils is already imported.
    """
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "_vmap_for_bhqkv"):
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(masking, "_vmap_for_bhqkv", broadcast_for_bhqkv))
        if hasattr(masking, "TransformGetItemToIndex"):
            stack.enter_context(
                _swapped(masking, "TransformGetItemToIndex", contextlib.nullcontext)
            )
        yield


def _run_checkpointed(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
    return function(*args)


@contextlib.contextmanager
def checkpoint_through_function() -> Iterator[None]:
    """Reentrant gradient checkpointing exports the checkpointed function itself.

    `CheckpointFunction` (torch.utils.checkpoint with use_reentrant=True, transformers'
    default) is an autograd.Function the tracer cannot enter; its forward is the wrapped
    function under no_grad, which is what the export runs anyway. ORT keeps its own
    activations, so recomputation has no meaning inside the graph.
    """
    from torch.utils import checkpoint

    with _swapped(checkpoint.CheckpointFunction, "apply", staticmethod(_run_checkpointed)):
        yield


@contextlib.contextmanager
def attention_without_fast_path() -> Iterator[None]:
    """`nn.MultiheadAttention` and `nn.TransformerEncoderLayer` take their ordinary path.

    In eval mode under no_grad (and every export runs under no_grad) they call fused
    kernels, `aten::_native_multi_head_attention` and `aten::_transformer_encoder_layer_fwd`,
    which have no ONNX symbolic (vit's eval call fell back); their ordinary path is the same
    attention in operators ONNX Runtime runs. torch's own switch for it is process-wide:
    eager calls in other threads meanwhile take the ordinary path too, with the same values.
    """
    from torch.backends import mha

    enabled = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(enabled)


#: Every rewrite, by name, in the order they are entered.
REWRITES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "broadcast_mask_functions": broadcast_mask_functions,
    "checkpoint_through_function": checkpoint_through_function,
    "attention_without_fast_path": attention_without_fast_path,
}


@contextlib.contextmanager
def export_rewrites() -> Iterator[None]:
    """Enter every rewrite for the duration of one export."""
    with contextlib.ExitStack() as stack:
        for rewrite in REWRITES.values():
            stack.enter_context(rewrite())
        yield
