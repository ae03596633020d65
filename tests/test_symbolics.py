"""Export-time symbolics: right numbers in ORT, and present only during the engine's exports."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.onnx._internal.torchscript_exporter import registration

from ort_autopatch.engine import ModuleEngine
from ort_autopatch.engine.backends.ort_training import symbolics
from tests.helpers import assert_training_parity


class Attention(nn.Module):
    """Self-attention with a caller-given mask (bool or float) and optional GQA."""

    def __init__(self, heads: int = 4, kv_heads: int = 4, dim: int = 8) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = nn.Linear(16, heads * dim)
        self.kv = nn.Linear(16, 2 * kv_heads * dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4).unbind(0)
        gqa = self.kv_heads != self.heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _left_padded_mask(dtype: torch.dtype) -> torch.Tensor:
    """[2, 1, 6, 6] causal mask; row 0 is left padded by 2, so its first 2 rows see nothing."""
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :2] = False
    allowed = torch.ones(6, 6, dtype=torch.bool).tril() & keep[:, None, None, :]
    if dtype is torch.bool:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=["bool", "float"])
def test_fully_masked_rows_give_zeros_and_finite_gradients_like_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    mask = _left_padded_mask(dtype)
    run = assert_training_parity(
        Attention(), lambda step: ((torch.randn(2, 6, 16, requires_grad=True), mask), {}), steps=3
    )
    for p in run.engine_model.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()


def test_grouped_query_attention_repeats_kv_heads_like_eager() -> None:
    torch.manual_seed(0)
    assert_training_parity(
        Attention(heads=4, kv_heads=2),
        lambda step: ((torch.randn(2, 5 + step, 16),), {}),
        steps=3,
        expect_builds=2,  # the first length's, then one for every length
    )


class Packed(nn.Module):
    """transformers' packed-sequence detection: torch.diff and a boolean cumsum."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        first = position_ids[:, :1] - 1
        starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
        sequence = starts.cumsum(-1)
        return self.emb(sequence) * torch.diff(position_ids.float(), n=2, dim=-1).sum()


def test_diff_and_boolean_cumsum_match_eager() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 0, 1]])
    run = assert_training_parity(Packed(), lambda step: ((positions,), {}), steps=2)
    out = run.engine(positions)
    assert out.dtype == torch.float32


def _custom_overrides(opset: int) -> dict[str, object]:
    found: dict[str, object] = {}
    for name in symbolics.SYMBOLICS:
        group = registration.registry.get_function_group(name)
        if group is not None and group._functions.overridden(opset):
            found[name] = group._functions[opset]
    return found


def test_symbolics_are_registered_only_while_the_engine_exports() -> None:
    before = _custom_overrides(17)
    ModuleEngine(Attention(heads=4, kv_heads=2))(torch.randn(1, 3, 16))
    assert _custom_overrides(17) == before
    # The user's own export still gets torch's stock symbolic, which refuses enable_gqa.
    with pytest.raises(Exception, match="enable_gqa"):
        torch.onnx.export(
            Attention(heads=4, kv_heads=2),
            (torch.randn(1, 3, 16),),
            io.BytesIO(),  # type: ignore[arg-type]  # BytesIO is accepted at run time
            dynamo=False,
        )


def test_a_users_own_override_survives_our_export() -> None:
    def users_diff(g: object, *args: object) -> object:
        raise NotImplementedError

    torch.onnx.register_custom_op_symbolic("aten::diff", users_diff, 17)
    try:
        with symbolics.registered(17):
            assert _custom_overrides(17)["aten::diff"] is symbolics.diff
        assert _custom_overrides(17)["aten::diff"] is users_diff
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::diff", 17)
