"""ModuleEngine semantics beyond plain training parity: modes, state, cache, errors, threads,
and changes made to the module between calls. One behaviour per test."""

from __future__ import annotations

import copy
import random
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ort_autopatch.engine import (
    EngineError,
    EngineOptions,
    ExportError,
    FailureKind,
    MixedDevicesError,
    ModuleEngine,
    UnsupportedInputError,
    backend,
    runtime,
)
from ort_autopatch.engine.backends.ort_training import export as engine_export
from tests.helpers import assert_close, assert_state_equal, plain_backend, snapshot_state

#: the plain backend traces one graph per input shape (the training build's graphs take any)
PLAIN = plain_backend()
#: the autograd node a training call through ORT leaves on its outputs
TRAINING_NODE = "GraphFunctionBackward"  # both backends: graph_function.GraphFunction

# A parity suite needs a backend that runs here (either build): without one it fails at
# collection (with the reason and the remedy), it never vanishes as skips.
runtime.load(training=backend.resolve() != "ort")


class Net(nn.Module):
    """Small MLP whose forward accepts any leading dims and casts its input to its own dtype."""

    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.act = act or nn.ReLU()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, extra=None) -> torch.Tensor:
        return self.out(self.act(self.fc(x.to(self.fc.weight.dtype))))


class BNDrop(nn.Module):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        # No bias before BatchNorm: its true gradient is zero, so only rounding noise would be
        # compared.
        self.fc = nn.Linear(8, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(F.relu(self.bn(self.fc(x)))))


def _pair(model: nn.Module) -> tuple[nn.Module, nn.Module, ModuleEngine]:
    eager = model
    ours = copy.deepcopy(model)
    return eager, ours, ModuleEngine(ours)


# ---------------------------------------------------------------------------------------------
# modes
def test_no_grad_train_mode_dropout_active() -> None:
    p = 0.5
    engine = ModuleEngine(nn.Sequential(nn.Identity(), nn.Dropout(p)))
    x = torch.rand(100, 200) + 0.5
    with torch.no_grad():
        y = engine(x)
    zeros = (y == 0).float().mean().item()
    assert abs(zeros - p) < 0.02, (
        f"dropped fraction {zeros:.3f} under no_grad in train mode, expected {p}"
    )
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))


def test_no_grad_train_mode_batchnorm_batch_stats_and_running_stats_like_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    eager, ours, engine = _pair(model)
    for step in range(3):
        x = torch.randn(10, 8) * (step + 1)
        with torch.no_grad():
            expected = eager(x)
            actual = engine(x)
        assert_close(actual, expected, f"step {step} output")
        assert_state_equal(ours, eager)
    assert int(ours[1].num_batches_tracked) == 3


def test_inference_mode_train_mode_matches_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    eager, ours, engine = _pair(model)
    x = torch.randn(10, 8)
    with torch.inference_mode():
        expected = eager(x)
        actual = engine(x)
    assert_close(actual, expected, "output")
    assert_state_equal(ours, eager)


def test_eval_mode_output_equals_eager() -> None:
    torch.manual_seed(0)
    model = BNDrop()
    with torch.no_grad():  # give the running stats something other than their initial values
        model(torch.randn(16, 8))
    model.eval()
    eager, ours, engine = _pair(model)
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert_close(engine(x), eager(x), "eval output")
    built = engine.records[-1]
    assert built.has_backward is False, "eval mode under no_grad built a training graph"
    assert_state_equal(ours, eager)


def test_eval_mode_with_grad_enabled_gives_parameter_grads() -> None:
    torch.manual_seed(0)
    model = BNDrop()
    model.eval()
    eager, ours, engine = _pair(model)
    x = torch.randn(5, 8)
    eager(x).pow(2).sum().backward()
    engine(x).pow(2).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), eager.parameters(), strict=True):
        assert a.grad is not None, name
        assert_close(a.grad, b.grad, f"grad of {name}")
    assert_state_equal(ours, eager)


def test_frozen_batchnorm_submodule_in_training_model() -> None:
    torch.manual_seed(0)
    model = BNDrop(p=0.0)
    with torch.no_grad():
        model(torch.randn(32, 8) * 3 + 1)  # non-trivial running stats
    model.bn.eval()  # frozen BN inside a training model: uses and keeps its running stats
    eager, ours, engine = _pair(model)
    x = torch.randn(6, 8)
    expected = eager(x)
    actual = engine(x)
    assert_close(actual, expected, "output")
    expected.pow(2).sum().backward()
    actual.pow(2).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), eager.parameters(), strict=True):
        assert_close(a.grad, b.grad, f"grad of {name}")
    assert_state_equal(ours, eager)


def test_eval_dropout_submodule_in_training_model() -> None:
    torch.manual_seed(0)
    model = BNDrop(p=0.5)
    model.drop.eval()
    eager, ours, engine = _pair(model)
    x = torch.randn(64, 8)
    expected = eager(x)
    actual = engine(x)
    assert_close(actual, expected, "output (the eval() dropout must not drop)")
    expected.sum().backward()
    actual.sum().backward()
    for (name, a), b in zip(ours.named_parameters(), eager.parameters(), strict=True):
        assert_close(a.grad, b.grad, f"grad of {name}")


def test_switching_between_train_and_eval_builds_one_graph_each() -> None:
    torch.manual_seed(0)
    eager, ours, engine = _pair(BNDrop(p=0.0))
    x = torch.randn(6, 8)
    for mode in (True, False, True, False):
        eager.train(mode)
        ours.train(mode)
        assert_close(engine(x), eager(x), f"output in {'train' if mode else 'eval'} mode")
    assert engine.builds == 2
    assert_state_equal(ours, eager)


# ---------------------------------------------------------------------------------------------
# state
def test_first_call_leaves_params_buffers_and_rng_states_untouched() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = BNDrop()
    with torch.no_grad():
        model(torch.randn(16, 8))
    model.eval()
    engine = ModuleEngine(model)
    x = torch.randn(4, 8)
    before = snapshot_state(model)
    torch_rng = torch.get_rng_state()
    py_rng = random.getstate()
    np_rng = np.random.get_state()
    with torch.no_grad():
        engine(x)
    assert engine.builds == 1
    for name, value in model.state_dict(keep_vars=True).items():
        assert torch.equal(value, before[name]), f"{name} changed"
    assert torch.equal(torch.get_rng_state(), torch_rng), "torch RNG state moved"
    assert random.getstate() == py_rng, "python random state moved"
    after = np.random.get_state()
    assert (
        after[0] == np_rng[0] and np.array_equal(after[1], np_rng[1]) and after[2:] == np_rng[2:]
    ), "numpy RNG moved"


def test_first_call_does_not_break_a_pending_eager_backward() -> None:
    # An eval BatchNorm saves its running stats for backward. An export that writes the buffers
    # back (even with the same values) bumps their version and breaks that pending backward.
    torch.manual_seed(0)
    model = BNDrop()
    model.eval()
    x = torch.randn(4, 8, requires_grad=True)
    pending = model.bn(x @ torch.randn(8, 16))
    engine = ModuleEngine(model)
    with torch.no_grad():
        engine(torch.randn(4, 8))
    pending.sum().backward()  # eager alone would succeed
    assert x.grad is not None


def test_export_in_training_adds_no_extra_batchnorm_step() -> None:
    torch.manual_seed(0)
    eager, ours, engine = _pair(BNDrop(p=0.0))
    x = torch.randn(6, 8)
    eager(x).sum().backward()
    engine(x).sum().backward()
    assert int(ours.bn.num_batches_tracked) == 1
    assert_state_equal(ours, eager)


# ---------------------------------------------------------------------------------------------
# cache
def test_batch_sizes_after_the_first_share_one_graph() -> None:
    """The first batch size has a graph of its own, the next one the graph for every batch size
    (on the plain backend: symbolic in the batch, at least 2, so a batch of 1 gets its own),
    each equal to eager."""
    torch.manual_seed(0)
    eager, _ours, engine = _pair(Net())
    batches = (4, 7, 1, 32)
    for batch in batches:
        x = torch.randn(batch, 8)
        assert_close(engine(x), eager(x), f"batch {batch}")
    assert engine.builds == (3 if PLAIN else 2)


def test_sequence_lengths_after_the_first_share_one_graph() -> None:
    torch.manual_seed(0)
    eager, _ours, engine = _pair(Net())
    lengths = (3, 9, 5)
    for length in lengths:
        x = torch.randn(2, length, 8)
        assert_close(engine(x), eager(x), f"length {length}")
    assert engine.builds == 2  # the first shape's, then one for every length


def test_dtype_change_rebuilds() -> None:
    torch.manual_seed(0)
    eager, _ours, engine = _pair(Net())
    x = torch.randn(4, 8)
    assert_close(engine(x), eager(x), "float32 input")
    assert_close(engine(x.double()), eager(x.double()), "float64 input")
    assert engine.builds == 2


def test_rank_change_rebuilds() -> None:
    torch.manual_seed(0)
    eager, _ours, engine = _pair(Net())
    x = torch.randn(4, 8)
    assert_close(engine(x), eager(x), "rank 2")
    x3 = torch.randn(2, 4, 8)
    assert_close(engine(x3), eager(x3), "rank 3")
    assert engine.builds == 2


def test_requires_grad_change_of_input_rebuilds() -> None:
    torch.manual_seed(0)
    _, _, engine = _pair(Net())
    x = torch.randn(4, 8)
    engine(x)
    engine(x.clone().requires_grad_())
    assert engine.builds == 2


def test_lru_bound_and_evictions() -> None:
    torch.manual_seed(0)
    model = Net()
    engine = ModuleEngine(model, EngineOptions(cache_size=2))
    shapes = [(4, 8), (2, 4, 8), (2, 2, 4, 8)]
    for shape in shapes:
        engine(torch.randn(*shape))
    assert engine.builds == 3
    assert engine.cached_graphs == 2
    assert engine.evictions == 1
    engine(torch.randn(*shapes[2]))  # most recent: a hit
    assert engine.builds == 3
    engine(torch.randn(*shapes[0]))  # evicted first: rebuilt, evicting the least recent again
    assert engine.builds == 4
    assert engine.cached_graphs == 2
    assert engine.evictions == 2


def test_invalidate_forces_rebuild_with_reason() -> None:
    torch.manual_seed(0)
    engine = ModuleEngine(Net())
    x = torch.randn(4, 8)
    engine(x)
    engine.invalidate("because the test says so")
    engine(x)
    assert engine.builds == 2
    assert engine.records[-1].reason == "because the test says so"


# ---------------------------------------------------------------------------------------------
# typed errors
def test_unsupported_keyword_input_names_the_argument() -> None:
    engine = ModuleEngine(Net())
    with pytest.raises(UnsupportedInputError) as info:
        engine(torch.randn(2, 8), extra=object())
    err = info.value
    assert isinstance(err, EngineError)
    assert "extra" in str(err) and "object" in str(err)
    assert err.module_class == "Net"
    assert err.kind is FailureKind.UNSUPPORTED_DATA
    assert err.cause and err.remedy


def test_unsupported_numpy_positional_input_names_the_argument() -> None:
    engine = ModuleEngine(Net())
    with pytest.raises(UnsupportedInputError) as info:
        engine(torch.randn(2, 8), np.zeros(3))
    assert "#1" in str(info.value) and "ndarray" in str(info.value)


def test_inputs_on_two_devices_raise_mixed_devices() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, a, b):
            return self.fc(a) + b

    engine = ModuleEngine(Two())
    with pytest.raises(MixedDevicesError) as info:
        engine(torch.randn(2, 8), torch.empty(2, 4, device="meta"))
    assert info.value.kind is FailureKind.UNSUPPORTED_DEVICE
    assert "meta" in str(info.value)


def test_parameters_and_inputs_on_different_devices_raise_mixed_devices() -> None:
    model = Net().to("meta")
    engine = ModuleEngine(model)
    with pytest.raises(MixedDevicesError) as info:
        engine(torch.randn(2, 8))
    assert "meta" in str(info.value) and "cpu" in str(info.value)


def test_build_failure_is_remembered_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    class Unexportable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            # exported (training build) or traced by torch's autograd (plain backend: the
            # input is a FunctionalTensor/FakeTensor there)
            if torch.onnx.is_in_onnx_export() or type(x) is not torch.Tensor:
                raise RuntimeError("this module cannot be exported")
            return self.fc(x)

    attempts = []
    if PLAIN:
        from ort_autopatch.engine.backends.ort import capture as where

        name = "capture"
    else:
        where, name = engine_export, "export_call"
    real = getattr(where, name)

    def counting(*args, **kwargs):
        attempts.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(where, name, counting)
    engine = ModuleEngine(Unexportable())
    x = torch.randn(2, 8)
    with pytest.raises(ExportError) as info:
        engine(x)
    assert "cannot be exported" in str(info.value)
    first = len(attempts)  # the first build may try more than one way (e.g. static shapes)
    assert first >= 1
    for _ in range(3):
        with pytest.raises(ExportError):
            engine(x)
    assert len(attempts) == first, (
        f"export retried: {first} attempt(s) at the first call, {len(attempts)} after four"
    )


# ---------------------------------------------------------------------------------------------
# threads
def _grads(engine: ModuleEngine, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = engine(x)
    return [y.detach(), *torch.autograd.grad(y.pow(2).sum(), [x, *model.parameters()])]


def test_concurrent_calls_match_serial() -> None:
    torch.manual_seed(0)
    model = Net()
    engine = ModuleEngine(model)
    inputs = [torch.randn(5, 8) for _ in range(8)]
    serial = [_grads(engine, model, x) for x in inputs]
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for _ in range(10):
                for k in range(offset, len(inputs), 2):
                    results[k] = _grads(engine, model, inputs[k])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, expected in enumerate(serial):
        for j, (a, e) in enumerate(zip(results[k], expected, strict=True)):
            assert_close(a, e, f"input {k} result {j}")
    # one graph for the one shape, built by one thread
    assert engine.builds == 1


def test_concurrent_first_calls_build_once() -> None:
    torch.manual_seed(0)
    model = Net()
    engine = ModuleEngine(model)
    barrier = threading.Barrier(2)
    x = torch.randn(3, 8)
    outputs: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            outputs.append(engine(x).detach())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert engine.builds == 1
    assert len(engine.records) == 1
    assert torch.equal(outputs[0], outputs[1])


# ---------------------------------------------------------------------------------------------
# inputs and changes to the module
def test_input_requires_grad_gives_input_grads_like_eager() -> None:
    torch.manual_seed(0)
    eager, _ours, engine = _pair(Net())
    x = torch.randn(4, 8)
    xe = x.clone().requires_grad_()
    xo = x.clone().requires_grad_()
    eager(xe).pow(2).sum().backward()
    engine(xo).pow(2).sum().backward()
    assert xo.grad is not None
    assert_close(xo.grad, xe.grad, "input grad")


def test_replaced_parameter_is_picked_up() -> None:
    torch.manual_seed(0)
    eager, ours, engine = _pair(Net())
    x = torch.randn(4, 8)
    engine(x)
    new = torch.randn(16, 8)
    eager.fc.weight = nn.Parameter(new.clone())
    ours.fc.weight = nn.Parameter(new.clone())
    expected, actual = eager(x), engine(x)
    assert_close(actual, expected, "output after replacing fc.weight")
    expected.sum().backward()
    actual.sum().backward()
    assert ours.fc.weight.grad is not None, "the new parameter got no gradient"
    assert_close(ours.fc.weight.grad, eager.fc.weight.grad, "grad of the new fc.weight")


def _twin_steps(
    eager: nn.Module, ours: nn.Module, engine: ModuleEngine, what: str, batch: int = 4
) -> None:
    """One training call and one no-grad eval call on both twins, outputs and grads compared."""
    x = torch.randn(batch, 8)
    for p in (*eager.parameters(), *ours.parameters()):
        p.grad = None
    expected, actual = eager(x), engine(x)
    assert_close(actual, expected, f"output {what} (batch {batch})")
    expected.sum().backward()
    actual.sum().backward()
    for (name, pe), po in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert_close(po.grad, pe.grad, f"grad of {name} {what} (batch {batch})")
    eager.eval(), ours.eval()
    with torch.no_grad():
        assert_close(engine(x), eager(x), f"eval output {what} (batch {batch})")
    eager.train(), ours.train()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda p, new: setattr(p, "data", new), id="data-assigned"),
        pytest.param(lambda p, new: p.set_(new), id="set-to-other-storage"),
        pytest.param(lambda p, new: p.data.copy_(new), id="copied-in-place"),
        # the same memory read with other strides: the address alone cannot tell
        pytest.param(
            lambda p, new: setattr(p, "data", p.data.as_strided(p.shape, (1, p.shape[0]))),
            id="same-memory-other-strides",
        ),
    ],
)
def test_parameter_memory_changed_between_calls_is_read(change) -> None:
    """ORT's views of parameters are kept from call to call (`dlpack.KeptValues`), by each
    graph: any change of what a parameter holds, through new memory or in place, is what the
    next call of every graph reads (the static-shape graph of batch 4, the first shape, the
    graph serving batch 6, and the eval graphs)."""
    torch.manual_seed(0)
    eager, ours, engine = _pair(Net())
    for _ in range(2):
        _twin_steps(eager, ours, engine, "before")
    _twin_steps(eager, ours, engine, "before", batch=6)
    # plain: a graph for batch 4 and a symbolic one for batch 6, neither a hot shape's
    expected_hot = [False, False] if PLAIN else [True, False]
    assert [r.hot_shape for r in engine.records if r.has_backward] == expected_hot
    builds = engine.builds
    new = torch.randn(16, 8)
    with torch.no_grad():
        change(eager.fc.weight, new.clone())
        change(ours.fc.weight, new.clone())
    for batch in (4, 6, 4):
        _twin_steps(eager, ours, engine, "after the change", batch=batch)
    assert engine.builds == builds  # the change rebuilt nothing


class Masked(nn.Module):
    """A boolean buffer fed to the graph (bools cross to ORT as uint8 plus a flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mask", torch.rand(8) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(self.mask, 0.0)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda b: b.logical_not_(), id="flipped-in-place"),
        pytest.param(lambda b: setattr(b, "data", ~b.data), id="data-assigned"),
    ],
)
def test_boolean_buffer_changed_between_calls_is_read(change) -> None:
    torch.manual_seed(0)
    eager, ours, engine = _pair(Masked())
    for step in range(4):
        x = torch.randn(3 + step, 8)
        expected, actual = eager(x), engine(x)
        assert_close(actual, expected, f"output at step {step}")
        expected.sum().backward()
        actual.sum().backward()
        assert_close(ours.fc.weight.grad, eager.fc.weight.grad, f"weight grad at step {step}")
        with torch.no_grad():
            change(eager.mask)
            change(ours.mask)
    assert engine.builds == 2  # the first shape's, then one for every batch size


def test_buffer_assigned_between_calls_is_read() -> None:
    torch.manual_seed(0)
    eager, ours, engine = _pair(BNDrop(p=0.0))
    x = torch.randn(6, 8)
    eager.eval(), ours.eval()
    with torch.no_grad():
        engine(x)
        mean = torch.randn(16)
        eager.bn.running_mean.data = mean.clone()
        ours.bn.running_mean.data = mean.clone()
        assert_close(engine(x), eager(x), "output after running_mean.data was assigned")


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.scale


def test_parameters_are_wrapped_for_ort_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first call only the call's own values are wrapped (DLPack) for ORT: the
    input in forward; in backward the output's gradient, never a parameter. The plain
    backend's dense CPU feeds go by address (`dlpack._by_address`): it wraps only the
    gradient, which `sum()`'s backward expands (not dense)."""
    from ort_autopatch.engine import dlpack

    net = _Scaled()  # backward reads `scale` itself
    engine = ModuleEngine(net)
    x = torch.randn(4, 8)
    engine(x).sum().backward()
    wrapped: list[torch.Tensor] = []
    real = dlpack.to_dlpack

    def counting(tensor: torch.Tensor) -> object:
        wrapped.append(tensor)
        return real(tensor)

    monkeypatch.setattr(dlpack, "to_dlpack", counting)
    y = engine(x)
    assert [tuple(t.shape) for t in wrapped] == ([] if PLAIN else [(4, 8)])  # forward
    wrapped.clear()
    y.sum().backward()
    assert [tuple(t.shape) for t in wrapped] == [(4, 4)]


def test_replaced_submodule_is_picked_up() -> None:
    torch.manual_seed(0)
    eager, ours, engine = _pair(Net())
    x = torch.randn(4, 8)
    engine(x)
    eager.act = nn.Tanh()
    ours.act = nn.Tanh()
    assert_close(engine(x), eager(x), "output after replacing act")
    head = nn.Linear(16, 4)
    eager.out = copy.deepcopy(head)
    ours.out = copy.deepcopy(head)
    expected, actual = eager(x), engine(x)
    assert_close(actual, expected, "output after replacing out")
    expected.sum().backward()
    actual.sum().backward()
    assert_close(ours.out.weight.grad, eager.out.weight.grad, "grad of the new out.weight")


def test_model_double_is_picked_up_in_eval_and_refused_for_training() -> None:
    torch.manual_seed(0)
    eager, ours, engine = _pair(Net(nn.Tanh()))
    x = torch.randn(4, 8)
    engine(x)
    eager.double().eval()
    ours.double().eval()
    xd = x.double()
    with torch.no_grad():
        expected, actual = eager(xd), engine(xd)
    assert actual.dtype == torch.float64
    assert_close(actual, expected, "float64 output")
    assert engine.builds == 2
    ours.train()
    if PLAIN:  # the maintained onnxruntime has float64 gradient kernels: trained in ORT
        eager.train()
        assert type(engine(xd).grad_fn).__name__ == TRAINING_NODE
        _twin_steps(eager, ours, engine, "in float64")
        return
    # ONNX Runtime 1.19.2 lacks float64 gradient kernels for common operators: refused before
    # any gradient build, naming the dtype (the fallback policy turns it into an eager run).
    with pytest.raises(EngineError, match="float64"):
        engine(xd)


def test_float64_relu_training_raises_typed_error() -> None:
    """The training build refuses it; the plain backend trains it in ORT like eager."""
    if PLAIN:
        torch.manual_seed(0)
        eager, ours, engine = _pair(Net(nn.ReLU()).double())
        assert type(engine(torch.randn(4, 8, dtype=torch.float64)).grad_fn).__name__ == (
            TRAINING_NODE
        )
        _twin_steps(eager, ours, engine, "in float64")
        return
    engine = ModuleEngine(Net(nn.ReLU()).double())
    with pytest.raises(EngineError, match="training with float64"):
        engine(torch.randn(4, 8, dtype=torch.float64))


def test_in_place_weight_change_between_forward_and_backward_raises() -> None:
    torch.manual_seed(0)
    eager, ours, engine = _pair(Net())
    x = torch.randn(4, 8)
    y_eager = eager(x)
    with torch.no_grad():
        eager.out.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="inplace"):
        y_eager.sum().backward()  # what eager does
    y = engine(x)
    with torch.no_grad():
        ours.out.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_a_training_call_runs_as_torch_s_own_autograd_function() -> None:
    """A training call skips `Function.apply`'s Python layer (`graph_function.apply`): the
    graph is still one `GraphFunction` node of autograd, whose gradients reach every parameter."""
    torch.manual_seed(0)
    eager, ours, engine = _pair(Net())
    out = engine(torch.randn(4, 8))
    assert type(out.grad_fn).__name__ == TRAINING_NODE
    for batch in (4, 6, 4, 1, 7):  # sizes that change every call, a batch of one among them
        _twin_steps(eager, ours, engine, "through the direct apply", batch=batch)


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda engine, x: torch.func.vmap(engine)(x.unsqueeze(1)), id="vmap"),
        pytest.param(lambda engine, x: torch.func.grad(lambda t: engine(t).sum())(x), id="grad"),
    ],
)
def test_a_training_call_under_functorch_transforms_takes_torch_s_own_path(transform) -> None:
    """Under vmap or grad, `graph_function.apply` hands the call to `Function.apply`, which
    refuses a Function without `setup_context` in torch's words, as before the direct apply."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    engine = ModuleEngine(model)
    x = torch.randn(2, 4)
    engine(x).sum().backward()  # the graph is built outside the transform
    if PLAIN:  # refused with a reason: the fallback policy runs it in PyTorch
        with pytest.raises(UnsupportedInputError, match="functorch transform"):
            transform(engine, x)
        return
    with pytest.raises(RuntimeError, match="it must override the setup_context staticmethod"):
        transform(engine, x)


# ---------------------------------------------------------------------------------------------
# settings
def test_settings_set_on_an_engine_make_the_sessions_it_builds_next(tmp_path) -> None:
    """`ModuleEngine.settings` decides how the sessions of graphs built from then on are made:
    the benchmarks' alternatives (threads, spinning, optimisation level) and ORT's profiler go
    through it."""
    import dataclasses

    from ort_autopatch.engine import session

    engine = ModuleEngine(nn.Linear(4, 4))
    engine.settings = dataclasses.replace(engine.settings, profile_prefix=str(tmp_path / "ort"))
    engine(torch.randn(2, 4)).sum().backward()
    profiles = session.end_profiles()
    assert profiles and all(p.startswith(str(tmp_path)) for p in profiles)
    assert session.end_profiles() == []  # ended already: no second file, no empty name
