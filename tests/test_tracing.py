"""Export-time rewrites: faithful to the code they replace, and gone after the export."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import checkpoint
from transformers import masking_utils as masking

from ort_autopatch.engine import ModuleEngine, tracing
from tests.helpers import assert_training_parity


def _mask_functions() -> dict[str, Callable[..., Any]]:
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 0]], dtype=torch.bool)
    packed = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])
    causal = masking.causal_mask_function
    return {
        "causal": causal,
        "causal+padding": masking.and_masks(causal, masking.padding_mask_function(padding)),
        "sliding window": masking.sliding_window_causal_mask_function(3),
        "packed": masking.and_masks(causal, masking.packed_sequence_mask_function(packed)),
    }


@pytest.mark.parametrize("name", list(_mask_functions()))
def test_broadcast_mask_equals_transformers_vmap(name: str) -> None:
    function = _mask_functions()[name]
    indices = (torch.arange(2), torch.arange(1), torch.arange(6), torch.arange(6))
    with masking.TransformGetItemToIndex():
        expected = masking._vmap_for_bhqkv(function)(*indices)
    actual = tracing.broadcast_for_bhqkv(function)(*indices)
    assert actual.shape == expected.shape == (2, 1, 6, 6)
    assert torch.equal(actual, expected)


def test_broadcast_mask_over_query_and_key_only_equals_vmap() -> None:
    """transformers' path for torch < 2.6: no batch or head index."""
    function = masking.sliding_window_causal_mask_function(3)
    q, kv = torch.arange(5), torch.arange(7)
    expected = masking._vmap_for_bhqkv(function, bh_indices=False)(None, None, q, kv)
    actual = tracing.broadcast_for_bhqkv(function, bh_indices=False)(None, None, q, kv)
    assert torch.equal(actual, expected)


class MaskedAttention(nn.Module):
    """A causal mask built by transformers' sdpa_mask from a 2D padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        mask = masking.sdpa_mask(
            batch_size=b,
            cache_position=torch.arange(s),
            kv_length=s,
            attention_mask=attention_mask.bool(),
            allow_is_causal_skip=False,
        )
        h = self.proj(x).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(h, h, h, attn_mask=mask)


def test_vmap_built_masks_export_and_train_like_eager() -> None:
    torch.manual_seed(0)
    padding = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert_training_parity(
        MaskedAttention(), lambda step: ((torch.randn(2, 5, 8), padding), {}), steps=2
    )
    assert masking._vmap_for_bhqkv.__module__ == masking.__name__  # put back after the export


class Checkpointed(nn.Module):
    """Two blocks under torch's reentrant checkpointing, as transformers enables it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.GELU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint.checkpoint(block, x, use_reentrant=True)
        return x


def test_reentrant_checkpointing_exports_the_wrapped_function() -> None:
    torch.manual_seed(0)
    run = assert_training_parity(
        Checkpointed(), lambda step: ((torch.randn(3, 6, requires_grad=True),), {}), steps=3
    )
    assert run.engine.builds == 1
    assert "apply" not in checkpoint.CheckpointFunction.__dict__  # inherited again


def test_rewrites_are_undone_even_when_the_export_fails() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    with pytest.raises(Exception, match="boom"):
        ModuleEngine(Broken())(torch.randn(2))
    assert "apply" not in checkpoint.CheckpointFunction.__dict__
    assert masking.TransformGetItemToIndex.__module__.startswith("torch")
