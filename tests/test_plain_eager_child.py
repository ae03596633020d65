"""The first-call check's eager side, made by a child forked while the build traces
(`eager_child`): used where it stands for the run here, eager's run here everywhere else."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch.engine import EngineOptions, ModuleEngine, eager_child, sandbox, verify
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, ran_in_plain_ort

pytestmark = [
    pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON),
    pytest.mark.skipif(not sandbox.available(), reason="the eager child is forked"),
]

#: this process: a forward that checks it runs in the child compares with it
PARENT = os.getpid()


class _Net(nn.Module):
    """BatchNorm (buffers written in the forward), a frozen layer and a parameter the call
    leaves unused (a gradient of None)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.frozen = nn.Linear(4 * 8 * 8, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 5)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.head(self.frozen(y)), y.sum()


class _Record:
    """What the checks of this process ran (`verify._side`'s runs, by name) and what the
    eager children gave (`EagerChild.side`, `EagerChild.nudged` by seed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.here: list[str] = []
        self.taken: list[verify.Side | None] = []
        self.nudged: list[tuple[int, verify.Side | None]] = []
        side, take, nudged = (
            verify._side,
            eager_child.EagerChild.side,
            eager_child.EagerChild.nudged,
        )

        def recorded_side(run: Callable[..., Any], *args: Any) -> verify.Side:
            self.here.append(run.__name__)
            return side(run, *args)

        def recorded_take(child: eager_child.EagerChild) -> verify.Side | None:
            self._wait(child)
            self.taken.append(take(child))
            return self.taken[-1]

        def recorded_nudged(child: eager_child.EagerChild, seed: int) -> verify.Side | None:
            self._wait(child)
            self.nudged.append((seed, nudged(child, seed)))
            return self.nudged[-1][1]

        #: a child is given the time its runs take (a loaded machine may slow it past the
        #: graph's run), except where a test measures what happens when it is slow
        self.patient = True
        monkeypatch.setattr(eager_child, "WAIT_SECONDS", 120.0)
        monkeypatch.setattr(verify, "_side", recorded_side)
        monkeypatch.setattr(eager_child.EagerChild, "side", recorded_take)
        monkeypatch.setattr(eager_child.EagerChild, "nudged", recorded_nudged)

    def _wait(self, child: eager_child.EagerChild) -> None:
        if self.patient:
            _until_answered(child, 120)


def _until_answered(child: eager_child.EagerChild, seconds: float) -> None:
    """Wait until `child` has said something (a run, its forward done, a failure), is closed
    (its pipes' numbers may be another file's by now), or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while not child._closed and not child._child.answered() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def normal_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """Children run at the normal priority: at Linux's idle class a child gets almost no
    CPU while other processes keep both cores busy (two spinning processes kept one from
    its forward for the 120 s a test waits), which a test machine's other jobs may do.
    `test_the_child_runs_on_cpu_time_nobody_else_wants` checks the idle class itself."""
    monkeypatch.setattr(eager_child, "_lowest_priority", lambda: None)


@pytest.fixture
def spare_core(monkeypatch: pytest.MonkeyPatch, normal_priority: None) -> Iterator[_Record]:
    """Every build forks a lowering child (this process has imported the exporter, which
    otherwise lowers here), a core is spare, and what the checks ran is recorded."""
    from ort_autopatch.engine.backends.ort import offload

    monkeypatch.setattr(offload, "_EXPORTER", "not.imported.anywhere")
    monkeypatch.setattr(offload, "_core_to_spare", lambda probe=None: True)
    offload.close_kept()
    yield _Record(monkeypatch)
    offload.close_kept()


def _first_step(model: nn.Module, x: torch.Tensor, tmp_path: Any) -> ModuleEngine:
    """The first call through the plain backend and its backward, with eager's numbers."""
    eager = copy.deepcopy(model)
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=tmp_path))
    out, expected = engine(x), eager(x)
    assert ran_in_plain_ort(out[0])
    for a, e in zip(out, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    (out[0].pow(2).mean() + out[1]).backward()
    (expected[0].pow(2).mean() + expected[1]).backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c)
    return engine


def test_the_first_calls_check_takes_eagers_side_from_the_child(
    spare_core: _Record, tmp_path: Any
) -> None:
    """The graph runs here; eager's side, forward and backward, comes from the child."""
    torch.manual_seed(0)
    engine = _first_step(_Net(), torch.randn(2, 3, 8, 8), tmp_path)
    assert [v.mismatch for v in engine.verifications] == [None]
    assert len(spare_core.taken) == 1 and spare_core.taken[0] is not None
    assert spare_core.here == ["run_graph"]


def _miss(model: nn.Module, x: torch.Tensor) -> Any:
    from ort_autopatch.engine import signature, state
    from ort_autopatch.engine.recipe import Miss

    call = signature.flatten_call(type(model).__name__, (x,), {})
    return Miss(model, state.ModuleState(model), call, True, torch.device("cpu"), None, None)


def _forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def test_the_childs_runs_are_eagers_runs_here_bit_for_bit(normal_priority: None) -> None:
    """The plain run and the first seed's nudged run: outputs and gradients (None for the
    unused parameter; none of the frozen layer) equal those `verify.eager_side` makes here
    on the same thread count from the same state, which the child leaves as it was."""

    torch.manual_seed(0)
    model, x = _Net(), torch.randn(2, 3, 8, 8)
    before = copy.deepcopy(model.state_dict())
    miss = _miss(model, x)
    child = eager_child.EagerChild.start(miss, _forward)
    assert child is not None
    made: list[verify.Side | None] = []
    try:
        for take in (child.side, lambda: child.nudged(eager_child.SEED)):
            _until_answered(child, 60)  # past its forward: asked now, it waits for the rest
            made.append(take())
    finally:
        child.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainable = verify.trainable_of(miss.state, True)
        expected = [
            verify.eager_side(model, miss.call, _forward, trainable, True, seed=seed)
            for seed in (None, eager_child.SEED)
        ]
    finally:
        torch.set_num_threads(threads)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    for side, (outputs, gradients) in zip(made, expected, strict=True):
        assert side is not None
        assert len(side[0]) == len(outputs) == 2
        assert [g is None for g in side[1]] == [g is None for g in gradients]
        assert sum(g is None for g in gradients) == 1  # the unused parameter
        for a, e in zip([*side[0], *side[1]], [*outputs, *gradients], strict=True):
            assert a is None or (e is not None and torch.equal(a, e))
    assert not torch.equal(made[0][0][0], made[1][0][0])  # type: ignore[index]  # nudged


def _scale_a_weight(model: nn.Module) -> None:
    model.conv.weight.mul_(1.0)  # the same values, a new version


def _step_the_statistics(model: nn.Module) -> None:
    model.bn.running_mean.add_(0.5)


def _restore_the_statistics(model: nn.Module) -> None:
    model.bn.running_mean.copy_(model.bn.running_mean.clone())  # as a trace's restore does


@pytest.mark.parametrize(
    ("write", "stale"),
    [(_scale_a_weight, True), (_step_the_statistics, True), (_restore_the_statistics, False)],
)
def test_a_state_written_since_the_fork_runs_eager_here(
    spare_core: _Record,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    write: Callable[[nn.Module], None],
    stale: bool,
) -> None:
    """A parameter written in place after the child forked (a build in a thread while the
    user trains on), or a buffer given other values: the child's side is of another state,
    and eager runs here. A buffer written back with its own values (a trace's restore of
    BatchNorm's statistics) is the state the child ran from."""
    from ort_autopatch.engine.build import Builder

    fork = Builder._fork_eager

    def fork_then_write(builder: Builder, miss: Any) -> None:
        fork(builder, miss)
        with torch.no_grad():
            write(miss.module)

    monkeypatch.setattr(Builder, "_fork_eager", fork_then_write)
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(2, 3, 8, 8)
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=tmp_path))
    assert ran_in_plain_ort(engine(x)[0])
    assert [v.mismatch for v in engine.verifications] == [None]
    if stale:
        assert spare_core.taken == []  # never asked
        assert spare_core.here == ["run_graph", "run_eager"]
    else:
        assert len(spare_core.taken) == 1 and spare_core.taken[0] is not None
        assert spare_core.here == ["run_graph"]


class _SlowInTheChild(nn.Module):
    """A forward that takes a minute in any process but this one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if os.getpid() != PARENT:
            time.sleep(60)
        y = self.lin(x)
        return y, y.sum()


def _slow_gradient(gradient: torch.Tensor) -> torch.Tensor:

    time.sleep(60)
    return gradient


class _SlowBackwardInTheChild(nn.Module):
    """A backward that takes a minute in any process but this one (the forward is quick)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        if os.getpid() != PARENT:
            y.register_hook(_slow_gradient)
        return y, y.sum()


class _FailsInTheChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if os.getpid() != PARENT:
            raise RuntimeError("injected: eager fails in the child")
        y = self.lin(x)
        return y, y.sum()


@pytest.mark.parametrize("model", [_SlowInTheChild, _SlowBackwardInTheChild, _FailsInTheChild])
def test_a_slow_or_failed_child_leaves_eager_here(
    spare_core: _Record, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, model: type[nn.Module]
) -> None:
    """A child still in its forward once the graph has run is closed, not waited for (its
    one thread would cost more than the run here); one past its forward is waited for about
    as long as its backward should take (a starved child would stall the call), then
    closed; a failed child gives nothing. Each way eager runs here and the check holds."""

    from ort_autopatch.engine.backends.ort import offload

    # the lowering child is forked from this process too: it would sleep or fail in its
    # count run, so the count is made here (as with a child kept from an earlier build)
    start_lowerer = offload.Lowerer.start
    monkeypatch.setattr(
        offload.Lowerer, "start", staticmethod(lambda count, *rest: start_lowerer(None, *rest))
    )
    spare_core.patient = False
    monkeypatch.setattr(eager_child, "WAIT_SECONDS", 1.0)
    torch.manual_seed(0)
    start = time.perf_counter()
    engine = _first_step(model(), torch.randn(5, 4), tmp_path)
    assert time.perf_counter() - start < 30
    assert [v.mismatch for v in engine.verifications] == [None]
    assert spare_core.taken == [None]
    assert spare_core.here == ["run_graph", "run_eager"]


def test_a_wrong_graph_is_refused_against_the_childs_side(
    spare_core: _Record, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BatchNorm lowered as in inference (the exporter's mistranslation, its decomposition
    dropped): refused against the child's eager side, and the module left as it was."""
    from ort_autopatch.engine.backends.ort import decompositions

    dropped = torch.ops.aten._native_batch_norm_legit_functional.default
    table = decompositions.table

    def without_batch_norm(*args: Any) -> dict[Any, Any]:
        return {k: v for k, v in table(*args).items() if k is not dropped}

    monkeypatch.setattr(decompositions, "table", without_batch_norm)
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(2, 3, 8, 8)
    before = copy.deepcopy(model.state_dict())
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=tmp_path))
    with pytest.raises(verify.VerificationError, match="output 0 differs"):
        engine(x)
    assert len(spare_core.taken) == 1 and spare_core.taken[0] is not None
    # the first seed's spread from the child too; the second's (and float64's) made here
    assert [(seed, side is not None) for seed, side in spare_core.nudged] == [
        (1, True),
        (2, False),
    ]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class _Logged(nn.Module):
    """Notes the process of every forward on real tensors."""

    def __init__(self, log: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.log = log

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(x, torch._subclasses.FakeTensor):
            with open(self.log, "a") as out:
                out.write(f"{os.getpid()}\n")
        y = self.lin(x)
        return y, y.sum()


def test_no_child_runs_a_forward_where_torch_distributed_is_initialised(
    spare_core: _Record, tmp_path: Any
) -> None:
    """A forward may join a collective (SyncBatchNorm's), which a child would make on this
    process's connections: with a process group up, every forward runs here (the eager
    child's and the lowering child's count run alike)."""
    import torch.distributed as dist

    log = tmp_path / "forwards"
    log.write_text("")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        engine = _first_step(_Logged(log), torch.randn(5, 4), tmp_path)
    finally:
        dist.destroy_process_group()
    assert [v.mismatch for v in engine.verifications] == [None]
    assert spare_core.taken == []
    assert spare_core.here == ["run_graph", "run_eager"]
    assert {int(pid) for pid in log.read_text().split()} == {PARENT}


def test_tensors_the_child_cannot_stamp_leave_eager_here(
    spare_core: _Record, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor whose storage cannot be read (a subclass without storage of its own): no
    child, and the build goes on with eager's runs here."""

    def no_storage(miss: Any) -> Any:
        raise RuntimeError("injected: this tensor has no storage")

    monkeypatch.setattr(eager_child, "_where", no_storage)
    torch.manual_seed(0)
    engine = _first_step(_Net(), torch.randn(2, 3, 8, 8), tmp_path)
    assert [v.mismatch for v in engine.verifications] == [None]
    assert spare_core.taken == []
    assert spare_core.here == ["run_graph", "run_eager"]


def test_an_inference_calls_check_takes_eagers_outputs_from_the_child(
    spare_core: _Record, tmp_path: Any
) -> None:
    """A call without gradients (under no_grad, eval mode): the child's run is outputs
    alone, and they stand for eager's here."""
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(2, 3, 8, 8)
    eager = copy.deepcopy(model)
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=tmp_path))
    with torch.no_grad():
        out, expected = engine(x), eager(x)
    for a, e in zip(out, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert [r.has_backward for r in engine.records] == [False]
    assert [v.mismatch for v in engine.verifications] == [None]
    (side,) = spare_core.taken
    assert side is not None and len(side[0]) == 2 and side[1] == []
    assert spare_core.here == ["run_graph"]


def test_a_build_after_a_backward_takes_eagers_side_from_the_child(
    spare_core: _Record, tmp_path: Any
) -> None:
    """A second module's first call, after the first one's backward: its child runs a
    backward too (autograd's engine was not started by the first trace's backward on fake
    tensors, whose threads forbid one in a forked child)."""
    torch.manual_seed(0)
    _first_step(_Net(), torch.randn(2, 3, 8, 8), tmp_path / "first")
    engine = _first_step(_Net(), torch.randn(2, 3, 8, 8), tmp_path / "second")
    assert [v.mismatch for v in engine.verifications] == [None]
    assert len(spare_core.taken) == 2 and all(side is not None for side in spare_core.taken)
    assert spare_core.here == ["run_graph", "run_graph"]


def test_the_child_runs_on_cpu_time_nobody_else_wants() -> None:
    """`_lowest_priority`, as the child calls it: Linux's idle scheduling class (where the
    kernel has it), niced besides. Read from here: at the idle class, the process itself
    may get no CPU to report it while other processes keep the cores busy."""

    code = (
        "import os, sys; from ort_autopatch.engine import eager_child; "
        "eager_child._lowest_priority(); sys.stdin.read()"
    )
    nice = os.nice(0)
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        deadline = time.monotonic() + 120
        while os.sched_getscheduler(process.pid) != os.SCHED_IDLE:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with open(f"/proc/{process.pid}/stat") as stat:
            niceness = int(stat.read().rsplit(")", 1)[1].split()[16])
        assert niceness == nice + eager_child.NICENESS
    finally:
        process.kill()
        process.wait()
