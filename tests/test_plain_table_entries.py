"""Every entry of the plain backend's decomposition table (`decompositions.py`: ours, the torch
decompositions it names, the composites it replaces; `recurrent.py`'s scans) through the real
engine at the ranks and modes torch accepts for its operator, against eager.

Each case is called five times with fallback disabled (`ModuleEngine` raises where the
first-call check refuses a graph): twice at its first sizes (the graph traced for them), then
at three other sizes, the first of which traces a graph with symbolic sizes that the next two
calls reuse at sizes it was not traced at. Every call is asserted to have run in ORT and is
held to eager: outputs, the gradients of the inputs and of the parameters, and the buffers.
`test_plain_table_modes.py` holds the entries whose numbers need more (feature dropout's
draws, attention's masked rows, adaptive pools' window sizes).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from ort_autopatch.engine import ModuleEngine
from ort_autopatch.engine.recipe import EngineOptions
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)

PLAIN = EngineOptions(backend="ort", threads=1)
F = nn.functional
#: the size step of each call: the first graph is traced at step 0, the symbolic one at 1
STEPS = (0, 0, 1, 3, 2)

Inputs = Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Case:
    """A module, and its inputs at size step `v` (drawn from `gen`)."""

    name: str
    module: Callable[[], nn.Module]
    inputs: Inputs
    #: eval mode changes what the entry computes (BatchNorm's statistics): tested in both
    modes: tuple[bool, ...] = (True,)
    marks: tuple[pytest.MarkDecorator, ...] = ()
    #: whether any size can change (a 1-D LayerNorm's input is its normalised shape)
    sized: bool = True


class Scaled(nn.Module):
    """`function(x * scale, *rest)`: a parameter before the operator, so its gradient is held
    to eager's too."""

    def __init__(self, function: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.function = function
        self.scale = nn.Parameter(torch.tensor(1.25))

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return self.function(x * self.scale, *rest)


class Then(nn.Module):
    """A module's output times a fixed weight: every element of the output reaches the
    gradients with its own factor (a sum would hide a permutation)."""

    def __init__(self, inner: nn.Module, function: Callable[..., torch.Tensor] | None = None):
        super().__init__()
        self.inner = inner
        self.function = function

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        y = self.inner(*inputs)
        return y if self.function is None else self.function(y)


def rand(*shape: int) -> Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]:
    """Inputs of `shape` with every dim given as a negative number growing by the step
    (-3 is 3 + v): a random float tensor."""

    def make(v: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        sizes = [-s + v if s < 0 else s for s in shape]
        return (torch.randn(sizes, generator=gen),)

    return make


def rand_by(*shape: int, step: int) -> Inputs:
    """As `rand`, growing dims by `step` per size step (pools whose windows tile)."""

    def make(v: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        sizes = [-s + step * v if s < 0 else s for s in shape]
        return (torch.randn(sizes, generator=gen),)

    return make


def relu_ties(inputs: Inputs) -> Inputs:
    """Inputs with many exact ties (ReLU's zeros, as a pool after ReLU sees)."""

    def make(v: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return tuple(t.clamp_min(0) for t in inputs(v, gen))

    return make


def with_target(inputs: Inputs, classes: int, target_shape: Callable[[torch.Tensor], list[int]]):
    """A float input and integer class targets in [0, classes) of `target_shape(x)`."""

    def make(v: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        (x,) = inputs(v, gen)
        return x, torch.randint(0, classes, target_shape(x), generator=gen)

    return make


def with_float_target(inputs: Inputs, unit: bool = False) -> Inputs:
    def make(v: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        (x,) = inputs(v, gen)
        target = torch.rand(x.shape, generator=gen) if unit else torch.randn(x.shape, generator=gen)
        return x, target

    return make


def ids(vocabulary: int, *shape: int) -> Inputs:
    def make(v: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        sizes = [-s + v if s < 0 else s for s in shape]
        return (torch.randint(0, vocabulary, sizes, generator=gen),)

    return make


def fn(function: Callable[..., torch.Tensor]) -> Callable[[], nn.Module]:
    return lambda: Scaled(function)


def mod(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A module of torch's after a scale parameter (the input's gradient flows through it)."""
    return lambda: Scaled(factory())


def weight_normed(factory: Callable[[], nn.Module], dim: int) -> Callable[[], nn.Module]:
    return lambda: nn.utils.parametrizations.weight_norm(factory(), dim=dim)


def _lstm_out(out: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    y, (h, c) = out
    return y.sum(-1).unsqueeze(-1) * 2 + h.sum() + 3 * c.sum()


def _gru_out(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    y, h = out
    return y.sum(-1).unsqueeze(-1) * 2 + h.sum()


def _positive(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


BOTH = (True, False)

CASES: list[Case] = [
    # -- BatchNorm: ours in train mode, torch's in eval; backward torch's ---------------------
    Case("batch_norm1d-2d", lambda: nn.BatchNorm1d(4), rand(-6, 4), BOTH),
    Case("batch_norm1d-3d", lambda: nn.BatchNorm1d(4), rand(-3, 4, -5), BOTH),
    Case("batch_norm2d", lambda: nn.BatchNorm2d(4), rand(-2, 4, -3, 3), BOTH),
    Case("batch_norm3d", lambda: nn.BatchNorm3d(4), rand(2, 4, -2, 3, 2), BOTH),
    Case("batch_norm2d-no-affine", lambda: nn.BatchNorm2d(4, affine=False), rand(-2, 4, 3, 3)),
    Case(
        "batch_norm2d-batch-statistics-only",
        lambda: nn.BatchNorm2d(4, track_running_stats=False),
        rand(-2, 4, 3, -3),
        BOTH,
    ),
    Case(
        "batch_norm1d-cumulative-average",
        lambda: nn.BatchNorm1d(4, momentum=None),
        rand(-5, 4),
        BOTH,
    ),
    # -- max pools: tiling windows ours, others the exporter's MaxPool ------------------------
    Case("max_pool2d-tiling", mod(lambda: nn.MaxPool2d(2)), rand_by(-2, 3, -8, 6, step=2)),
    Case(
        "max_pool2d-tiling-ties",
        mod(lambda: nn.MaxPool2d(2)),
        relu_ties(rand_by(-2, 3, -8, 6, step=2)),
    ),
    Case("max_pool2d-tiling-unbatched", mod(lambda: nn.MaxPool2d(2)), rand_by(3, -8, 4, step=2)),
    Case("max_pool2d-tiling-then-not", mod(lambda: nn.MaxPool2d(2)), rand(2, 3, -8, 6)),
    Case("max_pool2d-3-2-1", mod(lambda: nn.MaxPool2d(3, 2, 1)), relu_ties(rand(-2, 3, -9, 9))),
    Case("max_pool2d-ceil", mod(lambda: nn.MaxPool2d(2, ceil_mode=True)), rand(2, 3, -7, 7)),
    Case("max_pool2d-dilated", mod(lambda: nn.MaxPool2d(2, 1, dilation=2)), rand(2, 3, -6, 6)),
    Case("max_pool1d", mod(lambda: nn.MaxPool1d(2)), rand_by(-2, 3, -8, step=2)),
    Case("max_pool1d-unbatched", mod(lambda: nn.MaxPool1d(3, 2)), rand(3, -9)),
    Case("max_pool1d-odd-padded", mod(lambda: nn.MaxPool1d(3, 2, 1)), rand(-2, 3, -9)),
    Case(
        "max_pool1d-indices",
        fn(lambda x: F.max_pool1d(x, 2, return_indices=True)[0]),
        rand(2, 3, -7),
    ),
    Case("max_pool3d-overlapping", mod(lambda: nn.MaxPool3d(3, 2, 1)), rand(1, 2, -5, 4, 5)),
    Case("max_pool3d", mod(lambda: nn.MaxPool3d(2)), rand_by(2, 3, -4, 4, 4, step=2)),
    # -- average pools ---------------------------------------------------------------------
    Case("avg_pool2d", mod(lambda: nn.AvgPool2d(2)), rand_by(-2, 3, -8, 6, step=2)),
    Case("avg_pool2d-unbatched", mod(lambda: nn.AvgPool2d(2)), rand(3, -6, 4)),
    Case("avg_pool2d-3-2-1", mod(lambda: nn.AvgPool2d(3, 2, 1)), rand(-2, 3, -7, 7)),
    Case(
        "avg_pool2d-3-2-1-exclude-pad",
        mod(lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False)),
        rand(2, 3, -7, 6),
    ),
    Case(
        "avg_pool2d-divisor-override",
        mod(lambda: nn.AvgPool2d(2, divisor_override=3)),
        rand(2, 3, -6, 4),
    ),
    Case("avg_pool2d-ceil", mod(lambda: nn.AvgPool2d(2, ceil_mode=True)), rand(2, 3, -7, 7)),
    Case("avg_pool1d", mod(lambda: nn.AvgPool1d(3, 2, 1)), rand(-2, 3, -7)),
    Case("avg_pool3d", mod(lambda: nn.AvgPool3d(2)), rand_by(2, 3, -4, 4, 4, step=2)),
    Case(
        "avg_pool3d-unbatched-ceil-divisor",
        mod(lambda: nn.AvgPool3d(2, ceil_mode=True, divisor_override=3)),
        rand(3, -3, 4, 5),
    ),
    Case(
        "avg_pool2d-ceil-exclude-pad",
        mod(lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
        rand(2, 3, -6, 6),
    ),
    Case("adaptive_avg_pool2d-1", mod(lambda: nn.AdaptiveAvgPool2d(1)), rand(-2, 3, -5, 4)),
    # -- convolutions: the backward is ours ------------------------------------------------
    Case("conv1d", lambda: nn.Conv1d(3, 4, 3), rand(-2, 3, -7)),
    Case("conv1d-unbatched", lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), rand(3, -8)),
    Case("conv1d-dilated", lambda: nn.Conv1d(3, 4, 3, dilation=2, bias=False), rand(2, 3, -9)),
    Case(
        "conv2d-strided-grouped",
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2),
        rand(-2, 4, -7, 6),
    ),
    Case("conv2d-same", lambda: nn.Conv2d(3, 4, (3, 2), padding="same"), rand(2, 3, -5, 6)),
    Case("conv2d-unbatched", lambda: nn.Conv2d(3, 4, 3), rand(3, -6, 5)),
    Case("conv2d-depthwise", lambda: nn.Conv2d(4, 4, 3, groups=4, padding=1), rand(2, 4, -5, 5)),
    Case("conv3d", lambda: nn.Conv3d(2, 3, 3, padding=1, stride=(1, 2, 1)), rand(2, 2, -4, 5, 4)),
    # strided over odd sizes, a 1x1 window's last position is the input's last (a
    # downsampling block's shortcut at an odd feature map)
    Case("conv2d-pointwise-strided", lambda: nn.Conv2d(20, 6, 1, stride=2), rand(2, 20, -5, 7)),
    # 1x1 at unit stride: the input is the weight gradient's patch, channels first
    Case("conv2d-pointwise", lambda: nn.Conv2d(20, 6, 1), rand(-2, 20, -5, 6)),
    Case(
        "conv_transpose1d",
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, output_padding=1),
        rand(-2, 3, -5),
    ),
    Case(
        "conv_transpose2d-grouped-dilated",
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2, dilation=2),
        rand(2, 4, -4, 5),
    ),
    Case("conv_transpose2d-unbatched", lambda: nn.ConvTranspose2d(3, 2, 2, 2), rand(3, -3, 4)),
    Case("conv_transpose3d", lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), rand(2, 2, -2, 3, 2)),
    # -- activations -----------------------------------------------------------------------
    Case("relu-1d", mod(nn.ReLU), rand(-7)),
    Case("relu-4d", mod(nn.ReLU), rand(-2, 3, 4, -3)),
    Case("threshold", mod(lambda: nn.Threshold(0.1, 20.0)), rand(-3, 5)),
    Case("gelu", mod(nn.GELU), rand(-3, 5)),
    Case("gelu-tanh", mod(lambda: nn.GELU("tanh")), rand(2, -3, 5)),
    Case("tanh", mod(nn.Tanh), rand(-4)),
    Case("sigmoid", mod(nn.Sigmoid), rand(-3, 2, 4)),
    Case("silu", mod(nn.SiLU), rand(-3, 5)),
    Case("softmax-last", mod(lambda: nn.Softmax(-1)), rand(-3, -5)),
    Case("softmax-first-1d", mod(lambda: nn.Softmax(0)), rand(-6)),
    Case("log_softmax", mod(lambda: nn.LogSoftmax(1)), rand(2, -4, 3)),
    # -- indexing: select and slice backwards as pads, diagonal by a mask -------------------
    Case("select", fn(lambda x: x[:, 1] * 2), rand(-3, 4)),
    Case("select-negative", fn(lambda x: x[..., -1] * 2), rand(2, -3, -4)),
    Case("select-first", fn(lambda x: x[0] * 2), rand(-3, 4)),
    Case("slice", fn(lambda x: x[:, 1:3] * 2), rand(-3, -5)),
    Case("slice-negative", fn(lambda x: x[:, -3:] * 2), rand(-3, -5)),
    Case("slice-both-ends", fn(lambda x: x[1:-1] * 2), rand(-4, 3)),
    Case("slice-stepped", fn(lambda x: x[:, ::2] * 2), rand(-3, -5)),
    Case("diagonal", fn(lambda x: x.diagonal() * 2), rand(-3, -4)),
    Case("diagonal-offset", fn(lambda x: x.diagonal(1) * 2), rand(-3, -4)),
    Case("diagonal-negative-offset", fn(lambda x: x.diagonal(-1) * 2), rand(-4, -3)),
    Case("diagonal-of-3d", fn(lambda x: x.diagonal(0, 0, 2) * 2), rand(-3, 2, -4)),
    # -- weight norm: the fused kernel's backward is ours ----------------------------------
    Case("weight_norm-linear", weight_normed(lambda: nn.Linear(4, 3), 0), rand(-2, 4)),
    Case("weight_norm-last-dim", weight_normed(lambda: nn.Linear(4, 3), -1), rand(-2, 4)),
    Case("weight_norm-conv1d", weight_normed(lambda: nn.Conv1d(3, 4, 3), 0), rand(2, 3, -5)),
    # -- normalisation ---------------------------------------------------------------------
    Case("layer_norm-2d", lambda: nn.LayerNorm(5), rand(-3, 5)),
    Case("layer_norm-3d-two-dims", lambda: nn.LayerNorm([3, 5]), rand(-2, 3, 5)),
    Case("layer_norm-1d", lambda: nn.LayerNorm(5, elementwise_affine=False), rand(5), sized=False),
    Case("layer_norm-no-bias", lambda: nn.LayerNorm(4, bias=False), rand(2, -3, 4)),
    Case("group_norm-2d", lambda: nn.GroupNorm(2, 4), rand(-3, 4)),
    Case("group_norm-3d", lambda: nn.GroupNorm(2, 4), rand(2, 4, -5)),
    Case("group_norm-4d-per-channel", lambda: nn.GroupNorm(4, 4), rand(-2, 4, 3, -3)),
    Case("group_norm-one-group", lambda: nn.GroupNorm(1, 4, affine=False), rand(2, 4, -3, 3)),
    # -- embedding -------------------------------------------------------------------------
    Case("embedding-1d", lambda: nn.Embedding(10, 4), ids(10, -5)),
    Case("embedding-2d-padding", lambda: nn.Embedding(10, 4, padding_idx=0), ids(4, 2, -6)),
    Case(
        "embedding-scale-by-frequency",
        lambda: nn.Embedding(10, 4, scale_grad_by_freq=True),
        ids(5, -3, 4),
    ),
    # -- losses (backwards ours over a batch of rows, `losses`; torch's elsewhere) -------
    Case(
        "nll_loss",
        fn(lambda x, t: F.nll_loss(F.log_softmax(x, 1), t)),
        with_target(rand(-4, 5), 5, lambda x: [x.shape[0]]),
    ),
    Case(
        "nll_loss-unbatched",
        fn(lambda x, t: F.nll_loss(F.log_softmax(x, 0), t)),
        with_target(rand(-5), 3, lambda x: []),
    ),
    Case(
        "nll_loss-sum-ignore-index",
        fn(lambda x, t: F.nll_loss(x, t, reduction="sum", ignore_index=1)),
        with_target(rand(-6, 4), 4, lambda x: [x.shape[0]]),
    ),
    Case(
        "nll_loss-weighted-none",
        fn(lambda x, t: F.nll_loss(x, t, torch.linspace(0.5, 2, 4), reduction="none")),
        with_target(rand(-6, 4), 4, lambda x: [x.shape[0]]),
    ),
    Case(
        "cross_entropy-ignore-index",
        fn(lambda x, t: F.cross_entropy(x, t, ignore_index=2)),
        with_target(rand(-6, 5), 5, lambda x: [x.shape[0]]),
    ),
    Case(
        "cross_entropy-weighted-sum",
        fn(lambda x, t: F.cross_entropy(x, t, torch.linspace(0.5, 2, 5), reduction="sum")),
        with_target(rand(-6, 5), 5, lambda x: [x.shape[0]]),
    ),
    Case(
        "cross_entropy-label-smoothing",
        fn(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1)),
        with_target(rand(-6, 5), 5, lambda x: [x.shape[0]]),
    ),
    Case(
        "nll_loss-3d",
        fn(lambda x, t: F.nll_loss(x, t, torch.linspace(0.5, 2, 4))),
        with_target(rand(-2, 4, -5), 4, lambda x: [x.shape[0], x.shape[2]]),
    ),
    Case(
        "nll_loss2d",
        fn(lambda x, t: F.nll_loss(x, t, ignore_index=0)),
        with_target(rand(2, 4, -3, 3), 4, lambda x: [x.shape[0], *x.shape[2:]]),
    ),
    Case(
        "cross_entropy-label-smoothing",
        fn(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1)),
        with_target(rand(-4, 5), 5, lambda x: [x.shape[0]]),
    ),
    Case("mse_loss", fn(F.mse_loss), with_float_target(rand(-3, 4))),
    Case(
        "mse_loss-none",
        fn(lambda x, t: F.mse_loss(x, t, reduction="none")),
        with_float_target(rand(-3)),
    ),
    Case(
        "smooth_l1_loss",
        fn(lambda x, t: F.smooth_l1_loss(x, t, beta=0.5, reduction="sum")),
        with_float_target(rand(-3, 4)),
    ),
    Case(
        "binary_cross_entropy",
        fn(lambda x, t: F.binary_cross_entropy(torch.sigmoid(x), t)),
        with_float_target(rand(-3, 4), unit=True),
    ),
    Case(
        "binary_cross_entropy-weighted",
        fn(
            lambda x, t: F.binary_cross_entropy(
                torch.sigmoid(x), t, t.detach() + 0.5, reduction="sum"
            )
        ),
        with_float_target(rand(-5), unit=True),
    ),
    # -- recurrent layers: one Scan per layer ----------------------------------------------
    Case("lstm", lambda: Then(nn.LSTM(4, 5), _lstm_out), rand(-3, 2, 4)),
    Case("lstm-unbatched", lambda: Then(nn.LSTM(4, 5), _lstm_out), rand(-3, 4)),
    Case(
        "lstm-batch-first-2-layers",
        lambda: Then(nn.LSTM(4, 5, 2, batch_first=True), _lstm_out),
        rand(-2, -3, 4),
    ),
    Case(
        "lstm-bidirectional",
        lambda: Then(nn.LSTM(4, 3, bidirectional=True), _lstm_out),
        rand(-3, -2, 4),
    ),
    Case("gru", lambda: Then(nn.GRU(4, 5), _gru_out), rand(-3, 2, 4)),
    Case("gru-unbatched", lambda: Then(nn.GRU(4, 5), _gru_out), rand(-3, 4)),
    Case(
        "gru-batch-first-bidirectional",
        lambda: Then(nn.GRU(4, 3, batch_first=True, bidirectional=True), _gru_out),
        rand(-2, -3, 4),
    ),
]


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []


def _params() -> list[object]:
    return [
        pytest.param(
            case, training, id=f"{case.name}-{'train' if training else 'eval'}", marks=case.marks
        )
        for case in CASES
        for training in case.modes
    ]


@pytest.mark.parametrize(("case", "training"), _params())
def test_the_entry_equals_eager_at_its_first_sizes_and_at_other_sizes(
    case: Case, training: bool
) -> None:
    torch.manual_seed(0)
    model = case.module().train(training)
    eager = copy.deepcopy(model)
    engine = ModuleEngine(model, PLAIN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call, v in enumerate(STEPS if case.sized else (0, 0)):
            gen = torch.Generator().manual_seed(call)
            inputs = case.inputs(v, gen)
            ours = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
            theirs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
            out, expected = _tensors(engine(*ours)), _tensors(eager(*theirs))
            where = f"call {call} ({[tuple(t.shape) for t in inputs]})"
            assert all(ran_in_plain_ort(t) for t in out), f"{where} ran elsewhere"
            assert len(out) == len(expected)
            for a, e in zip(out, expected, strict=True):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=where)
            cotangents = [torch.randn(e.shape, generator=gen) for e in expected]
            model.zero_grad()
            eager.zero_grad()
            torch.autograd.backward(out, cotangents)
            torch.autograd.backward(expected, cotangents)
            for k, (a, e) in enumerate(zip(ours, theirs, strict=True)):
                if e.requires_grad:
                    torch.testing.assert_close(
                        a.grad, e.grad, rtol=1e-4, atol=1e-5, msg=f"{where}: input {k}"
                    )
            for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
            for (name, b), c in zip(model.named_buffers(), eager.buffers(), strict=True):
                torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=f"{where}: {name}")
    dynamic = [r.dynamic for r in engine.records]
    assert dynamic[0] is False and any(dynamic[1:]) == case.sized, dynamic
