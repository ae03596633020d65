"""A cross entropy's gradient as operators of ours (`losses`): `nll_loss`'s and `log_softmax`'s
backwards one operator each, made one where the first feeds the second. Each graph runs in
ONNX Runtime to eager's numbers at every reduction, with and without class weights, with
ignored targets (all of them too), in float32 and float64; the fused gradient is two passes
over the logits, and where the pair does not meet (label smoothing, a log of a softmax, a
log-softmax under another loss) each keeps its own operator."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ort_autopatch.engine.backends.ort import losses
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, PlainCall, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)

OURS = torch.ops.ort_autopatch
F = nn.functional
ROWS, CLASSES = 12, 7
DTYPES = [torch.float32, torch.float64]


class _Loss(nn.Module):
    """A linear layer's logits into `loss(logits, target)`: the logits' gradient reaches the
    layer's parameters and the input."""

    def __init__(self, loss: Callable[..., torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(5, CLASSES, dtype=dtype)
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(self.linear(x), target)


def _backward_targets(plain: PlainCall) -> list[object]:
    assert plain.captured.backward is not None
    return [n.target for n in plain.captured.backward.graph.nodes if n.op == "call_function"]


def _targets(ignored: str, gen: torch.Generator) -> torch.Tensor:
    target = torch.randint(0, CLASSES, (ROWS,), generator=gen)
    if ignored == "some":
        target[::3] = -100
    elif ignored == "all":
        target[:] = -100
    return target


def _steps_like_eager(
    model: nn.Module, dtype: torch.dtype, ignored: str = "some"
) -> tuple[PlainCall, list[object]]:
    """Three calls through ORT and eagerly, each followed by a backward of a weighted sum:
    the loss, the input's and every parameter's gradient equal eager's (NaN where eager's
    is: a mean over no counted target). The capture, and its backward's operators."""
    gen = torch.Generator().manual_seed(0)
    eager = copy.deepcopy(model)
    x = torch.randn(ROWS, 5, dtype=dtype, generator=gen)
    plain = PlainCall(model, x.requires_grad_(), _targets(ignored, gen))
    for step in range(3):
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        x, target = torch.randn(ROWS, 5, dtype=dtype, generator=gen), _targets(ignored, gen)
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = plain(ours, target), eager(theirs, target)
        assert ran_in_plain_ort(out), f"step {step} did not run in ORT"
        torch.testing.assert_close(out, expected, equal_nan=True)
        weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).reshape(out.shape)
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        torch.testing.assert_close(ours.grad, theirs.grad, equal_nan=True)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, equal_nan=True, msg=name)
    return plain, _backward_targets(plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
def test_a_cross_entropy_trains_through_one_backward_operator_to_eagers_numbers(
    reduction: str, weighted: bool, ignored: str, dtype: torch.dtype
) -> None:
    weight = torch.linspace(0.5, 2, CLASSES, dtype=dtype) if weighted else None

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, weight, reduction=reduction)

    torch.manual_seed(0)
    _, backward = _steps_like_eager(_Loss(loss, dtype), dtype, ignored)
    assert backward.count(OURS.cross_entropy_backward.default) == 1
    assert OURS.nll_loss_backward.default not in backward
    assert OURS.log_softmax_backward.default not in backward


def test_the_fused_gradient_is_two_passes_over_the_logits() -> None:
    """The exponent of the log-probabilities, its product with each row's value, and those
    values added at the targets: no zeros made and no one-hot multiplied (torch's
    decompositions' `Expand`, `ScatterElements` and five passes more)."""
    import onnx

    torch.manual_seed(0)
    model = _Loss(lambda z, t: F.cross_entropy(z, t, ignore_index=3), torch.float32)
    gen = torch.Generator().manual_seed(0)
    plain = PlainCall(model, torch.randn(ROWS, 5, requires_grad=True), _targets("some", gen))
    graph = onnx.load_from_string(plain.lowered.backward).graph
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.value_info, *graph.output]
    }
    over_logits = [n.op_type for n in graph.node if shapes.get(n.output[0]) == [ROWS, CLASSES]]
    assert over_logits.count("Exp") == 1
    assert over_logits.count("ScatterElements") == 1
    assert "Expand" not in over_logits and "ConstantOfShape" not in over_logits
    scatter = next(n for n in graph.node if n.op_type == "ScatterElements")
    assert {a.name: a.s for a in scatter.attribute}.get("reduction") == b"add"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_label_smoothing_keeps_each_gradient_its_own_operator(dtype: torch.dtype) -> None:
    """With label smoothing the log-probabilities' gradient is the nll's plus the smoothing
    term's: the pair does not meet, and each operator translates on its own."""

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, label_smoothing=0.2)

    torch.manual_seed(0)
    _, backward = _steps_like_eager(_Loss(loss, dtype), dtype)
    assert OURS.cross_entropy_backward.default not in backward
    assert backward.count(OURS.nll_loss_backward.default) == 1
    assert backward.count(OURS.log_softmax_backward.default) == 1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nll_loss_of_other_log_probabilities_keeps_its_own_operator(reduction: str) -> None:
    """`nll_loss` of a log taken of a softmax: its gradient is ours alone (zeros with each
    row's value at its target), the softmax's torch's."""

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log(torch.softmax(logits, 1))
        weight = torch.linspace(2, 0.5, CLASSES)
        return F.nll_loss(log_probs, target, weight, reduction=reduction)

    torch.manual_seed(0)
    _, backward = _steps_like_eager(_Loss(loss, torch.float32), torch.float32)
    assert backward.count(OURS.nll_loss_backward.default) == 1
    assert OURS.cross_entropy_backward.default not in backward


class _LogSoftmax(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.25))
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(x * self.scale, self.dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "dim"),
    [((6,), 0), ((4, 6), 0), ((4, 6), -1), ((2, 3, 4), 1), ((2, 3, 4, 5), 2), ((2, 3, 4, 5), -1)],
    ids=str,
)
def test_a_log_softmax_under_another_loss_keeps_its_own_operator_at_every_rank(
    shape: tuple[int, ...], dim: int, dtype: torch.dtype
) -> None:
    """`log_softmax` over any dimension of any rank: its gradient is ours, to eager's
    numbers over three steps."""
    torch.manual_seed(0)
    model = _LogSoftmax(dim).to(dtype)
    eager = copy.deepcopy(model)
    plain = PlainCall(model, torch.randn(shape, dtype=dtype, requires_grad=True))
    assert _backward_targets(plain).count(OURS.log_softmax_backward.default) == 1
    for _ in range(3):
        for p in [*model.parameters(), *eager.parameters()]:
            p.grad = None
        x = torch.randn(shape, dtype=dtype)
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = plain(ours), eager(theirs)
        assert ran_in_plain_ort(out)
        torch.testing.assert_close(out, expected)
        weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).reshape(shape)
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        torch.testing.assert_close(ours.grad, theirs.grad)
        torch.testing.assert_close(model.scale.grad, eager.scale.grad)


def test_the_operators_apply_to_a_batch_of_rows_of_one_float_type() -> None:
    rows, target, scalar = torch.randn(4, 3), torch.tensor([0, 2, 1, 0]), torch.tensor(1.0)
    assert losses.applies_nll(scalar, rows, target, None, losses.MEAN, scalar)
    assert losses.applies_nll(torch.randn(4), rows, target, torch.ones(3), losses.NONE, scalar)
    assert not losses.applies_nll(scalar, rows[0], target[0], None, losses.MEAN, scalar)  # one row
    assert not losses.applies_nll(  # a spatial loss: `nll_loss2d`'s shape
        scalar, torch.randn(4, 3, 2), torch.zeros(4, 2, dtype=torch.int64), None, 1, scalar
    )
    assert not losses.applies_nll(scalar, rows.half(), target, None, losses.MEAN, scalar.half())
    assert not losses.applies_nll(scalar, rows, target.int(), None, losses.MEAN, scalar)
    assert not losses.applies_nll(scalar, rows, target, torch.ones(3).double(), 1, scalar)


def test_a_symbolic_batch_keeps_torchs_decomposition_and_guards_nothing() -> None:
    """A batch of symbolic size is torch's decomposition's (the translations declare static
    sizes), decided before any size is compared: a comparison of a symbol would add a guard,
    and a guard would tie the graph to the sizes it was traced at."""
    from ort_autopatch.engine.backends.ort import symbolic

    rows, target = torch.randn(4, 3), torch.tensor([0, 2, 1, 0])
    env, (fake_rows, fake_target) = symbolic.fake_inputs([rows, target], [{0}, {0}])
    scalar = torch.tensor(1.0)
    with fake_rows.fake_mode:
        fake_scalar = fake_rows.fake_mode.from_tensor(scalar)
        assert not losses.applies_nll(
            fake_scalar, fake_rows, fake_target, None, losses.MEAN, fake_scalar
        )
    assert not env.guards
