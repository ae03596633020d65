"""What sharding wrappers mean for a patched call, without starting processes
(tests/test_fsdp2.py runs the real thing under torchrun)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import ort_autopatch
from ort_autopatch import distributed, report


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


NAME = f"{Block.__module__}:{Block.__qualname__}"


@pytest.fixture
def patched() -> Iterator[None]:
    ort_autopatch.patch(Block)
    try:
        yield
    finally:
        ort_autopatch.unpatch(Block)


def test_a_dynamic_subclass_made_by_torch_counts_for_the_selected_class(patched: None) -> None:
    """FSDP2's `fully_shard` swaps the instance to `FSDPBlock(FSDPModule, Block)`."""
    before = report.stats_for(NAME).ort_calls
    dynamic = type("FSDPBlock", (Block,), {"__module__": "torch.distributed.fsdp._fully_shard"})
    block = Block()
    block.__class__ = dynamic
    block(torch.randn(2, 4)).sum().backward()
    assert report.stats_for(NAME).ort_calls == before + 1
    assert report.stats_for("torch.distributed.fsdp._fully_shard:FSDPBlock").instances == 0


def test_parameters_flattened_by_fsdp1_run_eagerly_with_the_reason(patched: None) -> None:
    """FSDP1 needs an accelerator in torch 2.13, so its marks are set by hand here: parameters
    it flattened (`use_orig_params=True`) carry `_fsdp_flattened`."""
    import torch.distributed.fsdp

    block = Block()
    block.fc.weight._fsdp_flattened = True  # type: ignore[attr-defined]
    stats = report.stats_for(NAME)
    before = stats.eager_calls.copy()
    x = torch.randn(2, 4, requires_grad=True)
    out = block(x)
    out.sum().backward()
    torch.testing.assert_close(out, Block.forward(block, x))
    reasons = [r for r in stats.eager_calls if stats.eager_calls[r] != before.get(r, 0)]
    assert len(reasons) == 1 and reasons[0].startswith("FSDP1 (FullyShardedDataParallel)")
    assert "fully_shard" in reasons[0]


def test_without_fsdp_nothing_is_recomputed_or_refused() -> None:
    block = Block()
    assert not distributed.frees_parameters_after_forward(block)
    assert distributed.mixed_precision(block) is None
    assert distributed.sharded_submodules(block) == []
    assert distributed.fsdp1_reason(block) is None
