"""verify.py on its own: comparing a graph's call with eager's, and what cannot be compared."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import onnx
import pytest
import torch
from onnx import helper

from ort_autopatch.engine import verify


def _model(op: str, ratio: float | None) -> onnx.ModelProto:
    nodes, inputs = [], ["x"]
    if ratio is not None:
        nodes.append(
            helper.make_node(
                "Constant",
                [],
                ["r"],
                value=helper.make_tensor("r", onnx.TensorProto.FLOAT, [], [ratio]),
            )
        )
        inputs.append("r")
    nodes.append(helper.make_node(op, inputs, ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph)


def test_a_dropout_with_ratio_zero_is_not_random() -> None:
    assert verify.random_ops(_model("Dropout", 0.0)) == []
    assert verify.random_ops(_model("Dropout", 0.1)) == ["Dropout"]


def test_ort_fused_dropout_is_random() -> None:
    assert verify.random_ops(_model("BitmaskDropout", 0.1)) == ["BitmaskDropout"]


def test_calls_within_tolerance_verify_with_their_differences() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)

    def eager(tensors: list[torch.Tensor]) -> torch.Tensor:
        return module(tensors[0])

    def graph(tensors: list[torch.Tensor]) -> torch.Tensor:
        return module(tensors[0]) * (1 + 1e-6)  # float32 keeps a relative 1e-6

    result = verify.verify_call(
        "Linear", module, graph, eager, [x], list(module.parameters()), True
    )
    assert result.mismatch is None
    assert 0 < result.output_rel < verify.RTOL and 0 < result.grad_rel < verify.RTOL
    assert result.spread_rel is None  # within the strict tolerance: eager runs once


class _Sensitive(torch.nn.Module):
    """sin(1e4 * w * x): a relative change of one rounding step in x or w moves the output
    by about 1e-2, as BatchNorm over few values amplifies rounding in a deep network."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * self.w * 1e4)


def _verify_sensitive(
    graph: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
) -> tuple[verify.Verification, torch.nn.Module]:
    torch.manual_seed(0)
    module = _Sensitive()
    x = torch.rand(4, 16) + 0.5
    result = verify.verify_call(
        "Sensitive",
        module,
        lambda tensors: graph(module, tensors[0]),
        lambda tensors: module(tensors[0]),
        [x],
        list(module.parameters()),
        True,
    )
    return result, module


def _in_float64(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The same function with other rounding: what another runtime's kernels do."""
    assert isinstance(module, _Sensitive)
    return torch.sin(x.double() * module.w.double() * 1e4).float()


def test_a_call_as_sensitive_to_rounding_as_eager_itself_matches_within_its_spread() -> None:
    result, _ = _verify_sensitive(_in_float64)
    assert result.mismatch is None
    # beyond the strict tolerance, so eager's own spread was measured: larger than the graph's
    assert result.output_rel > verify.RTOL and result.grad_rel > verify.RTOL
    assert result.spread_rel is not None and result.spread_rel > verify.RTOL


@pytest.mark.parametrize(
    "wrong",
    [
        lambda m, x: _in_float64(m, x) * 1.5,
        lambda m, x: torch.cos(x * m.w * 1e4),
        lambda m, x: torch.sin(x.detach() * m.w.detach() * 1e4) + 0 * m.w,  # no gradient
    ],
    ids=["scaled", "another function", "gradient lost"],
)
def test_a_wrong_graph_is_refused_even_where_eager_is_that_sensitive(
    wrong: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
) -> None:
    with pytest.raises(verify.VerificationError, match="eager's own spread") as caught:
        _verify_sensitive(wrong)
    verification = caught.value.verification
    assert verification is not None and verification.spread_rel is not None


def _eager_runs(graph: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> int:
    """How often the check ran `_Sensitive` eagerly for one call through `graph`."""
    torch.manual_seed(0)
    module = _Sensitive()
    runs = 0

    def eager(tensors: list[torch.Tensor]) -> torch.Tensor:
        nonlocal runs
        runs += 1
        return module(tensors[0])

    with contextlib.suppress(verify.VerificationError):
        verify.verify_call(
            "Sensitive",
            module,
            lambda tensors: graph(module, tensors[0]),
            eager,
            [torch.rand(4, 16) + 0.5],
            list(module.parameters()),
            True,
        )
    return runs


def test_a_call_within_the_first_seeds_spread_measures_no_more_seeds() -> None:
    """A spread only grows with more seeds, so once one covers the graph the verdict is made:
    the plain run, one run from nudged values, no more (ResNet-50's check: -2 s)."""
    assert _eager_runs(_in_float64) == 2
    # a wrong graph is beyond every seed's spread: the plain run, every seed, the float64 run
    assert _eager_runs(lambda m, x: _in_float64(m, x) * 1.5) == 1 + len(verify.NUDGE_SEEDS) + 1


class _Cancelling(torch.nn.Module):
    """x * w * ((big + 0.3) - big) / 0.3: 1 in exact arithmetic, 1 +- 2e-3 in float32 (the
    rounding of big + 0.3), whatever the inputs and parameters are nudged by."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))
        self.register_buffer("big", torch.full((8,), 12345.678))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w * (((self.big + 0.3) - self.big) / 0.3)


def test_eagers_sensitivity_to_each_operators_rounding_counts_as_its_spread() -> None:
    """A graph whose kernels round an intermediate otherwise (here: not at all) differs from
    eager beyond the strict tolerance while nudged inputs barely move eager: the rounding
    noise put into every operator's result measures eager's real sensitivity."""
    torch.manual_seed(0)
    module = _Cancelling()
    big = module.big.double()

    def graph(tensors: list[torch.Tensor]) -> torch.Tensor:  # the intermediate in float64
        return tensors[0] * module.w * (((big + 0.3) - big) / 0.3).float()

    result = verify.verify_call(
        "Cancelling",
        module,
        graph,
        lambda tensors: module(tensors[0]),
        [torch.randn(4, 8)],
        list(module.parameters()),
        True,
    )
    assert result.mismatch is None and result.output_rel > verify.RTOL
    assert result.spread_rel is not None and result.spread_rel > verify.RTOL


def test_a_wrong_graph_is_refused_where_eager_is_sensitive_to_each_operators_rounding() -> None:
    torch.manual_seed(0)
    module = _Cancelling()
    with pytest.raises(verify.VerificationError, match="eager's own spread"):
        verify.verify_call(
            "Cancelling",
            module,
            lambda tensors: module(tensors[0]) * 1.5,
            lambda tensors: module(tensors[0]),
            [torch.randn(4, 8)],
            list(module.parameters()),
            True,
        )


def test_measuring_eagers_spread_leaves_the_parameters_bit_for_bit() -> None:
    torch.manual_seed(0)
    module = _Sensitive()
    weight, version = module.w.detach().clone(), module.w._version
    x = torch.rand(4, 16) + 0.5
    rng = torch.random.get_rng_state()
    with pytest.raises(verify.VerificationError):
        verify.verify_call(
            "Sensitive",
            module,
            lambda tensors: module(tensors[0]) * 2,
            lambda tensors: module(tensors[0]),
            [x],
            list(module.parameters()),
            True,
        )
    assert torch.equal(module.w, weight) and module.w._version == version
    assert module.w.grad is None
    assert torch.equal(torch.random.get_rng_state(), rng)


class _Biased(torch.nn.Module):
    """A layer whose `bias` gradient is zero in exact arithmetic; `leak` gives it one without
    changing the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.bias = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, leak: float) -> torch.Tensor:
        leaked = self.bias * leak
        return self.linear(x) + (leaked - leaked.detach())


def _verify_leak(graph_leak: float) -> verify.Verification:
    torch.manual_seed(0)
    module = _Biased()
    x = torch.randn(64, 3) * 100  # weight gradients in the hundreds
    return verify.verify_call(
        "Biased",
        module,
        lambda tensors: module(tensors[0], graph_leak),
        lambda tensors: module(tensors[0], 0.0),
        [x],
        list(module.parameters()),
        True,
    )


def test_a_gradient_both_sides_leave_at_rounding_noise_matches() -> None:
    result = _verify_leak(1e-5)  # bias gradient ~1e-4 against eager's 0: beyond 1e-6
    assert result.mismatch is None
    assert result.grad_diff > verify.ATOL


def test_a_gradient_the_graph_makes_larger_than_rounding_noise_is_a_mismatch() -> None:
    with pytest.raises(verify.VerificationError, match="gradient 0 differs"):
        _verify_leak(1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_difference_is_measured_as_float64_measures_it(dtype: torch.dtype) -> None:
    """The comparison takes differences in the tensors' own precision (float32 at least):
    the same numbers, to float32's rounding of the difference, as in float64."""
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(1000, generator=gen).to(dtype)
    nudge = 8 * torch.finfo(dtype).eps * torch.randn(1000, generator=gen).double()
    actual = (expected.double() * (1 + nudge)).to(dtype)
    diff, rel, beyond = verify._difference(actual, expected)
    exact = float((actual.double() - expected.double()).abs().max())
    assert diff == pytest.approx(exact, rel=1e-6) and diff > 0
    assert rel == pytest.approx(exact / float(expected.double().abs().max()), rel=1e-6)
    assert beyond is (exact > float(expected.double().abs().max()) * verify.RTOL + verify.ATOL)
    assert verify._difference(expected, expected) == (0.0, 0.0, False)


def test_a_nan_is_infinitely_far_and_a_complex_difference_counts_its_imaginary_part() -> None:
    expected = torch.ones(4)
    moved = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    diff, _, beyond = verify._difference(moved, expected)
    assert diff == float("inf") and beyond
    # eager's spread: a nudged run's NaN widens it by nothing (it would admit any graph)
    assert verify._distance(moved, expected, nan=0.0) == 0.0
    z = torch.ones(3, dtype=torch.complex64)
    diff, _, beyond = verify._difference(z + 1j, z)
    assert diff == pytest.approx(1.0) and beyond


def test_a_wrong_output_is_a_verification_error_and_the_module_is_unchanged() -> None:
    module = torch.nn.Linear(3, 2)
    weight = module.weight.detach().clone()

    def eager(tensors: list[torch.Tensor]) -> torch.Tensor:
        return module(tensors[0])

    def graph(tensors: list[torch.Tensor]) -> torch.Tensor:
        return module(tensors[0]) * 2

    with pytest.raises(verify.VerificationError) as caught:
        verify.verify_call("Linear", module, graph, eager, [torch.randn(4, 3)], [], False)
    assert caught.value.verification is not None
    assert "output 0 differs" in (caught.value.verification.mismatch or "")
    assert torch.equal(module.weight, weight)


class _Accumulating(torch.nn.Module):
    """w * (x[0] + x[1] + ... ) - w * x[0], summed one row at a time: float32 rounds every
    partial sum near x[0] the same way, so eager's result is off by a few percent of the
    small difference, an error that nudges and per-operator rounding noise (random) move
    far less than that (eager's spread underestimates it, as on ResNet-50 at batch 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        total = x[0] * self.w
        for row in x[1:]:
            total = total + row * self.w
        return total - x[0] * self.w


def _accumulated(factor: float) -> tuple[verify.Verification, _Accumulating]:
    """The call through a 'graph' that sums in float64 (a runtime that accumulates more
    exactly than eager), scaled by `factor`."""
    module = _Accumulating()
    # the rounding's bias grows with the rows, the random spread as their square root: at 3200
    # rows eager's error is 9 times its spread (at 400, 3 to 4 times: a draw's luck)
    x = torch.full((3200, 3), 0.0013) + torch.linspace(0, 1e-4, 3)
    x[0] = 2e3

    def eager(tensors: list[torch.Tensor]) -> torch.Tensor:
        return module(tensors[0])

    def graph(tensors: list[torch.Tensor]) -> torch.Tensor:
        exact = tensors[0].double()[1:].sum(0) * module.w.double()
        return (exact * factor).float()

    result = verify.verify_call("Acc", module, graph, eager, [x], list(module.parameters()), True)
    return result, module


def test_a_graph_as_near_float64_as_eager_is_accepted_where_eagers_spread_falls_short() -> None:
    result, _ = _accumulated(1.0)
    assert result.mismatch is None
    # the spread alone would have refused it: eager's float32 error is what it measured
    assert result.spread_rel is not None and result.output_rel > verify.SPREAD * result.spread_rel
    assert result.float64_rel is not None and result.float64_rel > result.spread_rel


def test_a_wrong_graph_is_refused_against_the_float64_reference_too() -> None:
    with pytest.raises(verify.VerificationError, match="eager's float32 error") as raised:
        _accumulated(1.5)
    assert raised.value.verification is not None
    assert raised.value.verification.float64_rel is not None


def test_the_float64_reference_leaves_parameters_and_buffers_as_they_were() -> None:
    module = _Accumulating()
    weight, data = module.w, module.w.data
    with pytest.raises(verify.VerificationError):
        # the wrong graph makes every comparison run: strict, spread, float64
        verify.verify_call(
            "Acc",
            module,
            lambda t: module(t[0]) * 1.5,
            lambda t: module(t[0]),
            [torch.randn(5, 3)],
            [module.w],
            True,
        )
    assert module.w is weight and module.w.data.data_ptr() == data.data_ptr()
    assert module.w.dtype == torch.float32 and float(module.w.detach()) == 1.0
    assert module.calls.dtype == torch.float32 and float(module.calls) == 0.0


def test_a_graph_whose_run_fails_where_eagers_does_not_is_refused() -> None:
    """A graph computing a size otherwise than eager (a symbolic floor division that
    truncated) raised in its own run, and was used as if the check could not be made."""
    module = torch.nn.Linear(3, 2)

    def broken(tensors: list[torch.Tensor]) -> torch.Tensor:
        return module(tensors[0])[:1] + module(tensors[0]).t()  # (1, 2) + (2, 4): raises

    x = torch.randn(4, 3)
    eager = lambda tensors: module(tensors[0])  # noqa: E731
    with pytest.raises(verify.VerificationError, match="the graph's run failed where eager"):
        verify.verify_call("Linear", module, broken, eager, [x], list(module.parameters()), True)
    # where eager's run fails as well, the comparison cannot be made: eager's error
    with pytest.raises(RuntimeError):
        verify.verify_call("Linear", module, broken, broken, [x], list(module.parameters()), True)
