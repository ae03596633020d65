"""Input variety: every call of a patched model equals eager PyTorch (outputs and gradients,
1e-5), whatever sizes, branches and attributes it meets, and the report says where it ran.

Each model hides one trace hazard: sizes turned into Python values, loops over a dimension,
data-dependent branches, split over time, tensor attributes, MultiheadAttention and
TransformerEncoderLayer with a new length each call.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import random
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from torch import nn

from ort_autopatch import patcher, report
from tests.helpers import class_stats, patched, plain_backend

TOL = {"rtol": 1e-5, "atol": 1e-5}
# The plain backend traces a key's first graph for the call's shapes, and from the second
# shape on the dimensions that varied as symbols (engine/sizes.py): its graph counts differ
# from the training build's, whose first graph serves every size its checks allow.
PLAIN = plain_backend()


def _line_of(cls: type, text: str) -> str:
    """`file:line` of the first line of `cls`'s source containing `text`."""
    lines, start = inspect.getsourcelines(cls)
    offset = next(k for k, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(cls)}:{start + offset}"


class LenScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / len(x)  # hazard: len


class UnrolledRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.RNNCell(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 6)
        outputs = []
        for t in range(x.size(1)):  # hazard: loop over a dimension
            h = self.cell(x[:, t], h)
            outputs.append(h)
        return torch.stack(outputs, 1)


class IntOfShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[1])  # hazard: int of a size
        return self.fc(x)[:, : n // 2].sum(1)


class LengthThreshold(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(1) > 4:  # hazard: a branch on a size
            return self.fc(x).sum(1)
        return self.fc(x).mean(1)


class DataBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 0).all()):  # hazard: a branch on values
            return self.fc(x)
        return self.fc(x.abs()) * 2


class SplitOverTime(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.split(x, 1, dim=1)  # hazard: split over time
        return torch.cat([torch.tanh(self.fc(s)) for s in steps], 1)


class TensorAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.0)
        self.scale = torch.ones(4)  # a plain tensor attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)) * self.scale


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class TokenEncoder(nn.Module):
    """Embedding + TransformerEncoderLayer + a head: a small language model."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(tokens)))


PATCHED = (
    LenScale,
    UnrolledRNN,
    IntOfShape,
    LengthThreshold,
    DataBranch,
    SplitOverTime,
    TensorAttribute,
    Attention,
    Encoder,
    TokenEncoder,
)


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched(PATCHED)


def _hazards(cls: type) -> set[tuple[str, str]]:
    return {(kind, where) for kind, _, where in class_stats(cls).trace_hazards}


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros(()) for p in model.parameters()]


def _compare_calls(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda y: (y * y).sum(),
) -> None:
    """Call the patched model and its eager twin on each input: outputs, input gradients and
    parameter gradients equal to 1e-5, call after call."""
    twin = copy.deepcopy(model)
    forward = type(model).forward
    for k, x in enumerate(inputs):
        a = x.clone().requires_grad_(x.is_floating_point())
        b = x.clone().requires_grad_(x.is_floating_point())
        model.zero_grad()
        twin.zero_grad()
        out = model(a)
        expected = forward(twin, b)
        torch.testing.assert_close(out, expected, **TOL, msg=lambda m, k=k: f"call {k}: {m}")
        loss(out).backward()
        loss(expected).backward()
        for got, want in zip(_grads(model), _grads(twin), strict=True):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=k: f"call {k} grad: {m}")
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, **TOL)


def _lengths(*sizes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*size, generator=g) for size in sizes]


def test_len_of_the_batch_gives_each_batch_size_its_own_graph() -> None:
    torch.manual_seed(0)
    model = LenScale()
    _compare_calls(model, _lengths((2, 4), (5, 4), (2, 4), (3, 4)))
    stats = class_stats(LenScale)
    assert stats.ort_calls == 4 and not stats.eager_calls
    # 2, 5 and 3 rows; the graph for 2 rows is reused. The graph for 2 rows is the first,
    # traced for its shapes whatever the model. The training build's next graph serves every
    # batch size whose rows give the traced len(x), 5 only: 3 rows get a graph per shape. The
    # plain backend traces 5 and 3 rows per shape.
    assert stats.per_shape_graphs == (2 if PLAIN else 1)
    assert (("shape", _line_of(LenScale, "len(x)"))) in _hazards(LenScale)


def test_a_loop_over_time_runs_each_length_through_its_own_graph() -> None:
    torch.manual_seed(0)
    model = UnrolledRNN()
    _compare_calls(model, _lengths((2, 3, 4), (2, 5, 4), (3, 3, 4), (2, 5, 4)))
    stats = class_stats(UnrolledRNN)
    assert stats.ort_calls == 4 and not stats.eager_calls
    assert ("shape", _line_of(UnrolledRNN, "range(x.size(1))")) in _hazards(UnrolledRNN)
    assert stats.per_shape_graphs >= 2
    assert any("sizes change a traced value" in r for r in stats.rebuilds)


def test_int_of_a_size_is_recomputed_for_every_call() -> None:
    torch.manual_seed(0)
    model = IntOfShape()
    _compare_calls(model, _lengths((2, 6, 4), (2, 8, 4), (4, 6, 4)))
    assert class_stats(IntOfShape).ort_calls == 3
    assert ("shape", _line_of(IntOfShape, "int(x.shape[1])")) in _hazards(IntOfShape)


def test_a_branch_on_a_size_keeps_one_graph_until_the_branch_flips() -> None:
    torch.manual_seed(0)
    model = LengthThreshold()
    _compare_calls(model, _lengths((2, 2, 4), (3, 3, 4), (2, 4, 4), (2, 6, 4), (2, 3, 4)))
    stats = class_stats(LengthThreshold)
    assert stats.ort_calls == 5 and not stats.eager_calls
    assert ("shape", _line_of(LengthThreshold, "x.size(1) > 4")) in _hazards(LengthThreshold)


def test_a_branch_on_values_runs_in_pytorch_with_the_reason_and_place() -> None:
    torch.manual_seed(0)
    model = DataBranch()
    g = torch.Generator().manual_seed(1)
    positive = torch.rand(3, 4, generator=g) + 0.1
    mixed = torch.randn(3, 4, generator=g)
    _compare_calls(model, [positive, mixed, positive, mixed])
    stats = class_stats(DataBranch)
    assert stats.ort_calls == 0
    assert stats.eager_calls["fallback: data-dependent control flow"] == 4
    assert ("value", _line_of(DataBranch, "bool((x > 0).all())")) in _hazards(DataBranch)
    (detail,) = {d for r, d in stats.fallbacks if r == "data-dependent control flow"}
    assert _line_of(DataBranch, "bool((x > 0).all())") in detail


def test_split_over_time_gives_each_length_its_own_graph() -> None:
    torch.manual_seed(0)
    model = SplitOverTime()
    _compare_calls(model, _lengths((2, 3, 4), (2, 5, 4), (2, 3, 4), (2, 7, 4)))
    stats = class_stats(SplitOverTime)
    assert stats.ort_calls == 4 and not stats.eager_calls
    # 3, 5 and 7 steps. The graph for 3 steps is the first, traced for its shapes whatever the
    # model. The training build's next graph checks the number of pieces the split gave (5),
    # so 7 steps get a graph per shape; the plain backend traces 5 and 7 steps per shape.
    assert stats.per_shape_graphs == (2 if PLAIN else 1)
    assert ("shape", _line_of(SplitOverTime, "torch.split")) in _hazards(SplitOverTime)


@pytest.mark.parametrize("cls", [Attention, Encoder])
def test_attention_runs_every_new_length_in_one_graph(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = cls()
    sizes = [(3, 5, 8), (3, 7, 8), (2, 9, 8), (4, 2, 8), (3, 5, 8)]
    _compare_calls(model, _lengths(*sizes))
    stats = class_stats(cls)
    assert stats.ort_calls == len(sizes) and not stats.eager_calls
    # the first call's shapes, then (training build) the dynamic graph for the others, or
    # (plain) a graph symbolic in the length (second call) and one symbolic in batch and length
    # (third call: the batch varies too), which admit the rest
    assert stats.exports == (3 if PLAIN else 2) and stats.per_shape_graphs == 0
    assert not any(kind == "value" for kind, _ in _hazards(cls))


def test_a_tensor_attribute_replaced_or_changed_in_place_rebuilds_and_never_crashes() -> None:
    torch.manual_seed(0)
    model = TensorAttribute()
    twin = copy.deepcopy(model)
    x = _lengths((3, 4))[0]

    def same() -> None:
        torch.testing.assert_close(model(x), type(model).forward(twin, x), **TOL)

    same()
    for change in (
        lambda m: setattr(m, "scale", torch.full((4,), 2.0)),  # replaced, same shape
        lambda m: setattr(m, "scale", torch.full((1,), 3.0)),  # replaced, another shape
        lambda m: m.scale.mul_(-1.0),  # changed in place
        lambda m: setattr(m, "scale", torch.full((4,), 2.0, dtype=torch.float64)),
    ):
        change(model)
        change(twin)
        same()
    stats = class_stats(TensorAttribute)
    if plain_backend():  # the maintained onnxruntime has float64 gradient kernels: in ORT
        assert stats.ort_calls == 5 and not stats.eager_calls
    else:
        # The float64 attribute makes a float64 training graph, which ORT's CPU build cannot
        # differentiate: that call runs in PyTorch with the dtype named, never a crash.
        assert stats.ort_calls == 4
        assert sum(stats.eager_calls.values()) == 1
        assert any("float64" in cause for _, cause in stats.fallbacks)
    assert stats.rebuilds["attribute TensorAttribute.scale written"] >= 3


def test_a_tensor_attribute_that_requires_grad_runs_in_pytorch_with_its_gradient() -> None:
    """A graph holds a tensor attribute as a constant, which has no gradient: a tensor the
    script optimises itself (not a parameter) gets eager's gradient from PyTorch, named."""
    torch.manual_seed(0)
    model = TensorAttribute()
    model.scale.requires_grad_()
    twin = copy.deepcopy(model)
    x = _lengths((3, 4))[0]
    model(x).sum().backward()
    type(twin).forward(twin, x).sum().backward()
    torch.testing.assert_close(model.scale.grad, twin.scale.grad, **TOL)
    stats = class_stats(TensorAttribute)
    assert stats.ort_calls == 0 and sum(stats.eager_calls.values()) == 1
    assert any("requires grad" in cause for _, cause in stats.fallbacks)


def test_eval_between_training_steps_reads_as_a_mode_change() -> None:
    torch.manual_seed(0)
    model = TensorAttribute()
    twin = copy.deepcopy(model)
    x = _lengths((3, 4))[0]
    for mode in (True, False, True):
        model.train(mode)
        twin.train(mode)
        torch.testing.assert_close(model(x), type(model).forward(twin, x), **TOL)
    stats = class_stats(TensorAttribute)
    assert stats.rebuilds == {"train/eval mode changed": 1}
    assert stats.ort_calls == 3


def test_400_steps_of_random_batch_sizes_and_lengths_stay_in_ort_with_eager_losses() -> None:
    """Embedding + TransformerEncoderLayer, a new batch size and length every step."""
    torch.manual_seed(0)
    model = TokenEncoder()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    forward = type(model).forward
    for step in range(400):
        batch, length = rng.randint(1, 6), rng.randint(2, 12)
        tokens = torch.randint(0, 32, (batch, length), generator=g)
        targets = torch.randint(0, 32, (batch, length), generator=g)
        losses = []
        for net, optimizer, call in ((model, opt, model), (twin, opt_twin, None)):
            optimizer.zero_grad()
            logits = call(tokens) if call is not None else forward(net, tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-5), f"step {step}"
    stats = class_stats(TokenEncoder)
    total = stats.ort_calls + sum(stats.eager_calls.values())
    assert stats.ort_calls >= 0.95 * total
    assert stats.exports + stats.cache_loads <= 3


# -- --verify: the user's own proof ---------------------------------------------------------

SCALE = 2.0  # a module-level global forward reads: no guard can see it change


class ReadsAGlobal(nn.Module):
    """A model the tool gets wrong without --verify: the graph bakes the global's value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * SCALE


@dataclasses.dataclass
class Scaled:
    y: torch.Tensor


class ReturnsADataclass(nn.Module):
    """The same stale graph, its output inside the user's dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Scaled:
        return Scaled(self.fc(x) * SCALE)


@pytest.fixture
def verifying() -> Iterator[None]:
    from ort_autopatch.engine import EngineOptions

    for cls in (ReadsAGlobal, ReturnsADataclass):
        patcher.patch(cls, patcher.Settings(engine=EngineOptions(verify=3)))
    yield
    for cls in (ReadsAGlobal, ReturnsADataclass):
        patcher.unpatch(cls)


@pytest.mark.usefixtures("verifying")
def test_verify_compares_the_tensors_inside_a_dataclass_output() -> None:
    global SCALE
    model = ReturnsADataclass()
    x = _lengths((3, 4))[0]
    model(x)
    SCALE = 3.0
    try:
        torch.testing.assert_close(model(x).y, type(model).forward(model, x).y)
    finally:
        SCALE = 2.0
    stats = class_stats(ReturnsADataclass)
    assert stats.verify_mismatches == 1
    assert stats.eager_calls["fallback: verification mismatch"] == 1


@pytest.mark.usefixtures("verifying")
def test_verify_catches_a_graph_that_went_stale_and_sends_its_calls_to_pytorch() -> None:
    global SCALE
    torch.manual_seed(0)
    model = ReadsAGlobal()
    x = _lengths((3, 4))[0]
    torch.testing.assert_close(model(x), type(model).forward(model, x))
    SCALE = 3.0
    try:
        for _ in range(2):
            torch.testing.assert_close(model(x), type(model).forward(model, x))
    finally:
        SCALE = 2.0
    stats = class_stats(ReadsAGlobal)
    assert stats.ort_calls == 1
    assert stats.eager_calls["fallback: verification mismatch"] == 2
    assert stats.verified_calls == 2 and stats.verify_mismatches == 1
    assert stats.verify_worst["output_rel"] == pytest.approx(1 / 3, rel=1e-3)  # 2x against 3x
    assert report.snapshot()[patcher.class_name(ReadsAGlobal)]["verify"]["mismatches"] == 1


def _encoder_calls(verify: int) -> tuple[torch.Tensor, list[torch.Tensor], report.ClassStats]:
    """Five calls of a fresh TokenEncoder (two lengths) under `--verify verify`: the RNG
    state afterwards, the accumulated gradients and the class's counters."""
    from ort_autopatch.engine import EngineOptions

    report.reset()
    patcher.unpatch(TokenEncoder)
    patcher.patch(TokenEncoder, patcher.Settings(engine=EngineOptions(verify=verify)))
    torch.manual_seed(0)
    model = TokenEncoder()
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    for length in (7, 5, 9, 7, 6):
        model(tokens[:, :length]).sum().backward()
    return torch.random.get_rng_state(), _grads(model), class_stats(TokenEncoder)


def test_verify_reports_the_worst_difference_and_leaves_the_users_state_alone() -> None:
    rng, grads, stats = _encoder_calls(verify=3)
    plain_rng, plain_grads, _ = _encoder_calls(verify=0)
    assert torch.equal(rng, plain_rng)  # the user's random stream, as without --verify
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)  # accumulated once per call, not thrice
    assert stats.ort_calls == 5 and not stats.eager_calls
    # the first 3 calls of each key: the first length's graph (7, twice) and the graph for
    # the other lengths (5, 9, 6)
    assert stats.verified_calls == 5 and stats.verify_mismatches == 0
    assert 0 < stats.verify_worst["grad_rel"] < 1e-4
    assert 0 < stats.verify_worst["output_rel"] < 1e-4


def test_verify_says_a_graph_with_dropout_was_not_verified() -> None:
    from ort_autopatch.engine import EngineOptions

    patcher.unpatch(TensorAttribute)
    patcher.patch(TensorAttribute, patcher.Settings(engine=EngineOptions(verify=3)))
    model = TensorAttribute()
    model.drop.p = 0.5
    model(_lengths((3, 4))[0]).sum().backward()
    stats = class_stats(TensorAttribute)
    assert stats.verified_calls == 0
    assert stats.unverified == {"random operators (Dropout)": 1}


class ConvBatchNorm(nn.Module):
    """resnet's stem in small: eager's BatchNorm saves its running statistics for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))).mean((2, 3))


def test_verify_on_a_batchnorm_model_leaves_training_and_statistics_as_eager() -> None:
    from ort_autopatch.engine import EngineOptions

    report.reset()
    patcher.patch(ConvBatchNorm, patcher.Settings(engine=EngineOptions(verify=2)))
    try:
        torch.manual_seed(0)
        model = ConvBatchNorm()
        eager = copy.deepcopy(model)
        for step in range(3):
            x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(step))
            model(x).square().sum().backward()
            type(eager).forward(eager, x).square().sum().backward()
        stats = class_stats(ConvBatchNorm)
        assert stats.ort_calls == 3 and not stats.eager_calls and not stats.fallbacks
        assert stats.verified_calls == 2 and stats.verify_mismatches == 0
        assert not stats.unverified
        # verification ran each call three times; the statistics moved once per call
        assert int(model.bn.num_batches_tracked) == 3
        torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean, **TOL)
        torch.testing.assert_close(model.bn.running_var, eager.bn.running_var, **TOL)
        for got, want in zip(_grads(model), _grads(eager), strict=True):
            torch.testing.assert_close(got, want, **TOL)
    finally:
        patcher.unpatch(ConvBatchNorm)
        report.reset()


class EagerSideFails(nn.Module):
    """Its eager forward raises (the trace does not: the training build's TorchScript trace,
    the plain backend's aot trace, which torch.compiler.is_compiling() tells): the comparison
    cannot be made."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
            raise ValueError("only the traced forward works")
        return self.fc(x)


def test_a_verification_that_cannot_be_made_is_reported_and_the_call_runs() -> None:
    from ort_autopatch.engine import EngineOptions

    report.reset()
    patcher.patch(EagerSideFails, patcher.Settings(engine=EngineOptions(verify=1)))
    try:
        EagerSideFails()(torch.randn(3, 4)).sum().backward()
        stats = class_stats(EagerSideFails)
        assert stats.ort_calls == 1 and stats.verified_calls == 0
        assert stats.unverified == {
            "verification failed: ValueError: only the traced forward works": 1
        }
    finally:
        patcher.unpatch(EagerSideFails)
        report.reset()
