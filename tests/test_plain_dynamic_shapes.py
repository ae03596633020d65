"""The plain backend's graphs with symbolic sizes: one graph for the batch sizes and sequence
lengths a model allows, a graph only for calls its size guards admit, call by call against
eager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from ort_autopatch.engine import ModuleEngine
from ort_autopatch.engine.recipe import EngineOptions
from ort_autopatch.engine.sizes import SizeGuards
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)

PLAIN = EngineOptions(backend="ort", threads=1)


def _train_side_by_side(
    make: Callable[[], nn.Module],
    inputs: Sequence[torch.Tensor],
    options: EngineOptions = PLAIN,
    engine: ModuleEngine | None = None,
) -> ModuleEngine:
    """SGD steps of the model through the engine and eagerly, compared at every call:
    outputs, every parameter's gradient, the input's gradient and the buffers."""
    model, eager = make(), make()
    engine = engine or ModuleEngine(model, options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.05)
    for step, x in enumerate(inputs):
        x, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = engine(x), eager(x_eager)
        assert ran_in_plain_ort(out), f"call {step} (shape {tuple(x.shape)}) ran elsewhere"
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        cotangent = torch.randn_like(expected)
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        out.backward(cotangent)
        expected.backward(cotangent)
        torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        for a, b in zip(model.buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        optimizer.step()
        eager_optimizer.step()
    return engine


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _encoder_layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)


def _batch_norm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)
    )


class Branchy(nn.Module):
    """Takes another layer for batches above 4: a graph must never serve the other side."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.large = nn.Linear(6, 3)
        self.small = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            return self.large(x)
        return self.small(x) * 2


def test_an_mlp_with_a_new_batch_size_every_call_needs_two_graphs() -> None:
    batches = [torch.randn(n, 6) for n in (8, 5, 11, 3, 7, 16)]
    engine = _train_side_by_side(_mlp, batches)
    assert engine.builds == 2  # the first call's shape, then every batch size
    assert [r.dynamic for r in engine.records] == [False, True]
    assert engine.records[1].reason == "size guard failed: inputs[0].shape[0] == 8"


def test_a_transformer_layer_with_new_batch_and_length_every_call_needs_two_graphs() -> None:
    sizes = [(4, 6), (3, 9), (5, 4), (2, 7), (6, 5)]
    engine = _train_side_by_side(_encoder_layer, [torch.randn(b, s, 16) for b, s in sizes])
    assert engine.builds == 2
    assert [r.dynamic for r in engine.records] == [False, True]


def test_a_branch_on_the_batch_size_gets_a_graph_per_side_and_never_the_wrong_one() -> None:
    batches = [torch.randn(n, 6) for n in (8, 3, 6, 2, 8, 5, 4)]
    engine = _train_side_by_side(Branchy, batches)
    # 8 exactly; 3 with the guard "at most 4"; 6 fails it: a graph for "more than 4"
    assert engine.builds == 3
    assert [r.dynamic for r in engine.records] == [False, True, True]
    assert engine.records[2].reason == "size guard failed: inputs[0].shape[0] <= 4"


def test_batch_norm_in_training_with_a_varying_batch_keeps_eagers_statistics() -> None:
    batches = [torch.randn(n, 6) for n in (6, 4, 9, 5, 12)]
    engine = _train_side_by_side(_batch_norm_net, batches)
    assert engine.builds == 2
    assert [r.dynamic for r in engine.records] == [False, True]


def test_a_graph_with_symbolic_sizes_comes_back_from_the_persistent_cache(
    tmp_path: Path,
) -> None:
    options = EngineOptions(backend="ort", threads=1, cache_dir=tmp_path)
    first = _train_side_by_side(_mlp, [torch.randn(n, 6) for n in (5, 7)], options=options)
    assert [r.dynamic for r in first.records] == [False, True]
    second = _train_side_by_side(_mlp, [torch.randn(n, 6) for n in (5, 3, 9)], options=options)
    assert [r.from_disk for r in second.records] == [True, True]
    assert [r.dynamic for r in second.records] == [False, True]
    assert second.builds == 2  # the batch of 9 ran on the loaded graph


def test_a_stored_size_guard_that_is_not_size_arithmetic_is_refused() -> None:
    stored = {"traced": [[5, 6]], "dynamic": [[0]], "texts": ["__import__('os').getpid() > 0"]}
    with pytest.raises(ValueError, match="size guard may not"):
        SizeGuards.from_meta(stored)


def test_a_size_guard_may_take_the_min_or_max_of_sizes_and_call_nothing_else() -> None:
    """A diagonal's length is a minimum of sizes (`x.diagonal(1)` of (r, c): min(r, c - 1)),
    and its trace guards on it: refused, such a graph was traced once per shape."""
    guard = "min(inputs[0].shape[0], (-1) + inputs[0].shape[1]) != 1"
    guards = SizeGuards.from_meta({"traced": [[5, 6]], "dynamic": [[0, 1]], "texts": [guard]})
    assert guards.admits(((4, 9),)) and not guards.admits(((1, 9),))
    assert not guards.admits(((7, 2),))
    largest = "max(inputs[0].shape[0], inputs[0].shape[1]) < 8"
    guards = SizeGuards.from_meta({"traced": [[5, 6]], "dynamic": [[0, 1]], "texts": [largest]})
    assert guards.admits(((7, 3),)) and not guards.admits(((8, 3),))
    for text in ["sorted(inputs[0].shape[0], 1) != 1", "min(inputs[0].shape[0], key=1) > 0"]:
        stored = {"traced": [[5, 6]], "dynamic": [[0]], "texts": [text]}
        with pytest.raises(ValueError, match="size guard may not"):
            SizeGuards.from_meta(stored)


def test_a_shape_that_keeps_coming_back_earns_a_graph_traced_for_it() -> None:
    options = EngineOptions(backend="ort", threads=1, static_after=3)
    batches = [torch.randn(n, 6) for n in (8, 5, 6, 6, 6, 6, 5)]
    engine = _train_side_by_side(_mlp, batches, options=options)
    assert engine.builds == 3
    assert [r.dynamic for r in engine.records] == [False, True, False]
    assert engine.records[2].hot_shape
    assert engine.records[2].reason == "input shape repeated 3 calls: a static-shape graph for it"


class Scaled(nn.Module):
    """forward reads a plain attribute, which the patcher's first build adds to its guards."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 3)
        self.factor = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.factor


def test_a_patched_class_traces_its_second_batch_size_with_symbols() -> None:
    """The second shape is traced with symbols even though the first build taught the call
    key an attribute (the first shape is known under the key the graph was filed by)."""
    from ort_autopatch import patcher

    patcher.patch(Scaled, patcher.Settings(engine=PLAIN))
    try:
        model = Scaled()
        eager = Scaled()
        for n in (8, 5, 11, 3):
            x = torch.randn(n, 6)
            out = model(x)
            assert ran_in_plain_ort(out), f"batch {n} ran elsewhere"
            torch.testing.assert_close(out, Scaled.forward(eager, x), rtol=1e-4, atol=1e-5)
        records = patcher._instances[model].engine.records
        assert patcher._instances[model].guards  # the attribute is guarded
        assert [r.dynamic for r in records] == [False, True]
    finally:
        patcher.unpatch(Scaled)


class _PackedAttention(nn.Module):
    """q, k and v sliced from one projection, then a linear layer on the 3-d result: the
    shapes `fx_passes.pads_summed_into_cat` and `save_bases_of_views` rewrite."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.qkv(x)
        q, k, v = proj[..., :8], proj[..., 8:16], proj[..., 16:]
        scores = q @ k.transpose(-2, -1) / 8**0.5
        return self.out(torch.softmax(scores, dim=-1) @ v)


def test_a_packed_projection_with_new_batch_and_length_every_call_has_one_concat() -> None:
    """The static graph and the one with symbolic sizes both give eager's numbers, and the
    gradient of the packed projection is a Concat in each (the sliced dimension is static,
    the others are symbols in the second)."""
    import onnx

    sizes = [(2, 5), (3, 7), (4, 6), (2, 9)]
    engine = _train_side_by_side(_PackedAttention, [torch.randn(b, s, 8) for b, s in sizes])
    assert [r.dynamic for r in engine.records] == [False, True]
    for entry in engine._cache._entries.values():
        backward = onnx.load_from_string(entry.program.lowered.backward)
        ops = [node.op_type for node in backward.graph.node]
        assert "Pad" not in ops


def _pooled() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.MaxPool2d(2), nn.ReLU())


def test_a_tiling_max_pool_with_new_batch_and_image_sizes_every_call_uses_space_to_depth() -> None:
    """`windows.window_slots`'s fake kernel takes symbolic sizes: the graph traced with
    symbols keeps the square pool's SpaceToDepth and gives eager's numbers at every size."""
    import onnx

    sizes = [(2, 8, 8), (3, 12, 12), (4, 8, 16), (2, 16, 4)]
    engine = _train_side_by_side(_pooled, [torch.randn(b, 2, h, w) for b, h, w in sizes])
    assert [r.dynamic for r in engine.records] == [False, True]
    for entry in engine._cache._entries.values():
        forward = onnx.load_from_string(entry.program.lowered.forward)
        assert "SpaceToDepth" in {node.op_type for node in forward.graph.node}
