"""Static-shape graphs: the first call of each mode, and an input shape that keeps coming back,
get a graph exported for exactly that shape beside the dynamic one (faster on CPU, and faster
to build), and no graph ever serves a shape it was not built for. Every call is compared with
an eager twin, and every call must have run in ORT.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch import patcher
from ort_autopatch.engine import EngineOptions
from ort_autopatch.engine.backends.ort_training.backend import OrtTrainingBackend
from ort_autopatch.engine.callkey import HotShapes
from ort_autopatch.engine.errors import SessionError
from ort_autopatch.engine.recipe import Miss
from ort_autopatch.policy import SkipCheck
from tests.helpers import class_stats, patched, plain_backend

TOL = {"rtol": 1e-5, "atol": 1e-5}
AFTER = 8  # the default of --static-after
#: what the training build's hot-shape mechanism alone does: the plain backend traces every
#: graph for its call's input shapes, so there is no dynamic graph beside which a repeated
#: shape earns a static one (its graph per shape is held to eager in test_engine_semantics)
HOT_SHAPES = pytest.mark.skipif(
    plain_backend(),
    reason="these counts follow the training build's order (a static graph for the first "
    "shape, the dynamic graph for others, static ones earned beside it); the plain backend "
    "traces its first graph for one shape and symbols from the second shape on "
    "(tests/test_plain_dynamic_shapes.py counts its graphs)",
)


class Layer(nn.Module):
    """A transformer block: the model whose step the static graph speeds up."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _settings(**engine: int) -> patcher.Settings:
    return patcher.Settings(engine=EngineOptions(**engine))  # type: ignore[arg-type]


@contextlib.contextmanager
def _patched_with(settings: patcher.Settings) -> Iterator[None]:
    yield from patched([Layer], settings)


@pytest.fixture
def layer() -> Iterator[None]:
    yield from patched([Layer])


@pytest.fixture
def layer_after_3() -> Iterator[None]:
    yield from patched([Layer], _settings(static_after=3))


class _Twins:
    """The patched model and its eager twin, trained side by side with AdamW."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Layer()
        self.twin = copy.deepcopy(self.model)
        self.opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (self.model, self.twin)]
        self.calls = 0

    def step(self, shape: tuple[int, ...]) -> None:
        g = torch.Generator().manual_seed(self.calls)
        self.calls += 1
        x = torch.randn(*shape, generator=g)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        outs = []
        for opt, run, inp in (
            (self.opts[0], self.model, a),
            (self.opts[1], lambda t: Layer.forward(self.twin, t), b),
        ):
            opt.zero_grad()
            out = run(inp)
            (out * out).mean().backward()
            outs.append(out)
        k = self.calls
        torch.testing.assert_close(outs[0], outs[1], **TOL, msg=lambda m: f"call {k}: {m}")
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=lambda m: f"call {k} dx: {m}")
        pairs = zip(self.model.named_parameters(), self.twin.parameters(), strict=True)
        for (name, p), q in pairs:
            where = f"call {k} {name}"
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, w=where: f"{w}: {m}")
        for opt in self.opts:
            opt.step()

    def eval_call(self, shape: tuple[int, ...]) -> None:
        x = torch.randn(*shape)
        self.model.eval()
        self.twin.eval()
        with torch.no_grad():
            torch.testing.assert_close(self.model(x), Layer.forward(self.twin, x), **TOL)
        self.model.train()
        self.twin.train()


def _assert_all_in_ort(calls: int) -> None:
    stats = class_stats(Layer)
    assert stats.eager_calls == {}
    assert stats.ort_calls == calls


# -- the rule ---------------------------------------------------------------------------------
def test_a_shape_earns_its_graph_on_the_call_that_completes_the_streak() -> None:
    hot = HotShapes(after=3, limit=2)
    shapes = ((4, 5),)
    picks = [hot.pick("train", lambda: shapes) for _ in range(5)]
    assert picks == [(None, False), (None, False), (shapes, True), (shapes, False), (shapes, False)]


def test_another_shape_breaks_the_streak() -> None:
    hot = HotShapes(after=3, limit=2)
    a, b = ((4, 5),), ((4, 6),)
    picks = [hot.pick("train", lambda s=s: s)[0] for s in (a, a, b, a, a)]
    assert picks == [None] * 5


def test_streaks_count_per_mode() -> None:
    hot = HotShapes(after=2, limit=2)
    a = ((4, 5),)
    assert hot.pick("train", lambda: a)[0] is None
    assert hot.pick("eval", lambda: a)[0] is None
    assert hot.pick("train", lambda: a) == (a, True)
    assert hot.pick("eval", lambda: a) == (a, True)


def test_at_most_limit_shapes_per_mode_earn_a_graph() -> None:
    hot = HotShapes(after=2, limit=2)
    earned = [hot.pick("train", lambda n=n: ((n,),))[1] for n in (1, 1, 2, 2, 3, 3)]
    assert earned == [False, True, False, True, False, False]


def test_after_zero_never_picks_shapes_and_never_reads_them() -> None:
    hot = HotShapes(after=0, limit=2)

    def shapes() -> tuple[tuple[int, ...], ...]:
        raise AssertionError("read the shapes")

    assert hot.pick("train", shapes) == (None, False)


def test_the_first_call_of_a_mode_has_its_shapes_picked_at_once() -> None:
    hot = HotShapes(after=3, limit=2, first=True)
    a, b = ((4, 5),), ((4, 6),)
    picks = [hot.pick("train", lambda s=s: s) for s in (a, b, a, b, b, b)]
    # a call of a hot shape leaves another shape's streak as it was
    assert picks == [(a, False), (None, False), (a, False), (None, False), (b, True), (b, False)]
    assert hot.pick("eval", lambda: b) == (b, False)  # each mode has its own first call


def test_the_first_shape_counts_toward_the_limit() -> None:
    hot = HotShapes(after=2, limit=2, first=True)
    earned = [hot.pick("train", lambda n=n: ((n,),)) for n in (1, 2, 2, 3, 3)]
    assert [shapes for shapes, _ in earned] == [((1,),), None, ((2,),), None, None]


def test_after_zero_picks_no_first_shape_either() -> None:
    hot = HotShapes(after=0, limit=2, first=True)
    assert hot.pick("train", lambda: ((4, 5),)) == (None, False)


def test_a_refused_first_shape_is_never_picked_again() -> None:
    hot = HotShapes(after=2, limit=2, first=True)
    a = ((4, 5),)
    assert hot.pick("train", lambda: a) == (a, False)
    hot.refuse("train", a)
    assert [hot.pick("train", lambda: a) for _ in range(3)] == [(None, False)] * 3


def test_a_refused_shape_is_never_picked_again() -> None:
    hot = HotShapes(after=2, limit=2)
    a = ((4, 5),)
    hot.pick("train", lambda: a)
    assert hot.pick("train", lambda: a) == (a, True)
    hot.refuse("train", a)
    assert [hot.pick("train", lambda: a) for _ in range(3)] == [(None, False)] * 3


# -- the engine -------------------------------------------------------------------------------
@HOT_SHAPES
@pytest.mark.usefixtures("layer")
def test_a_fixed_shape_gets_one_static_graph_at_its_first_call() -> None:
    twins = _Twins()
    for _ in range(AFTER + 4):
        twins.step((3, 5, 16))
    stats = class_stats(Layer)
    assert (stats.exports, stats.static_shape_graphs) == (1, 1)
    assert stats.rebuilds == {}
    _assert_all_in_ort(AFTER + 4)


@HOT_SHAPES
@pytest.mark.usefixtures("layer")
def test_a_later_shape_that_repeats_earns_a_static_graph_beside_the_dynamic_one() -> None:
    twins = _Twins()
    twins.step((2, 4, 16))
    for _ in range(AFTER + 2):
        twins.step((3, 5, 16))
    stats = class_stats(Layer)
    assert (stats.exports, stats.static_shape_graphs) == (3, 2)
    assert stats.rebuilds == {
        "new input shape": 1,
        f"input shape repeated {AFTER} calls: a static-shape graph for it": 1,
    }
    _assert_all_in_ort(AFTER + 3)


@HOT_SHAPES
@pytest.mark.usefixtures("layer_after_3")
def test_other_shapes_use_the_dynamic_graph_and_the_hot_shape_keeps_its_own() -> None:
    twins = _Twins()
    for shape in [(2, 7, 16)] * 3 + [(2, 4, 16), (5, 7, 16), (2, 7, 16), (1, 9, 16), (2, 7, 16)]:
        twins.step(shape)
    stats = class_stats(Layer)
    assert (stats.exports, stats.static_shape_graphs) == (2, 1)
    _assert_all_in_ort(8)


@HOT_SHAPES
@pytest.mark.usefixtures("layer_after_3")
def test_a_new_length_every_call_takes_the_dynamic_graph_from_the_second_call() -> None:
    twins = _Twins()
    for length in range(2, 14):
        twins.step((2, length, 16))
    stats = class_stats(Layer)
    # the first call's static graph, then the dynamic one for every other length
    assert (stats.exports, stats.static_shape_graphs) == (2, 1)
    assert stats.rebuilds == {"new input shape": 1}
    _assert_all_in_ort(12)


@HOT_SHAPES
@pytest.mark.usefixtures("layer_after_3")
def test_eval_calls_between_steps_do_not_break_the_training_streak() -> None:
    twins = _Twins()
    for _ in range(4):
        twins.step((2, 6, 16))
        twins.eval_call((4, 3, 16))
    stats = class_stats(Layer)
    # a static graph for training and one for inference, each at its mode's first call (plus
    # one build when an export teaches the attribute guards a new attribute)
    assert stats.static_shape_graphs == 2
    assert 2 <= stats.exports <= 3
    _assert_all_in_ort(8)


def test_static_after_zero_keeps_one_dynamic_graph() -> None:
    with _patched_with(_settings(static_after=0)):
        twins = _Twins()
        for _ in range(AFTER + 2):
            twins.step((2, 5, 16))
        stats = class_stats(Layer)
        assert (stats.exports, stats.static_shape_graphs) == (1, 0)


@HOT_SHAPES
def test_unchecked_calls_never_feed_another_shape_to_a_static_graph() -> None:
    """SKIP_CHECK_BUILD_GRADIENT reuses the last graph without checks, but not a static one
    for another shape: the call goes the checked way and takes the dynamic graph."""
    settings = patcher.Settings(
        skip_check=SkipCheck.SKIP_CHECK_BUILD_GRADIENT, engine=EngineOptions(static_after=3)
    )
    with _patched_with(settings):
        twins = _Twins()
        for shape in [(2, 5, 16)] * 3 + [(3, 8, 16), (2, 5, 16), (1, 4, 16)]:
            twins.step(shape)
        stats = class_stats(Layer)
        assert (stats.exports, stats.static_shape_graphs) == (2, 1)
        _assert_all_in_ort(6)


@pytest.mark.usefixtures("layer_after_3")
@HOT_SHAPES
def test_a_shape_whose_static_graph_cannot_be_built_keeps_the_dynamic_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = OrtTrainingBackend.build

    def refuse_static(self: OrtTrainingBackend, miss: Miss, *args: Any) -> Any:
        if miss.shapes is not None:
            raise SessionError("Layer", "refused for the test", "none")
        return real(self, miss, *args)

    monkeypatch.setattr(OrtTrainingBackend, "build", refuse_static)
    twins = _Twins()
    for _ in range(8):
        twins.step((2, 5, 16))
    stats = class_stats(Layer)
    assert (stats.exports, stats.static_shape_graphs) == (1, 0)
    assert stats.fallbacks == {}
    _assert_all_in_ort(8)


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


@HOT_SHAPES
def test_a_static_shape_graph_draws_new_dropout_masks_every_call() -> None:
    """The static export freezes sizes, never random draws: each call drops other units, at
    eager's rate and scale, and eval mode matches eager exactly."""
    from ort_autopatch.engine import ModuleEngine as Engine

    torch.manual_seed(0)
    model = Dropped()
    engine = Engine(model, EngineOptions(static_after=2))
    x = torch.randn(32, 16)
    outs = [engine(x) for _ in range(3)]
    assert [r.hot_shape for r in engine.records] == [True]  # the first call's static graph
    masks = [(o == 0) for o in outs]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    kept = model.fc(x).detach() * 2
    for out, mask in zip(outs, masks, strict=True):
        assert 0.4 < mask.float().mean().item() < 0.6
        torch.testing.assert_close(out[~mask].detach(), kept[~mask])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), model.fc(x))
