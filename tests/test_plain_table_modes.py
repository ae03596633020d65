"""The plain backend's decomposition table at every rank and mode torch accepts for an entry,
through ONNX Runtime and against eager, call by call: graphs traced for one shape and graphs
with symbolic sizes (called at sizes other than the one they were traced at), train and eval.

The engine (`ModuleEngine`) never falls back: a graph the first-call check refuses raises,
and every call is asserted to have run in ORT. Random graphs (feature dropout) cannot equal
eager's numbers: their masks are read back from the graph's own output and eager is run with
those very masks (identical draws), beside the mask's structure, rate and scaling.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from ort_autopatch.engine import ModuleEngine
from ort_autopatch.engine.recipe import EngineOptions
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)

PLAIN = EngineOptions(backend="ort", threads=1)


# -- feature dropout -----------------------------------------------------------------------------
# (function, input shape, the shape of torch's mask in the input's coordinates): torch draws
# one value per (batch, channel) of the input it hands `feature_dropout`, which for unbatched
# and low-rank inputs is not the user's (dropout1d and dropout3d add a batch of one; dropout2d
# takes a 3-D input as (N, C, L) and a 2-D one as (N, C): one draw per element).
F = nn.functional
FEATURE_DROPOUT: list[tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...]]] = [
    (F.dropout1d, (40, 3), (40, 1)),  # unbatched (C, L)
    (F.dropout1d, (8, 40, 3), (8, 40, 1)),
    (F.dropout2d, (16, 40), (16, 40)),  # 2-D: deprecated, elementwise (the model)
    (F.dropout2d, (8, 40, 3), (8, 40, 1)),  # 3-D: taken as (N, C, L)
    (F.dropout2d, (4, 40, 3, 2), (4, 40, 1, 1)),
    (F.dropout2d, (2, 40, 2, 2, 2), (2, 40, 1, 1, 1)),  # 5-D: deprecated
    (F.dropout3d, (40, 3, 2), (40, 1, 1)),  # 3-D: deprecated, a batch of one added
    (F.dropout3d, (40, 3, 2, 2), (40, 1, 1, 1)),  # unbatched (C, D, H, W)
    (F.dropout3d, (2, 40, 2, 2, 2), (2, 40, 1, 1, 1)),
    # nn.Dropout (native_dropout and its backward, torch's decomposition): one draw each
    (F.dropout, (6, 40), (6, 40)),
    (F.dropout, (3, 40, 2), (3, 40, 2)),
]
P = 0.4


class FeatureDrop(nn.Module):
    def __init__(self, function: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.function = function
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x * self.scale, P, self.training)


def _mask_of(out: torch.Tensor, noise: tuple[int, ...]) -> torch.Tensor:
    """The kept mask of a feature dropout's output (an input without zeros), checked to be
    one draw per element of `noise`, broadcast over the rest as torch's is."""
    kept = out != 0
    over = [d for d, size in enumerate(noise) if size == 1 and out.shape[d] != 1]
    drawn = kept.all(over, keepdim=True) if over else kept
    assert torch.equal(kept, drawn.expand_as(kept)), "a channel is only partly dropped"
    return drawn


def _id(case: tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...]]) -> str:
    return f"{case[0].__name__}-{'x'.join(map(str, case[1]))}"


@pytest.mark.parametrize("case", FEATURE_DROPOUT, ids=_id)
def test_the_masks_in_this_table_are_torchs(
    case: tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...]],
) -> None:
    """The expected mask shapes above hold for eager itself (the tests below trust them)."""
    function, shape, noise = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = function(torch.rand(shape) + 0.5, P, True)
    drawn = _mask_of(out, noise)
    assert drawn.shape == noise
    assert 0 < float(drawn.float().mean()) < 1


def _drop_calls(
    case: tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...]],
    shapes: Sequence[tuple[int, ...]],
) -> ModuleEngine:
    """Training calls of a feature dropout through the engine, each held to eager run with
    the graph's own mask: output, the parameter's and the input's gradients; the mask is one
    draw per (batch, channel) as torch's, kept at the rate 1 - p and scaled by 1 / (1 - p)."""
    function, _, noise = case
    torch.manual_seed(0)
    model = FeatureDrop(function)
    engine = ModuleEngine(model, PLAIN)
    rates, masks = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, shape in enumerate(shapes):
            x = (torch.rand(shape) + 0.5).requires_grad_()
            out = engine(x)
            assert ran_in_plain_ort(out), f"call {step} ({shape}) ran elsewhere"
            call_noise = tuple(s if n != 1 else 1 for s, n in zip(shape, noise, strict=True))
            drawn = _mask_of(out, call_noise)
            rates.append(float(drawn.float().mean()))
            masks.append(drawn)
            # eager with the same draws: torch's arithmetic, mask / (1 - p) times the input
            x_eager = x.detach().clone().requires_grad_()
            scale = model.scale.detach().clone().requires_grad_()
            expected = (x_eager * scale) * (drawn.to(x.dtype) / (1 - P))
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
            cotangent = torch.randn_like(out)
            model.scale.grad = None
            out.backward(cotangent)
            expected.backward(cotangent)
            torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(model.scale.grad, scale.grad, rtol=1e-5, atol=1e-5)
    assert abs(sum(rates) / len(rates) - (1 - P)) < 0.12, f"kept rates {rates}"
    assert not all(torch.equal(masks[0], m) for m in masks[1:]), "the mask never changes"
    return engine


@pytest.mark.parametrize("case", FEATURE_DROPOUT, ids=_id)
def test_feature_dropout_draws_torchs_mask_at_every_rank(
    case: tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...]],
) -> None:
    engine = _drop_calls(case, [case[1]] * 3)
    assert engine.builds == 1


@pytest.mark.parametrize("case", FEATURE_DROPOUT, ids=_id)
def test_feature_dropout_with_symbolic_sizes_draws_torchs_mask_at_other_sizes(
    case: tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...]],
) -> None:
    """Every dimension but the channels varies: the second graph is symbolic in them and is
    called at sizes it was not traced at."""
    _, shape, noise = case
    channel = next(d for d, (s, n) in enumerate(zip(shape, noise, strict=True)) if s == n == 40)
    shapes = [
        tuple(s if d == channel else s + extra for d, s in enumerate(shape))
        for extra in (0, 1, 3, 2)
    ]
    engine = _drop_calls(case, shapes)
    assert [r.dynamic for r in engine.records] == [False, True]


@pytest.mark.parametrize("case", FEATURE_DROPOUT[::2], ids=_id)
def test_feature_dropout_in_eval_is_the_identity_as_in_eager(
    case: tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...]],
) -> None:
    function, shape, _ = case
    torch.manual_seed(0)
    model = FeatureDrop(function).eval()
    engine = ModuleEngine(model, PLAIN)
    x = torch.randn(shape)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(engine(x), function(x * model.scale, P, False))
    assert engine.builds == 1


def test_feature_dropout_is_reproducible_under_manual_seed_and_leaves_torchs_stream() -> None:
    model = FeatureDrop(F.dropout2d)
    engine = ModuleEngine(model, PLAIN)
    x = torch.rand(16, 40) + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(3)
        state = torch.random.get_rng_state()
        first = engine(x)
        assert torch.equal(torch.random.get_rng_state(), state), "torch's generator was drawn"
        torch.manual_seed(3)
        assert torch.equal(engine(x), first)


class Classifier(nn.Module):
    """The issue's script: LSTM, its last step, BatchNorm1d, Dropout2d over the 2-D result (a
    deprecated use torch still runs, as elementwise dropout), Linear. The dropped activations
    are returned beside the logits, so eager can be run with the graph's draws."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 16, batch_first=True)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout2d(0.5)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = self.lstm(x)
        dropped = self.drop(self.norm(out[:, -1]))
        return self.head(dropped), dropped


class _FixedMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = torch.ones(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.mask / 0.5)


def test_lstm_batchnorm_dropout2d_classifier_trains_as_eager_with_the_same_masks() -> None:
    torch.manual_seed(0)
    model = Classifier()
    eager = Classifier()
    eager.load_state_dict(model.state_dict())
    eager.drop = _FixedMask()  # type: ignore[assignment]
    engine = ModuleEngine(model, PLAIN)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            x = torch.randn(32, 5, 6)
            logits, dropped = engine(x)
            assert ran_in_plain_ort(logits), f"call {step} ran elsewhere"
            eager.drop.mask = (dropped != 0).float()  # the graph's draws
            kept.append(float(eager.drop.mask.mean()))
            expected, expected_dropped = eager(x)
            torch.testing.assert_close(dropped, expected_dropped, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
            optimizer.zero_grad()
            eager_optimizer.zero_grad()
            logits.square().mean().backward()
            expected.square().mean().backward()
            for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
            for a, b in zip(model.buffers(), eager.buffers(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            optimizer.step()
            eager_optimizer.step()
    assert abs(sum(kept) / len(kept) - 0.5) < 0.1, f"kept rates {kept}"
    assert engine.builds == 1


# -- attention -----------------------------------------------------------------------------------
class MaskedAttention(nn.Module):
    """Attention under an additive mask as transformers builds it: the dtype's minimum where
    a key is padding, so a sequence whose keys are all padding has rows of the minimum only
    (eager's CPU flash kernel: uniform weights forward, unnormalised ones backward)."""

    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.causal = causal

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        if self.causal:  # a decoder's (OPT's): causal and padding in one (batch, 1, q, k) mask
            above = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            mask = mask.masked_fill(above, torch.finfo(x.dtype).min)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, 16))


def _keep(batch: int, length: int) -> torch.Tensor:
    keep = (torch.rand(batch, length) > 0.3).long()
    keep[0] = 0  # a sequence of padding alone
    return keep


@pytest.mark.parametrize(
    "sizes", [[(4, 6)] * 2, [(4, 6), (3, 9), (5, 4), (2, 7)]], ids=["static", "symbolic"]
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_attention_with_fully_masked_rows_equals_eager(
    sizes: list[tuple[int, int]], training: bool
) -> None:
    _attention_against_eager(sizes, training, causal=False)


@pytest.mark.parametrize(
    "sizes", [[(4, 6)] * 2, [(4, 6), (3, 9), (5, 4), (2, 7)]], ids=["static", "symbolic"]
)
def test_causal_attention_with_padding_masks_trains_as_eager(sizes: list[tuple[int, int]]) -> None:
    """OPT's layout (issue 35): one additive 4-D mask, causal and padding, and `is_causal`
    off; a row whose earlier keys are all padding is fully masked. Traced with the flash
    kernel eager takes, the gradients are eager's (the zoo's reference had been the math
    kernel's, 3.4x off on OPT)."""
    _attention_against_eager(sizes, True, causal=True)


def _attention_against_eager(sizes: list[tuple[int, int]], training: bool, causal: bool) -> None:
    torch.manual_seed(0)
    model = MaskedAttention(causal).train(training)
    eager = MaskedAttention(causal).train(training)
    eager.load_state_dict(model.state_dict())
    engine = ModuleEngine(model, PLAIN)
    for step, (batch, length) in enumerate(sizes):
        x, keep = torch.randn(batch, length, 16), _keep(batch, length)
        with torch.set_grad_enabled(training):
            out, expected = engine(x, keep), eager(x, keep)
        assert not training or ran_in_plain_ort(out), f"call {step} ran elsewhere"
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        if training:
            model.zero_grad()
            eager.zero_grad()
            cotangent = torch.randn_like(out)
            out.backward(cotangent)
            expected.backward(cotangent)
            for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert [r.dynamic for r in engine.records] == [False, True][: len(set(sizes))]


def test_bert_classifier_with_varying_batch_and_length_and_padding_masks_equals_eager() -> None:
    """ONNX Runtime's own API test's data: attention masks of values 0 to 99 (a key counts
    where the mask is 1, so most rows mask every key), padding ids, one label."""
    transformers = pytest.importorskip("transformers")

    def bert() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            problem_type="single_label_classification",
        )
        return transformers.BertForSequenceClassification(config)

    model, eager = bert(), bert()
    engine = ModuleEngine(model, PLAIN)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(2)
    for step, (batch, length) in enumerate([(8, 12), (5, 9), (3, 14), (6, 7)]):
        ids = torch.randint(0, 100, (batch, length), generator=generator)
        mask = torch.randint(0, 100, (batch, length), generator=generator)
        labels = torch.zeros(batch, dtype=torch.long)
        out = engine(input_ids=ids, attention_mask=mask, labels=labels)
        expected = eager(input_ids=ids, attention_mask=mask, labels=labels)
        assert ran_in_plain_ort(out.loss), f"call {step} ran elsewhere"
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        out.loss.backward()
        expected.loss.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
        optimizer.step()
        eager_optimizer.step()
    assert [r.dynamic for r in engine.records] == [False, True]


# -- adaptive average pools ----------------------------------------------------------------------
# (pool, input shape, output size): windows that tile the input and windows of unequal,
# overlapping lengths; batched and unbatched; 1-d, 2-d and 3-d
ADAPTIVE_POOLS: list[tuple[type[nn.Module], tuple[int, ...], int | tuple[int, ...]]] = [
    (nn.AdaptiveAvgPool1d, (2, 4, 8), 4),
    (nn.AdaptiveAvgPool1d, (2, 4, 7), 3),
    (nn.AdaptiveAvgPool1d, (4, 7), 3),
    (nn.AdaptiveAvgPool2d, (2, 4, 8, 6), (4, 3)),
    (nn.AdaptiveAvgPool2d, (2, 4, 7, 7), (3, 3)),
    (nn.AdaptiveAvgPool2d, (4, 7, 5), (3, 2)),
    (nn.AdaptiveAvgPool2d, (2, 4, 3, 4), (5, 6)),  # more outputs than inputs
    (nn.AdaptiveAvgPool3d, (1, 4, 4, 6, 4), 2),
    (nn.AdaptiveAvgPool3d, (1, 4, 5, 7, 6), (2, 3, 4)),
    (nn.AdaptiveAvgPool3d, (4, 5, 7, 6), (2, 3, 4)),
]


class Pooled(nn.Module):
    def __init__(self, pool: type[nn.Module], out: int | tuple[int, ...], channels: int) -> None:
        super().__init__()
        self.pool = pool(out)
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = int(type(self.pool).__name__[-2])
        scale = self.weight.reshape(-1, *([1] * dims))
        return self.pool(x * scale)


def _pool_id(case: tuple[type[nn.Module], tuple[int, ...], int | tuple[int, ...]]) -> str:
    return f"{case[0].__name__}-{'x'.join(map(str, case[1]))}-to-{case[2]}"


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", ADAPTIVE_POOLS, ids=_pool_id)
def test_adaptive_average_pools_equal_eager(
    case: tuple[type[nn.Module], tuple[int, ...], int | tuple[int, ...]],
    training: bool,
    symbolic: bool,
) -> None:
    """With symbolic sizes the spatial sizes change every call, so the windows do."""
    pool, shape, out = case
    dims = int(pool.__name__[-2])
    channel = len(shape) - dims - 1
    if symbolic:
        shapes = [shape] + [
            tuple(s if d <= channel else s + extra for d, s in enumerate(shape))
            for extra in (1, 3, 2)
        ]
    else:
        shapes = [shape] * 2
    model = Pooled(pool, out, shape[channel]).train(training)
    eager = Pooled(pool, out, shape[channel]).train(training)
    engine = ModuleEngine(model, PLAIN)
    for step, size in enumerate(shapes):
        x = torch.randn(size)
        x_eager = x.clone().requires_grad_(training)
        x = x.requires_grad_(training)
        with torch.set_grad_enabled(training):
            y, expected = engine(x), eager(x_eager)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
        if training:
            assert ran_in_plain_ort(y), f"call {step} ({size}) ran elsewhere"
            model.zero_grad()
            eager.zero_grad()
            cotangent = torch.randn_like(y)
            y.backward(cotangent)
            expected.backward(cotangent)
            torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(model.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-5)
    dynamic = [r.dynamic for r in engine.records]
    # symbolic: windows that tile and windows that do not take a graph each (a size guard)
    assert dynamic[0] is False and any(dynamic) == symbolic


# -- leaky ReLU's gradient -----------------------------------------------------------------------
class Leaky(nn.Module):
    def __init__(self, slope: float) -> None:
        super().__init__()
        self.act = nn.LeakyReLU(slope)
        self.scale = nn.Parameter(torch.tensor(1.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x * self.scale)


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 3, 4, 5)], ids=str)
def test_leaky_relu_gradient_equals_eager_at_every_rank(
    shape: tuple[int, ...], symbolic: bool
) -> None:
    """`leaky_relu_backward` (a product with an exact factor, not ORT's `Where`) through ORT,
    zeros included, at sizes other than the traced one for the symbolic graph."""
    shapes = [shape, tuple(s + 2 for s in shape), tuple(s + 1 for s in shape)]
    shapes = shapes if symbolic else [shape] * 3
    model, eager = Leaky(0.2), Leaky(0.2)
    engine = ModuleEngine(model, PLAIN)
    for step, size in enumerate(shapes):
        x = torch.randn(size)
        x.view(-1)[0] = 0.0
        x_eager = x.clone().requires_grad_(True)
        x = x.requires_grad_(True)
        y, expected = engine(x), eager(x_eager)
        assert ran_in_plain_ort(y), f"call {step} ({size}) ran elsewhere"
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        model.zero_grad()
        eager.zero_grad()
        cotangent = torch.randn_like(y)
        y.backward(cotangent)
        expected.backward(cotangent)
        torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(model.scale.grad, eager.scale.grad, rtol=1e-5, atol=1e-6)


# -- uniform draws and RReLU ---------------------------------------------------------------------
class Uniform(nn.Module):
    """`Tensor.uniform_` on a fresh tensor: noise that scales the input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale * torch.empty_like(x).uniform_(0.5, 1.5)


class RandomizedLeaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.act = nn.RReLU(0.1, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x * self.scale)


RANKED = [(7,), (40, 6), (4, 6, 5), (2, 3, 4, 5)]


def _nonzero(size: tuple[int, ...]) -> torch.Tensor:
    x = torch.randn(size)
    return torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("shape", RANKED, ids=str)
def test_uniform_draws_in_range_and_the_backward_uses_the_forwards_draw(
    shape: tuple[int, ...], symbolic: bool
) -> None:
    """`uniform_` runs in ORT (torch's decomposition ends in `prims.uniform`, which nothing
    translates): each call draws anew in [0.5, 1.5), and the input's gradient is the very
    draw the output used."""
    sizes = [shape, tuple(s + 1 for s in shape), tuple(s + 2 for s in shape)]
    engine = ModuleEngine(Uniform(), PLAIN)
    draws = []
    for step, size in enumerate(sizes if symbolic else [shape] * 3):
        x = _nonzero(size).requires_grad_(True)
        y = engine(x)
        assert ran_in_plain_ort(y), f"call {step} ({size}) ran elsewhere"
        noise = (y / x).detach()
        assert noise.min() >= 0.5 - 1e-6 and noise.max() < 1.5 + 1e-6
        y.backward(torch.ones_like(y))
        torch.testing.assert_close(x.grad, noise, rtol=1e-5, atol=1e-6)
        draws.append(noise)
    assert not torch.equal(draws[0].flatten()[:5], draws[1].flatten()[:5]), "no new draw"


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("shape", RANKED, ids=str)
def test_rrelu_draws_slopes_for_negative_inputs_in_training_and_equals_eager_in_eval(
    shape: tuple[int, ...], symbolic: bool
) -> None:
    """Training: inputs above zero pass, each other one is scaled by its own slope in
    [0.1, 0.3), and the gradient is that slope; eval: eager's numbers exactly."""
    sizes = [shape, tuple(s + 1 for s in shape), tuple(s + 2 for s in shape)]
    model, eager = RandomizedLeaky(), RandomizedLeaky()
    engine = ModuleEngine(model, PLAIN)
    for step, size in enumerate(sizes if symbolic else [shape] * 3):
        x = _nonzero(size).requires_grad_(True)
        y = engine(x)
        assert ran_in_plain_ort(y), f"call {step} ({size}) ran elsewhere"
        slope = (y / x).detach()
        positive = x.detach() > 0
        assert torch.equal(slope[positive], torch.ones_like(slope[positive]))
        drawn = slope[~positive]
        assert drawn.min() >= 0.1 - 1e-6 and drawn.max() < 0.3 + 1e-6
        y.backward(torch.ones_like(y))
        torch.testing.assert_close(x.grad, slope, rtol=1e-5, atol=1e-6)
    model.eval()
    eager.eval()
    for size in sizes if symbolic else [shape] * 2:
        x = _nonzero(size)
        with torch.no_grad():
            y = engine(x)
        torch.testing.assert_close(y, eager(x), rtol=0, atol=0)
    # the engine never falls back (it raises): an inference graph was built and ran
    assert [r.has_backward for r in engine.records].count(False) >= 1
