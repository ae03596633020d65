"""Torch inside the graph: custom autograd Functions and operators ONNX Runtime cannot export or
differentiate run as torch-calling nodes (PythonOp) inside the ORT graph, forward and backward.

Every test trains through `ModuleEngine`, which raises instead of falling back, so a pass means
the module ran in ONNX Runtime; the build records name the operators that ran through torch.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ort_autopatch.engine import (
    EngineOptions,
    ExecutionError,
    ExportError,
    ModuleEngine,
    is_exporting,
)
from ort_autopatch.engine.backends.ort_training import agent
from ort_autopatch.engine.backends.ort_training.torch_in_graph import nodes
from tests.helpers import assert_training_parity, plain_backend
from tests.test_engine_parity import LSTMSequenceModel

pytest.importorskip("onnxruntime")
pytestmark = [
    pytest.mark.skipif(
        nodes.supported_platform() is not None, reason="torch-calling nodes need x86-64 Linux"
    ),
    pytest.mark.skipif(
        plain_backend(),
        reason="torch-calling nodes (PythonOp, ATen) live in the training build's graphs; the "
        "plain backend cuts its graphs at such operators instead (tests/test_plain_torch_nodes.py)",
    ),
]

STEPS = 4
RTOL = 1e-5
ATOL = 1e-5  # the parity bound; float32 products differ by ulps across CPUs (MKL vs MLAS)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + step)


def _batch(step: int) -> int:
    return (3, 5, 2, 4)[step % 4]  # a new batch size on most calls


def _torch_nodes(engine: ModuleEngine) -> dict[str, int]:
    found: dict[str, int] = {}
    for record in engine.records:
        found.update(record.torch_nodes)
    return found


# -- custom autograd Functions ----------------------------------------------------------------
class StraightThrough(torch.autograd.Function):
    """Rounds in forward, passes the gradient through where |x| <= 1 (a quantiser's STE)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1).to(grad.dtype), None


class Quantised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(StraightThrough.apply(torch.tanh(self.a(x)) * 1.5, 4.0))


@pytest.mark.parametrize("device", DEVICES)
def test_straight_through_estimator_runs_its_own_backward_in_the_graph(device: str) -> None:
    torch.manual_seed(0)
    run = assert_training_parity(
        Quantised().to(device),
        lambda s: ((torch.randn(_batch(s), 8, generator=_gen(s)).to(device),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )
    assert _torch_nodes(run.engine) == {f"Function {__name__}.StraightThrough": 1}


class Scaled(torch.autograd.Function):
    """Non-tensor arguments of every kind; the gradient depends on each of them."""

    @staticmethod
    def forward(ctx, x, alpha: float, dims: tuple[int, ...], flip: bool, mode: str, w):  # type: ignore[override]
        ctx.save_for_backward(w)
        ctx.alpha, ctx.dims, ctx.flip, ctx.mode = alpha, dims, flip, mode
        y = x * w * alpha
        if flip:
            y = torch.flip(y, dims)
        return y if mode == "plain" else y.tanh()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (w,) = ctx.saved_tensors
        if ctx.flip:
            grad = torch.flip(grad, ctx.dims)
        gx = grad * w * ctx.alpha * 3.0  # deliberately not the true derivative
        gw = grad.sum(0) if ctx.needs_input_grad[5] else None
        return gx, None, None, None, None, gw


class WithArguments(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Scaled.apply(self.fc(x), 1.0 / 3.0, (1,), True, "plain", self.w)


def test_function_with_non_tensor_arguments_keeps_them_exact() -> None:
    torch.manual_seed(1)
    run = assert_training_parity(
        WithArguments(),
        lambda s: ((torch.randn(_batch(s), 6, generator=_gen(s), requires_grad=True),), {}),
        steps=STEPS,
        rtol=1e-6,  # 1/3 as a float32 attribute would be off by 1e-8 relative: kept as Python
        atol=1e-7,
    )
    assert list(_torch_nodes(run.engine)) == [f"Function {__name__}.Scaled"]


class TopWithIndex(torch.autograd.Function):
    """Two outputs, one marked non-differentiable; records what needs_input_grad said."""

    seen: list[tuple[bool, ...]] = []

    @staticmethod
    def forward(ctx, x, bias):  # type: ignore[override]
        values, index = (x + bias).max(dim=-1)
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        ctx.mark_non_differentiable(index)
        if not is_exporting():  # not the export's own trace, which needs no gradient
            TopWithIndex.seen.append(tuple(ctx.needs_input_grad))
        return values, index

    @staticmethod
    def backward(ctx, grad_values, grad_index):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        grad = torch.zeros(ctx.shape, dtype=grad_values.dtype)
        grad.scatter_(-1, index.unsqueeze(-1), grad_values.unsqueeze(-1))
        return grad, None


class Picker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, index = TopWithIndex.apply(self.fc(x), bias)
        return values * 2, index


def test_function_sees_needs_input_grad_and_non_differentiable_outputs() -> None:
    torch.manual_seed(2)
    TopWithIndex.seen.clear()
    assert_training_parity(
        Picker(),
        lambda s: ((torch.randn(_batch(s), 5, generator=_gen(s)), torch.randn(7)), {}),
        loss_fn=lambda out: out[0].sum(),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )
    # eager and ORT calls alike: the bias needs no gradient, the activations do
    assert set(TopWithIndex.seen) == {(True, False)}


class DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * 2


class Dirty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return DoubleInPlace.apply(h.clone()) + h  # the graph's own h must stay unchanged


def test_function_writing_its_input_in_place_leaves_the_graph_values_alone() -> None:
    torch.manual_seed(3)
    assert_training_parity(
        Dirty(),
        lambda s: ((torch.randn(_batch(s), 4, generator=_gen(s)),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )


class ReturnsShape(torch.autograd.Function):
    """Returns a Python int beside its tensor: the int is a constant of the trace."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2, x.shape[1]

    @staticmethod
    def backward(ctx, grad, _):  # type: ignore[override]
        return grad * 2


class WithInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, n = ReturnsShape.apply(self.fc(x))
        return y * n


def test_function_returning_a_python_value_beside_its_tensor() -> None:
    assert_training_parity(
        WithInt(),
        lambda s: ((torch.randn(_batch(s), 3, generator=_gen(s), requires_grad=True),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )


class FromList(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, extras):  # type: ignore[override]
        return x + extras[0]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class Hidden(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FromList.apply(x, [x * 2])


def test_function_that_cannot_be_taken_names_itself_in_the_error() -> None:
    engine = ModuleEngine(Hidden())
    with pytest.raises(ExportError, match="FromList takes a tensor inside a list"):
        engine(torch.randn(3, 2, requires_grad=True))


def test_function_in_eval_and_no_grad_runs_forward_only() -> None:
    torch.manual_seed(4)
    model = Quantised()
    engine = ModuleEngine(copy.deepcopy(model))
    x = torch.randn(5, 8)
    live = nodes.live_contexts()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), model(x), rtol=RTOL, atol=ATOL)
    engine_model = engine._module()
    assert engine_model is not None
    engine_model.eval()
    model.eval()
    torch.testing.assert_close(engine(x), model(x), rtol=RTOL, atol=ATOL)
    assert nodes.live_contexts() == live  # forward-only graphs keep no torch graph


def test_forward_without_backward_frees_the_torch_graphs() -> None:
    engine = ModuleEngine(Cumulative())
    live = nodes.live_contexts()
    out = engine(torch.randn(3, 6))
    assert nodes.live_contexts() == live + 2
    del out  # never backpropagated
    assert nodes.live_contexts() == live


def test_error_inside_a_torch_calling_node_is_reported_with_its_cause() -> None:
    class Fails(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            if not is_exporting():
                raise ValueError("boom from the user's Function")
            return x * 2

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return grad

    class UsesIt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Fails.apply(x) + 1

    engine = ModuleEngine(UsesIt())
    live = nodes.live_contexts()
    with pytest.raises(ExecutionError, match="boom from the user's Function") as info:
        engine(torch.randn(2, 2, requires_grad=True))
    assert isinstance(info.value.__cause__, ValueError)
    assert nodes.live_contexts() == live


class SqueezeExcite(nn.Module):
    """mobilenet_v3's block: hardswish features times a hardsigmoid channel scale, both
    torch-calling nodes, broadcast over the spatial axes (and added, for Add's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.reduce = nn.Conv2d(8, 4, 1)
        self.expand = nn.Conv2d(4, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.hardswish(self.conv(x))
        s = F.adaptive_avg_pool2d(h, 1)
        s = F.hardsigmoid(self.expand(F.relu(self.reduce(s))))
        return h * s + s


def test_two_torch_calling_nodes_feeding_a_broadcasting_op_get_reduced_gradients() -> None:
    torch.manual_seed(11)

    def inputs(step: int):
        size = (2, 4, 3, 5)[step % 4]  # the broadcast axes change size from call to call
        return (torch.randn(_batch(step), 3, size, size + 1, generator=_gen(step)),), {}

    run = assert_training_parity(SqueezeExcite(), inputs, steps=STEPS, rtol=RTOL, atol=ATOL)
    assert {"aten::hardswish", "aten::hardsigmoid"} <= set(_torch_nodes(run.engine))


class SqueezeExciteStack(nn.Module):
    """Two squeeze-excitation blocks of different widths, as mobilenet_v3 stacks them."""

    def __init__(self) -> None:
        super().__init__()
        self.widen = nn.Conv2d(8, 24, 1)
        self.first, self.second = SqueezeExcite(), SqueezeExcite()
        self.second.conv = nn.Conv2d(3, 24, 3, padding=1)
        self.second.reduce, self.second.expand = nn.Conv2d(24, 4, 1), nn.Conv2d(4, 24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.second(h[:, :3]) + self.widen(h)


def test_torch_calling_nodes_of_different_sizes_in_an_inference_graph() -> None:
    # ORT's memory planner took every PythonOp output's sizes for equal: "Shape mismatch
    # attempting to re-use buffer. {4,96,1,1} != {4,240,1,1}" in mobilenet_v3's eval call
    torch.manual_seed(13)
    model = SqueezeExciteStack()
    trained = copy.deepcopy(model)
    engine = ModuleEngine(trained)
    engine(torch.randn(2, 3, 6, 5)).sum().backward()  # learns to route both to torch
    model.eval()
    trained.eval()
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(_batch(step), 3, 6, 5, generator=_gen(step))
            torch.testing.assert_close(engine(x), model(x), rtol=RTOL, atol=ATOL)
    assert {"aten::hardswish", "aten::hardsigmoid"} <= set(_torch_nodes(engine))


def test_a_failed_backward_is_reported_and_later_calls_run_in_pytorch() -> None:
    from ort_autopatch import patcher, report

    class FailsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x * 2

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            raise ValueError("boom in the user's backward")

    class BackwardFails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return FailsInBackward.apply(self.fc(x)) if not self.eager else self.fc(x) * 2

        eager = False

    report.reset()
    patcher.patch(BackwardFails)
    try:
        model = BackwardFails()
        name = patcher.class_name(BackwardFails)
        out = model(torch.randn(3, 4))
        assert report.snapshot()[name]["ort_calls"] == 1
        # the forward ran in ORT: this step's backward cannot run in PyTorch instead
        with pytest.raises(ExecutionError, match="failed in backward: ValueError: boom"):
            out.sum().backward()
        entry = report.snapshot()[name]
        assert [f["detail"] for f in entry["fallbacks"]] == [
            "a torch-calling node failed in backward: ValueError: boom in the user's backward"
        ]
        BackwardFails.eager = True  # the eager forward of the later calls can be differentiated
        model(torch.randn(3, 4)).sum().backward()
        entry = report.snapshot()[name]
        assert entry["ort_calls"] == 1 and entry["eager_calls"] == 1
        assert entry["eager_reasons"] == [{"reason": "fallback: execution failed", "count": 1}]
        with torch.no_grad():  # inference graphs have no backward to fail
            model(torch.randn(3, 4))
        assert report.snapshot()[name]["ort_calls"] == 2
    finally:
        patcher.unpatch(BackwardFails)
        report.reset()


# -- operators ORT cannot export or differentiate ----------------------------------------------
class Cumulative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.cummax(h, dim=1).values + torch.cummin(h, dim=0).values


@pytest.mark.parametrize("device", DEVICES)
def test_cummax_and_cummin_train_with_eager_gradients(device: str) -> None:
    torch.manual_seed(5)
    run = assert_training_parity(
        Cumulative().to(device),
        lambda s: ((torch.randn(_batch(s), 6, generator=_gen(s)).to(device),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )
    assert _torch_nodes(run.engine) == {"aten::cummax": 1, "aten::cummin": 1}


class WideCumulative(nn.Module):
    """Large tensors around a torch-calling node: ORT's kernels before and after it take long
    enough on a GPU that a node launched on another stream would read unfinished values."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(1024, 1024)
        self.b = nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.cummax(self.a(x).relu(), dim=1).values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a GPU")
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_torch_node_is_ordered_with_ort_on_the_sessions_stream(side_stream: bool) -> None:
    torch.manual_seed(6)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):  # the caller's own stream, as a user's pipeline may have
        run = assert_training_parity(
            WideCumulative().cuda(),
            lambda s: ((torch.randn(512 + 64 * s, 1024, generator=_gen(s)).cuda(),), {}),
            steps=3,
            rtol=1e-4,
            atol=1e-5,
        )
    assert _torch_nodes(run.engine) == {"aten::cummax": 1}


class Reductions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        values, _ = torch.max(h, dim=1)
        return values + h.amin(dim=1) + torch.min(h) + torch.einsum("bi,bi->b", h, x)


def test_max_min_reductions_and_einsum_train_with_eager_gradients() -> None:
    torch.manual_seed(6)
    assert_training_parity(
        Reductions(),
        lambda s: ((torch.randn(_batch(s), 6, generator=_gen(s), requires_grad=True),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )


class Bits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        mask = (flags | 4) ^ (flags & 1)
        return self.fc(x) * mask.to(x.dtype)


def test_integer_bitwise_operators_run_in_the_graph() -> None:
    torch.manual_seed(7)

    def inputs(s: int):
        b = _batch(s)
        return (
            torch.randn(b, 6, generator=_gen(s)),
            torch.randint(0, 8, (b, 6), generator=_gen(s)),
        ), {}

    run = assert_training_parity(Bits(), inputs, steps=STEPS, rtol=RTOL, atol=ATOL)
    assert set(_torch_nodes(run.engine)) >= {"aten::__or_"}


class BitsOfAnAttribute(nn.Module):
    """ORTModule's API test: integer bitwise operators of a plain tensor attribute (traced as
    a constant); int32 flags against the int64 attribute promote to int64, as in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.other = torch.tensor([1, 2, 4, 8, 3, 5])

    def forward(self, x: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        mixed = torch.bitwise_or(flags, self.other) ^ (flags & self.other)
        return self.fc(x) * mixed.to(x.dtype) + torch.bitwise_and(flags, 6).to(x.dtype)


def test_integer_bitwise_operators_of_a_tensor_attribute_run_in_the_graph() -> None:
    torch.manual_seed(8)

    def inputs(s: int):
        b = _batch(s)
        flags = torch.randint(0, 16, (b, 6), generator=_gen(s), dtype=torch.int32)
        return (torch.randn(b, 6, generator=_gen(s)), flags), {}

    run = assert_training_parity(BitsOfAnAttribute(), inputs, steps=STEPS, rtol=RTOL, atol=ATOL)
    assert set(_torch_nodes(run.engine)) >= {"aten::bitwise_or", "aten::bitwise_and"}


class Pooling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 15, 4)
        self.scale = nn.Parameter(torch.ones(3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        pooled = F.adaptive_avg_pool2d(h, (3, 5)).flatten(1)
        return self.fc(pooled) + F.adaptive_max_pool2d(h, 2).mean()


def test_adaptive_pooling_with_any_output_size() -> None:
    torch.manual_seed(8)
    sizes = [(7, 11), (9, 10), (7, 11), (8, 13)]
    run = assert_training_parity(
        Pooling(),
        lambda s: ((torch.randn(2, 3, *sizes[s], generator=_gen(s), requires_grad=True),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
        expect_builds=None,
    )
    assert "aten::adaptive_avg_pool2d" in _torch_nodes(run.engine)


class Classifier(nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.reduction = reduction

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weight = torch.tensor([1.0, 2.0, 0.5, 1.5])
        return F.cross_entropy(
            self.fc(x), target, weight=weight, reduction=self.reduction, ignore_index=3
        )


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cross_entropy_in_every_reduction(reduction: str) -> None:
    torch.manual_seed(9)

    def inputs(s: int):
        b = _batch(s)
        return (
            torch.randn(b, 6, generator=_gen(s)),
            torch.randint(0, 4, (b,), generator=_gen(s)),
        ), {}

    assert_training_parity(
        Classifier(reduction),
        inputs,
        loss_fn=lambda out: out.sum(),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )


class Resampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return (
            F.interpolate(h, scale_factor=2, mode="nearest").mean((2, 3))
            + F.interpolate(h, size=(5, 7), mode="bilinear", align_corners=False).mean((2, 3))
            + F.interpolate(h, scale_factor=1.5, mode="bicubic", align_corners=True).mean((2, 3))
        )


def test_interpolate_nearest_bilinear_bicubic_train_in_the_graph() -> None:
    torch.manual_seed(10)
    run = assert_training_parity(
        Resampler(),
        lambda s: ((torch.randn(_batch(s), 2, 4 + s, 6, generator=_gen(s)),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )
    assert {"aten::upsample_nearest2d", "aten::upsample_bilinear2d"} <= set(
        _torch_nodes(run.engine)
    )


class Nearest(nn.Module):
    """ORTModule's `test_aten_upsample_nearest`: nearest upsampling of 1, 2 and 3 spatial
    dimensions, to a size or by a factor (the 1d `.vec` overload takes no size then)."""

    def __init__(self, dims: int, resize: dict[str, Any]) -> None:
        super().__init__()
        self.conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1](2, 2, 1)
        self.resize = resize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.conv(x), mode="nearest", **self.resize)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("resize", [{"size": 7}, {"scale_factor": 2.0}, {"scale_factor": 1.5}])
def test_nearest_upsampling_to_a_size_or_by_a_factor(dims: int, resize: dict[str, Any]) -> None:
    torch.manual_seed(12)

    def inputs(s: int):
        return (torch.randn(_batch(s), 2, *[4 + s % 2] * dims, generator=_gen(s)),), {}

    run = assert_training_parity(
        Nearest(dims, resize), inputs, steps=STEPS, rtol=RTOL, atol=ATOL, expect_builds=None
    )
    assert f"aten::upsample_nearest{dims}d" in _torch_nodes(run.engine)


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 6, 1)
        self.gn = nn.GroupNorm(3, 6)
        self.plain = nn.GroupNorm(2, 6, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gn(self.conv(x))
        return self.plain(h.unsqueeze(-1) * 2).squeeze(-1) + h


def test_group_norm_decomposes_into_operators_ort_differentiates() -> None:
    torch.manual_seed(19)
    run = assert_training_parity(
        Norms(),
        lambda s: ((torch.randn(_batch(s), 6, 5 + s, generator=_gen(s), requires_grad=True),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )
    assert _torch_nodes(run.engine) == {}  # exact in ONNX, no torch needed


# -- models ------------------------------------------------------------------------------------
class UNet(nn.Module):
    """Two levels: GroupNorm blocks, a strided down path, ConvTranspose and Upsample up paths."""

    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU()
            )

        self.enc1 = block(3, 8)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.enc2 = block(16, 16)
        self.up_t = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.up_i = nn.Upsample(scale_factor=2, mode="nearest")
        self.squeeze = nn.Conv2d(16, 8, 1)
        self.dec = block(24, 8)
        self.norm = nn.InstanceNorm2d(8, affine=True)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.down(e1))
        up = torch.cat([self.up_t(e2), self.squeeze(self.up_i(e2)), e1], dim=1)
        return self.out(self.norm(self.dec(up)))


def test_small_unet_with_groupnorm_convtranspose_upsample() -> None:
    torch.manual_seed(11)
    sizes = [8, 12, 8, 16]
    run = assert_training_parity(
        UNet(),
        lambda s: ((torch.randn(2, 3, sizes[s], sizes[s], generator=_gen(s)),), {}),
        steps=STEPS,
        optimizer="adamw",
        lr=1e-3,
        rtol=RTOL,
        atol=ATOL,
    )
    assert _torch_nodes(run.engine)  # ConvTranspose and Resize have no CPU gradient kernels


class DCGANGenerator(nn.Module):
    def __init__(self, nz: int = 8, ngf: int = 4) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, 3, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


def test_dcgan_generator() -> None:
    torch.manual_seed(12)
    run = assert_training_parity(
        DCGANGenerator(),
        lambda s: ((torch.randn(_batch(s) + 1, 8, 1, 1, generator=_gen(s)),), {}),
        steps=STEPS,
        optimizer="adamw",
        lr=1e-3,
        rtol=RTOL,
        atol=ATOL,
    )
    assert _torch_nodes(run.engine)


class RNNLanguageModel(nn.Module):
    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.rnn = nn.RNN(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        logits = self.head(hidden)
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )


def test_rnn_language_model() -> None:
    torch.manual_seed(13)
    lengths = [5, 7, 4, 6]
    run = assert_training_parity(
        RNNLanguageModel(),
        lambda s: ((torch.randint(0, 20, (_batch(s), lengths[s]), generator=_gen(s)),), {}),
        loss_fn=lambda loss: loss,
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
    )
    assert "aten::rnn_tanh" in _torch_nodes(run.engine)


class LSTMTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 10, num_layers=2, dropout=0.2, batch_first=True)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out)


def _train_steps(model: nn.Module, engine: ModuleEngine, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    outputs = []
    for s in range(3):
        x = torch.randn(_batch(s), 5, 6, generator=_gen(s))
        out = engine(x)
        out.square().mean().backward()
        outputs.append(out.detach())
    return outputs


def test_two_layer_lstm_with_dropout_in_training() -> None:
    torch.manual_seed(14)
    model = LSTMTagger()
    engine = ModuleEngine(copy.deepcopy(model))
    first = _train_steps(model, engine, seed=5)
    assert "aten::lstm" in _torch_nodes(engine)
    # dropout is active: training differs from a dropout-free pass, and is reproducible
    engine_model = engine._module()
    assert engine_model is not None
    grads = [p.grad.clone() for p in engine_model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    other = _train_steps(model, ModuleEngine(copy.deepcopy(model)), seed=6)
    again = _train_steps(model, ModuleEngine(copy.deepcopy(model)), seed=5)
    for a, b, c in zip(first, again, other, strict=True):
        torch.testing.assert_close(a, b)  # torch.manual_seed(5) gives the same masks
        assert not torch.equal(a, c)
    model.eval()
    engine_model.eval()
    x = torch.randn(3, 5, 6)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), model(x), rtol=RTOL, atol=ATOL)
    no_dropout = copy.deepcopy(model)
    no_dropout.lstm.dropout = 0.0
    no_dropout.train()
    engine_model.train()
    assert not torch.allclose(engine(x), no_dropout(x))


def test_an_lstm_kept_in_onnx_where_it_is_denied() -> None:
    """On CPU an LSTM is a torch-calling node by default (`routing.default_routes`; its
    variants: tests/test_engine_parity.py); denied, ORT's own LSTM and LSTMGrad run it."""
    torch.manual_seed(17)
    run = assert_training_parity(
        LSTMSequenceModel(num_layers=2, batch_first=True),
        lambda s: ((torch.randn(_batch(s), 5, 6, generator=_gen(s)),), {}),
        loss_fn=lambda out: sum(t.square().mean() for t in out),
        steps=2,
        rtol=RTOL,
        atol=ATOL,
        options=EngineOptions(no_torch_ops=("aten::lstm",)),
    )
    assert not _torch_nodes(run.engine)


class FeatureDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 1)
        self.drop = nn.Dropout2d(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.conv(x))


def test_dropout2d_drops_whole_channels_with_eager_statistics() -> None:
    torch.manual_seed(15)
    model = FeatureDropout()
    engine = ModuleEngine(model)
    x = torch.randn(16, 3, 4, 4)
    before = torch.random.get_rng_state()
    out = engine(x)
    assert torch.equal(torch.random.get_rng_state(), before)  # the user's stream is untouched
    out.sum().backward()
    assert "aten::feature_dropout" in _torch_nodes(engine)
    with torch.no_grad():
        kept = model.conv(x) / 0.75
    zero_channels = (out.detach().abs().sum((2, 3)) == 0).float().mean().item()
    assert 0.15 < zero_channels < 0.35
    live = out.detach().abs().sum((2, 3)) != 0
    torch.testing.assert_close(out.detach()[live], kept[live], rtol=RTOL, atol=ATOL)
    # the gradient flows through kept channels only, scaled like the forward
    grad = model.conv.bias.grad
    assert grad is not None and torch.isfinite(grad).all()
    torch.manual_seed(21)
    first = ModuleEngine(copy.deepcopy(model))(x)
    torch.manual_seed(22)
    other = ModuleEngine(copy.deepcopy(model))(x)
    torch.manual_seed(21)
    assert torch.equal(ModuleEngine(copy.deepcopy(model))(x), first)
    assert not torch.equal(other, first)


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.fc(x).softmax(-1)
        picks = torch.multinomial(probs[0], 3)
        return probs.gather(1, picks.expand(x.shape[0], 3)).sum(), picks


def test_multinomial_is_seeded_from_the_tools_generator() -> None:
    torch.manual_seed(16)
    model = Sampler()
    x = torch.randn(4, 5)
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    loss, picks = ModuleEngine(copy.deepcopy(model))(x)
    assert torch.equal(torch.random.get_rng_state(), before)
    loss.backward()
    assert picks.shape == (3,) and picks.unique().numel() == 3
    torch.manual_seed(4)
    ModuleEngine(copy.deepcopy(model))(x)
    torch.manual_seed(3)
    _, again = ModuleEngine(copy.deepcopy(model))(x)
    assert torch.equal(picks, again)  # the same seed gives the same draws


# -- visibility ----------------------------------------------------------------------------------
def test_saved_graphs_show_the_torch_calling_nodes(tmp_path) -> None:
    torch.manual_seed(17)
    engine = ModuleEngine(Cumulative(), EngineOptions(save_onnx=tmp_path))
    engine(torch.randn(3, 6)).sum().backward()
    saved = sorted(tmp_path.glob("*.onnx"))
    assert saved
    forward = onnx.load(str(next(p for p in saved if not p.name.endswith(".gradient.onnx"))))
    comments = {
        a.s.decode()
        for n in forward.graph.node
        if n.op_type == "PythonOp"
        for a in n.attribute
        if a.name == "comment"
    }
    assert comments == {"aten::cummax", "aten::cummin"}
    gradient = onnx.load(str(next(p for p in saved if p.name.endswith(".gradient.onnx"))))
    assert sum(n.op_type == "PythonOpGrad" for n in gradient.graph.node) == 2


def test_denied_operator_is_not_routed_and_says_how_to_allow_it() -> None:
    engine = ModuleEngine(Cumulative(), EngineOptions(no_torch_ops=("aten::cumm*",)))
    with pytest.raises(ExportError, match="aten::cummax"):
        engine(torch.randn(3, 6))


def test_always_routed_operator_runs_in_torch_even_when_ort_could() -> None:
    torch.manual_seed(18)
    run = assert_training_parity(
        Quantised(),
        lambda s: ((torch.randn(_batch(s), 8, generator=_gen(s)),), {}),
        steps=2,
        rtol=RTOL,
        atol=ATOL,
        options=EngineOptions(torch_ops=("aten::tanh",)),
    )
    assert _torch_nodes(run.engine)["aten::tanh"] == 1


class WideFeedForward(nn.Module):
    """A transformer's feed-forward block: ReLU between two linear layers, optionally dropout."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(F.relu(self.up(x))))


class ReluIntoPooling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 16 * 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1))


class SqrtOfRelu(nn.Module):
    """sqrt(relu(x)): at a unit ReLU zeroed, the incoming gradient is infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.sqrt(F.relu(self.up(x))))


def _wide(step: int) -> tuple[tuple[torch.Tensor], dict]:
    # 2^18 elements and more behind the ReLU: large enough for its gradient to run in torch
    return (torch.randn(64 + 16 * (step % 2), 64, 32, generator=_gen(step)),), {}


def test_a_large_relus_gradient_runs_in_torch_with_eager_numbers() -> None:
    torch.manual_seed(19)
    run = assert_training_parity(WideFeedForward(), _wide, steps=2, rtol=RTOL, atol=ATOL)
    assert _torch_nodes(run.engine) == {"aten::threshold_backward": 1}


def test_the_relu_gradient_in_torch_gives_zero_where_eager_does_for_an_infinite_gradient() -> None:
    """`Mul` by the mask would give NaN there (inf * 0); threshold_backward gives eager's 0."""
    torch.manual_seed(20)
    model = SqrtOfRelu()
    engine = ModuleEngine(copy.deepcopy(model))
    x = _wide(0)[0][0]
    engine(x).sum().backward()
    model(x).sum().backward()
    engine_model = engine._module()
    assert engine_model is not None
    assert _torch_nodes(engine) == {"aten::threshold_backward": 1}
    for got, want in zip(engine_model.parameters(), model.parameters(), strict=True):
        assert want.grad is not None and got.grad is not None
        assert torch.isnan(want.grad).sum() == torch.isnan(got.grad).sum() == 0
        # 1/sqrt of tiny activations: large terms, summed in another order
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("compiled", [True, False], ids=["aten-node", "python-node"])
def test_a_small_relus_gradient_stays_in_onnx(compiled: bool) -> None:
    from ort_autopatch.engine.backends.ort_training.torch_in_graph import gradients

    smallest = gradients.ATEN_FROM if compiled else gradients.PYTHON_FROM
    engine = ModuleEngine(WideFeedForward(), EngineOptions(compile_executor=compiled))
    engine(torch.randn(smallest // 256 - 1, 32)).sum().backward()  # 256 units behind the ReLU
    assert _torch_nodes(engine) == {}


def test_a_graph_without_a_large_enough_gradient_node_never_asks_for_the_executor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

    asked: list[object] = []
    monkeypatch.setattr(aten_executor, "executor", lambda folder: asked.append(folder))
    engine = ModuleEngine(WideFeedForward())
    engine(torch.randn(2, 32)).sum().backward()  # 512 floats behind the ReLU
    assert asked == [] and _torch_nodes(engine) == {}


def test_a_large_relus_gradient_through_python_without_the_executor() -> None:
    # compile_executor=False: the same torch function, through a PythonOp
    torch.manual_seed(19)
    run = assert_training_parity(
        WideFeedForward(),
        _wide,
        steps=3,
        rtol=RTOL,
        atol=ATOL,
        options=EngineOptions(compile_executor=False),
    )
    assert _torch_nodes(run.engine) == {"aten::threshold_backward": 1}
    entries = run.engine._cache._entries.values()
    graphs = [entry.program.saved_graphs["gradient"] for entry in entries]
    assert graphs and all(b"PythonOp" in g and b"ATen" not in g for g in graphs)


def test_a_large_relu_feeding_pooling_gets_its_gradient_in_torch_with_eager_numbers() -> None:
    # the forward ReLU stays ONNX, so MaxPoolGrad still sees the shapes it needs
    torch.manual_seed(21)
    run = assert_training_parity(
        ReluIntoPooling(),
        lambda s: ((torch.randn(40 + 8 * (s % 2), 1, 32, 32, generator=_gen(s)),), {}),
        steps=2,
        rtol=RTOL,
        atol=ATOL,
        expect_builds=2,  # pooling gradients need static shapes: a graph per batch size
    )
    assert _torch_nodes(run.engine) == {"aten::threshold_backward": 1}


def test_the_relu_gradient_in_torch_can_be_denied() -> None:
    engine = ModuleEngine(
        WideFeedForward(), EngineOptions(no_torch_ops=("aten::threshold_backward",))
    )
    engine(_wide(0)[0][0]).sum().backward()
    assert _torch_nodes(engine) == {}


class GeluFeedForward(nn.Module):
    """BERT's and nanoGPT's feed-forward block: exact (erf) GELU between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.act = nn.GELU()
        self.down = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("compiled", [True, False], ids=["aten-node", "python-node"])
def test_a_large_gelus_gradient_runs_in_torch_with_eager_numbers(compiled: bool) -> None:
    torch.manual_seed(27)
    run = assert_training_parity(
        GeluFeedForward(),
        _wide,
        steps=3,
        rtol=RTOL,
        atol=ATOL,
        options=EngineOptions(compile_executor=compiled),
    )
    assert _torch_nodes(run.engine) == {"aten::gelu_backward": 1}
    entries = run.engine._cache._entries.values()
    graphs = [entry.program.saved_graphs["gradient"] for entry in entries]
    ops = [{n.op_type for n in onnx.load_from_string(g).graph.node} for g in graphs]
    kind = "ATen" if compiled else "PythonOp"
    assert ops and all(kind in o and "GeluGrad" not in o for o in ops)


def test_a_static_shape_graph_gets_the_gelu_gradient_in_torch_too() -> None:
    # the first call's static-shape graph (inferred shapes, the shared arena) swaps it as well
    torch.manual_seed(29)
    run = assert_training_parity(
        GeluFeedForward(),
        lambda s: ((torch.randn(72, 64, 32, generator=_gen(s)),), {}),
        steps=3,
        rtol=RTOL,
        atol=ATOL,
    )
    (static,) = run.engine.records
    assert static.hot_shape
    assert static.torch_nodes == {"aten::gelu_backward": 1}


def test_the_gelu_gradient_in_torch_can_be_denied() -> None:
    engine = ModuleEngine(GeluFeedForward(), EngineOptions(no_torch_ops=("aten::gelu_backward",)))
    engine(_wide(0)[0][0]).sum().backward()
    assert _torch_nodes(engine) == {}


def test_a_tanh_approximated_gelu_keeps_its_own_gradient() -> None:
    """Only ORT's exact Gelu becomes `gelu_backward(approximate="none")`."""

    class TanhGelu(GeluFeedForward):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.GELU(approximate="tanh")

    torch.manual_seed(28)
    run = assert_training_parity(TanhGelu(), _wide, steps=2, rtol=RTOL, atol=ATOL)
    assert "aten::gelu_backward" not in _torch_nodes(run.engine)


class Normed(nn.Module):
    def __init__(self, **norm: bool) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64, **norm)
        self.down = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


@pytest.mark.parametrize(
    "norm",
    [{}, {"bias": False}, {"elementwise_affine": False}],
    ids=["affine", "no-bias", "no-affine"],
)
def test_a_large_layer_norms_gradient_runs_in_torch_with_eager_numbers(norm: dict) -> None:
    torch.manual_seed(22)
    run = assert_training_parity(Normed(**norm), _wide, steps=3, rtol=RTOL, atol=ATOL)
    assert _torch_nodes(run.engine) == {"aten::native_layer_norm_backward": 1}


class NormedOverTwoDims(nn.Module):
    """LayerNorm over the last two dimensions: the node's axis is -2."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.norm = nn.LayerNorm([16, 64])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.up(x)))


def test_a_layer_norm_over_two_dims_gets_its_gradient_in_torch_for_every_batch() -> None:
    torch.manual_seed(26)
    run = assert_training_parity(
        NormedOverTwoDims(),
        lambda s: ((torch.randn(8 + 3 * s, 16, 32, generator=_gen(s)),), {}),
        steps=3,
        rtol=RTOL,
        atol=ATOL,
        options=EngineOptions(static_after=0),  # the dynamic graph alone
        expect_builds=1,
    )
    assert _torch_nodes(run.engine) == {
        "aten::threshold_backward": 1,
        "aten::native_layer_norm_backward": 1,
    }


def test_gradient_nodes_orts_session_refuses_fall_back_to_orts_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ort_autopatch.engine.errors import SessionError

    real = agent.build_training

    def refuse_torch_nodes(gradient: Any, *args: Any) -> Any:
        if b"PythonOp" in gradient.model or b"ATen" in gradient.model:
            raise SessionError("WideFeedForward", "refused for the test", "none")
        return real(gradient, *args)

    monkeypatch.setattr(agent, "build_training", refuse_torch_nodes)
    torch.manual_seed(23)
    run = assert_training_parity(WideFeedForward(), _wide, steps=2, rtol=RTOL, atol=ATOL)
    assert _torch_nodes(run.engine) == {}


def _encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)


def _lengths(step: int) -> tuple[tuple[torch.Tensor], dict]:
    # 2^14 input elements and more: what the size rule reads where it cannot see the ReLU's
    return (torch.randn(8, 32 + 7 * step, 64, generator=_gen(step)),), {}


def test_a_dynamic_graph_gets_the_gradient_nodes_for_every_length() -> None:
    # behind MultiheadAttention's computed reshapes shape inference knows no rank: the nodes
    # are sized by the call's largest input and declare none
    torch.manual_seed(24)
    run = assert_training_parity(
        _encoder(),
        _lengths,
        steps=3,
        rtol=RTOL,
        atol=ATOL,
        options=EngineOptions(static_after=0),  # the dynamic graph alone
        expect_builds=1,
    )
    nodes = {"aten::threshold_backward": 1, "aten::native_layer_norm_backward": 2}
    assert _torch_nodes(run.engine) == nodes


_ATTENTION = {"aten::scaled_dot_product_attention": 1}
_GRADIENTS = {"aten::threshold_backward": 1, "aten::native_layer_norm_backward": 2}


@pytest.mark.parametrize("compiled", [True, False], ids=["aten-nodes", "python-nodes"])
def test_a_static_graph_behind_rankless_attention(compiled: bool) -> None:
    # attention as a torch-calling node hides every shape behind it (its outputs pass through
    # a Reshape of unknown sizes); the static-shape graph still takes the gradient nodes, as
    # ATen nodes or as PythonOps
    torch.manual_seed(25)
    options = EngineOptions(
        torch_ops=("aten::scaled_dot_product_attention",), compile_executor=compiled
    )
    run = assert_training_parity(
        _encoder(),
        lambda s: ((torch.randn(8, 40, 64, generator=_gen(s)),), {}),
        steps=3,
        rtol=RTOL,
        atol=ATOL,
        options=options,
    )
    (static,) = run.engine.records
    assert static.hot_shape
    assert static.torch_nodes == {**_ATTENTION, **_GRADIENTS}


def test_a_process_with_torch_calling_nodes_exits_cleanly(tmp_path) -> None:
    """ORT's function pool holds Python objects in C++ statics; they are released at exit
    while the interpreter still lives (a crash at teardown otherwise)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from ort_autopatch.engine import ModuleEngine

            class Net(torch.nn.Module):
                def forward(self, x):
                    return torch.cummax(x, 1).values

            engine = ModuleEngine(Net())
            x = torch.randn(3, 4, requires_grad=True)
            engine(x).sum().backward()
            engine(x)  # a forward whose backward never comes
            print("done")
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "done"


class ReportedCumulative(Cumulative):
    pass


def test_report_says_per_class_which_operators_ran_through_torch() -> None:
    from ort_autopatch import patcher, report

    report.reset()
    patcher.patch(ReportedCumulative)
    try:
        model = ReportedCumulative()
        model(torch.randn(3, 6)).sum().backward()
        model(torch.randn(4, 6)).sum().backward()
        name = f"{__name__}:ReportedCumulative"
        entry = report.snapshot()[name]
        assert entry["ort_calls"] == 2 and entry["eager_calls"] == 0
        assert entry["torch_nodes"] == {
            "count": 2,
            "operators": {"aten::cummax": 1, "aten::cummin": 1},
        }
        text = report.summary({"classes": {name: entry}})
        assert "torch-calling nodes: 2 (aten::cummax x1, aten::cummin x1)" in text
    finally:
        patcher.unpatch(ReportedCumulative)
        report.reset()


# -- fused attention ----------------------------------------------------------------------------
SDPA = "aten::scaled_dot_product_attention"


class Attention(nn.Module):
    """Grouped-query attention with a mask of each kind (bool with fully masked rows, float),
    causal, and dropout inside attention."""

    def __init__(self, mode: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.kv = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.mode = mode
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, 8).transpose(1, 2).chunk(2, dim=-1)
        mask = None
        if self.mode == "bool":
            keep = torch.arange(t, device=x.device) < t - 1
            mask = keep.view(1, 1, 1, t) & (torch.arange(t, device=x.device) > 0).view(1, 1, t, 1)
        elif self.mode == "float":
            pos = torch.arange(t, device=x.device, dtype=x.dtype)
            mask = -0.3 * (pos.view(1, t) - pos.view(t, 1)).abs()  # an ALiBi-like bias
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.mode == "causal",
            enable_gqa=True,
        )
        return self.out(y.transpose(1, 2).reshape(b, t, 16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["bool", "float", "causal"])
def test_fused_attention_runs_torchs_kernel_inside_the_graph(mode: str, device: str) -> None:
    torch.manual_seed(20)
    options = EngineOptions(torch_ops=(SDPA,)) if device == "cpu" else None  # CUDA: by rule
    run = assert_training_parity(
        Attention(mode).to(device),
        lambda s: ((torch.randn(_batch(s), 3 + s, 16, generator=_gen(s)).to(device),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
        options=options,
    )
    assert _torch_nodes(run.engine) == {SDPA: 1}


class TorchAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("device", DEVICES)
def test_multihead_attention_through_the_fused_kernel_gets_eagers_gradients(device: str) -> None:
    """Its q, k and v lie in ORT buffers that ORT reuses once the forward moves on; the
    kernel's saved copies keep them for backward (they were NaN before)."""
    torch.manual_seed(26)
    options = EngineOptions(torch_ops=(SDPA,)) if device == "cpu" else None  # CUDA: by rule
    run = assert_training_parity(
        TorchAttention().to(device),
        lambda s: ((torch.randn(8, 40 - 3 * s, 64, generator=_gen(s)).to(device),), {}),
        steps=STEPS,
        rtol=RTOL,
        atol=ATOL,
        options=options,
    )
    assert _torch_nodes(run.engine) == {SDPA: 1}


def test_attention_dropout_inside_the_torch_node_is_seeded_and_active() -> None:
    torch.manual_seed(21)
    model = Attention("causal", dropout=0.5)
    x = torch.randn(4, 6, 16)
    options = EngineOptions(torch_ops=(SDPA,))

    def step(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        engine = ModuleEngine(copy.deepcopy(model), options)
        out = engine(x)
        out.sum().backward()
        module = engine._module()
        assert module is not None and module.q.weight.grad is not None
        return out.detach(), module.q.weight.grad

    first, grad = step(31)
    other, _ = step(32)
    again, grad_again = step(31)
    assert torch.equal(first, again) and torch.equal(grad, grad_again)
    assert not torch.equal(first, other)
    with torch.no_grad():
        model.eval()
        undropped = model(x)
    assert not torch.allclose(first, undropped)


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_a_forward_whose_backward_never_runs_keeps_no_torch_graph() -> None:
    """A routed attention's saved output, kept by the saved-tensor hook as itself, held its
    own grad_fn: a cycle through C++ the collector cannot see, so every call that was never
    backpropagated (a validation pass with gradients on) kept its torch graph."""
    engine = ModuleEngine(Attention("float"), EngineOptions(torch_ops=(SDPA,)))
    x = torch.randn(2, 6, 16)
    engine(x).sum().backward()
    before = _live_tensors()
    for _ in range(10):
        engine(x)  # output dropped, no backward
    assert _live_tensors() - before <= 2
    assert _torch_nodes(engine) == {SDPA: 1}


def test_attention_stays_onnx_on_cpu_by_default() -> None:
    engine = ModuleEngine(Attention("causal"))
    engine(torch.randn(2, 5, 16)).sum().backward()
    assert SDPA not in _torch_nodes(engine)


class EncoderBlocks(nn.Module):
    """vit's encoder in small: attention and a whole encoder layer, both with a fast path."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.layer(x + self.attention(h, h, h, need_weights=False)[0])


def _aten_calls(model: nn.Module, x: torch.Tensor) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(x)
    return {event.name for event in profile.events()}


def test_attention_fast_paths_in_eval_run_in_the_graph() -> None:
    torch.manual_seed(27)
    model = EncoderBlocks().eval()
    engine = ModuleEngine(copy.deepcopy(model))
    with torch.no_grad():
        fused = _aten_calls(model, torch.randn(2, 5, 32))
        assert {"aten::_native_multi_head_attention", "aten::_transformer_encoder_layer_fwd"} <= (
            fused
        )  # eager takes both fast paths
        for step in range(3):
            x = torch.randn(_batch(step), 5 + step, 32, generator=_gen(step))
            torch.testing.assert_close(engine(x), model(x), rtol=RTOL, atol=ATOL)
    # the first call's static-shape graph, then the dynamic one for the other sizes
    assert [r.hot_shape for r in engine.records] == [True, False]
    assert not any(r.has_backward for r in engine.records)
    assert torch.backends.mha.get_fastpath_enabled()  # the export's switch put back
