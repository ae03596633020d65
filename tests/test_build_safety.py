"""Graphs ONNX Runtime cannot train fall back before they can hurt: unsupported dtypes are
refused with the dtype named, and a gradient builder that aborts takes only a child with it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch import patcher, report
from ort_autopatch.engine import sandbox
from tests.helpers import assert_close, patched, plain_backend


class TwoBranch(nn.Module):
    """A concat: its gradient (SplitTraining) has no float64 kernel in ORT 1.19.2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.cat([self.a(x), self.b(x)], -1))


class Diagonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diagonal(self.fc(x), dim1=-2, dim2=-1).sum()


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched((TwoBranch, Diagonal))


def _stats(cls: type) -> report.ClassStats:
    return report.stats_for(patcher.class_name(cls))


def _train_both(cls: type, dtype: torch.dtype, steps: int = 3) -> None:
    """Train a patched model and an unpatched copy; every step must equal eager's."""
    torch.manual_seed(0)
    ours = cls().to(dtype)
    eager = cls().to(dtype)
    eager.load_state_dict(ours.state_dict())
    patched_call = cls.__call__
    for step in range(steps):
        x = torch.randn(8, 8, dtype=dtype)
        actual = ours(x)
        actual.square().sum().backward()
        expected = nn.Module.__call__(eager, x)
        expected.square().sum().backward()
        assert cls.__call__ is patched_call
        assert_close(actual, expected, f"step {step} output")
        for (name, p), q in zip(ours.named_parameters(), eager.parameters(), strict=True):
            assert_close(p.grad, q.grad, f"step {step} grad of {name}")


@pytest.mark.skipif(
    plain_backend(),
    reason="the training build's limit (ORT 1.19.2 has no float64 SplitTraining); the plain "
    "backend trains float64 (test_float64_concat_trains_in_ort_on_the_plain_backend)",
)
def test_float64_concat_falls_back_with_the_dtype_in_the_reason() -> None:
    _train_both(TwoBranch, torch.float64)
    stats = _stats(TwoBranch)
    assert stats.ort_calls == 0
    (reason, detail), count = next(iter(stats.fallbacks.items()))
    assert "float64" in detail and count == 3, stats.fallbacks
    assert stats.eager_calls[f"fallback: {reason}"] == 3


@pytest.mark.skipif(not plain_backend(), reason="the training build refuses float64 training")
def test_float64_concat_trains_in_ort_on_the_plain_backend() -> None:
    """torch's own gradient graph, run by ORT's float64 kernels."""
    _train_both(TwoBranch, torch.float64)
    assert _stats(TwoBranch).ort_calls == 3


def test_float32_concat_still_trains_in_ort() -> None:
    _train_both(TwoBranch, torch.float32)
    assert _stats(TwoBranch).ort_calls == 3


def test_float64_eval_runs_in_ort() -> None:
    torch.manual_seed(0)
    model = TwoBranch().double().eval()
    x = torch.randn(4, 8, dtype=torch.float64)
    with torch.no_grad():
        actual = model(x)
        expected = nn.Module.__call__(model, x)
    assert_close(actual, expected, "float64 eval output")
    assert _stats(TwoBranch).ort_calls == 1


@pytest.mark.skipif(not sandbox.available(), reason="the gradient build runs in a forked child")
def test_torch_diagonal_survives_the_gradient_builder_abort_and_equals_eager(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """ORT's gradient builder aborts (a libstdc++ assertion) on the dynamic-shape export of
    `torch.diagonal`: only the forked child dies; the engine then builds per input shape."""
    _train_both(Diagonal, torch.float32)
    stats = _stats(Diagonal)
    assert stats.ort_calls == 3, stats
    assert "Assertion" not in capfd.readouterr().err


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_sandbox_reports_an_abort_with_its_signal_and_message() -> None:
    def abort() -> None:
        os.write(2, b"some_file.h:12: Assertion 'n < size' failed.\n")
        os.abort()

    with pytest.raises(sandbox.Crashed) as caught:
        sandbox.run(abort)
    assert caught.value.signal_name == "SIGABRT"
    assert "Assertion 'n < size' failed" in caught.value.detail


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_sandbox_returns_results_and_carries_errors_back() -> None:
    assert sandbox.run(lambda: {"model": b"x" * 3_000_000})["model"] == b"x" * 3_000_000
    with pytest.raises(sandbox.ChildError, match="ZeroDivisionError"):
        sandbox.run(lambda: 1 / 0)


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_a_child_whose_result_arrived_is_reaped_without_being_waited_for() -> None:
    """The result is returned once it has arrived; the child's exit is reaped meanwhile (it
    unmaps its copy of this process's memory, milliseconds nobody needs to wait for)."""
    pid = sandbox.run(os.getpid)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            # WNOWAIT: looks without reaping, so the sandbox's reaper never loses the child
            # to this test (on a loaded machine the test's own waitpid once won that race)
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return  # the sandbox reaped it: no zombie left behind
        time.sleep(0.01)
    raise AssertionError("the child was never reaped: a zombie left for someone else")


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_meanwhile_runs_here_while_the_child_works_and_its_error_wins() -> None:
    seen: list[int] = []
    assert sandbox.run(os.getpid, meanwhile=lambda: seen.append(os.getpid())) != os.getpid()
    assert seen == [os.getpid()]

    def fail() -> None:
        raise KeyError("meanwhile")

    with pytest.raises(KeyError, match="meanwhile"):
        sandbox.run(os.getpid, meanwhile=fail)


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_while_waiting_runs_here_until_the_child_answers() -> None:
    calls: list[float] = []

    def slow_child() -> float:
        time.sleep(0.5)
        return time.monotonic()

    def piece() -> bool:
        calls.append(time.monotonic())
        time.sleep(0.01)
        return True

    answered = sandbox.run(slow_child, while_waiting=piece)
    assert len(calls) > 5, "it was called again and again while the child worked"
    assert calls[-1] <= answered + 0.05, "it kept going after the child had answered"


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_while_waiting_stops_when_it_has_nothing_left_to_do() -> None:
    calls: list[int] = []

    def slow_child() -> int:
        time.sleep(0.2)
        return 7

    assert sandbox.run(slow_child, while_waiting=lambda: calls.append(1) is not None) == 7
    assert calls == [1]


def test_while_waiting_never_runs_without_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "available", lambda: False)
    calls: list[int] = []
    assert sandbox.run(lambda: 3, while_waiting=lambda: calls.append(1) is None) == 3
    assert calls == []


def _echo_twice(receive: Callable[[], Any], send: Callable[[Any], None]) -> None:
    send(("ready", os.getpid()))
    for _ in range(2):
        send(receive() * 2)


def _fail(receive: Callable[[], Any], send: Callable[[Any], None]) -> None:
    raise KeyError("in the child")


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_a_started_child_answers_each_request_in_order() -> None:
    child = sandbox.Child.spawn(_echo_twice)
    assert child is not None
    try:
        assert child.receive(60)[1] != os.getpid()
        child.send(b"x" * 3_000_000)
        child.send(21)
        assert child.receive(60) == b"x" * 6_000_000
        assert child.receive(60) == 42
    finally:
        child.close()


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_requests_sent_while_the_child_writes_a_long_answer_do_not_hang() -> None:
    """Two requests larger than a pipe holds, sent back to back: the child answers the first
    with more than a pipe holds while the second is still being sent. Both sides wrote and
    neither read (the lowering child hung so on a BERT's graphs); now the answer is read in
    while the request goes out."""
    child = sandbox.Child.spawn(_echo_twice)
    assert child is not None
    answers: list[Any] = []

    def talk() -> None:
        child.receive(60)
        child.send(b"x" * 3_000_000, timeout=60)
        child.send(b"y" * 3_000_000, timeout=60)
        answers.extend([child.receive(60), child.receive(60)])

    talking = threading.Thread(target=talk, daemon=True)
    try:
        talking.start()
        talking.join(60)
        assert not talking.is_alive(), "this process and the child wait on each other"
    finally:
        child.close()
    assert answers == [b"x" * 6_000_000, b"y" * 6_000_000]


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_a_started_childs_error_comes_back_and_then_it_is_gone() -> None:
    child = sandbox.Child.spawn(_fail)
    assert child is not None
    try:
        with pytest.raises(sandbox.ChildError, match="KeyError"):
            child.receive(60)
        with pytest.raises(EOFError):
            child.receive(60)
    finally:
        child.close()


class _Cycle:
    """Garbage that only the collector frees; its finalizer names the process it ran in."""

    def __init__(self, log: Any) -> None:
        self.me = self
        self.log = log

    def __del__(self) -> None:
        with open(self.log, "a") as out:
            out.write(f"{os.getpid()}\n")


def _collect(receive: Callable[[], Any], send: Callable[[Any], None]) -> None:
    import gc

    gc.collect()
    send(os.getpid())


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_a_child_never_finalizes_this_processs_objects(tmp_path: Any) -> None:
    """An ONNX Runtime session finalized in a child waits for its thread pool's threads,
    which did not survive the fork, forever."""
    import gc

    log = tmp_path / "finalized"
    gc.disable()
    try:
        _Cycle(log)  # garbage now, collected by nobody yet
        child = sandbox.Child.spawn(_collect)
        assert child is not None
        try:
            pid = child.receive(60)
        finally:
            child.close()
    finally:
        gc.enable()
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())], f"child {pid} finalized it too"


_ORPHAN = """
import sys, time
from ort_autopatch.engine import sandbox

def stuck(receive, send):
    send("started")
    time.sleep(3600)  # as on a lock held at the fork, forever

child = sandbox.Child.spawn(stuck)
assert child.receive(60) == "started"
print(child.pid, flush=True)
# ends without closing it
"""


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_a_stuck_child_ends_with_the_process_that_forked_it() -> None:
    """A child stuck for good outlives nothing: left running, it would hold the pipes it
    inherited (a test runner's output, a CI job's) open after its parent exited."""
    from tests.proc_helpers import PY, REPO, ended, run

    done = run([PY, "-c", _ORPHAN], cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[0])
    if not ended(pid):
        os.kill(pid, 9)
        pytest.fail(f"the child {pid} outlived its parent")


@pytest.mark.skipif(not sandbox.available(), reason="needs fork")
def test_a_child_forked_beside_a_working_thread_is_given_up_on_sooner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lock another thread holds at the fork may stay held in the child forever: forked
    beside a working thread, a child that does not answer is killed after
    `RISKY_TIMEOUT_SECONDS`, not `TIMEOUT_SECONDS` (ten minutes of the user's run), and the
    step runs here."""
    import threading

    monkeypatch.setattr(sandbox, "RISKY_TIMEOUT_SECONDS", 1.0)
    parent = os.getpid()

    def step() -> int:
        if os.getpid() != parent:
            time.sleep(3600)  # the child: stuck, as on a lock held at the fork
        return os.getpid()

    held = threading.Lock()
    held.acquire()
    working = threading.Thread(target=held.acquire, name="user-working", daemon=True)
    working.start()
    try:
        start = time.monotonic()
        assert sandbox.run(step) == parent
        assert time.monotonic() - start < 30
    finally:
        held.release()
        working.join(10)


def test_asking_where_threads_are_keeps_no_caller_alive() -> None:
    """`working_thread` reads every thread's frame, this one's too: kept in a cycle, the
    frames would hold their callers' tensors until the cyclic collector runs (with it off, a
    training build's inputs piled up, 192 MB over eight steps)."""
    import gc
    import threading
    import weakref

    release = threading.Event()
    resting = threading.Thread(target=release.wait, name="user-resting", daemon=True)
    resting.start()
    kept: list[weakref.ref[torch.Tensor]] = []

    def caller() -> None:
        tensor = torch.ones(4)
        kept.append(weakref.ref(tensor))
        sandbox.working_thread()

    gc.disable()
    try:
        caller()
        assert kept[0]() is None, "the caller's tensor outlived its call"
    finally:
        gc.enable()
        release.set()
        resting.join(10)


def test_no_child_starts_where_forking_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "available", lambda: False)
    assert sandbox.Child.spawn(_echo_twice) is None


_FRESH_DIAGONAL = """
import torch
from torch import nn
from ort_autopatch import patcher, report
from tests.test_build_safety import Diagonal, _train_both

patcher.patch(Diagonal)
_train_both(Diagonal, torch.float32)
stats = report.stats_for(patcher.class_name(Diagonal))
print(stats.ort_calls, sum(stats.eager_calls.values()))
"""


@pytest.mark.skipif(
    plain_backend(),
    reason="ORT's gradient builder (and its forked child) is the training build's; the plain "
    "backend's gradients are torch's",
)
@pytest.mark.skipif(not sandbox.available(), reason="the gradient build runs in a forked child")
def test_a_fresh_process_survives_its_first_gradient_childs_abort() -> None:
    """A fresh process imports ONNX Runtime before forking its first gradient-build child; that
    child's abort on `torch.diagonal` costs only it, and the static-shape retry runs in ORT."""
    from tests.proc_helpers import PY, REPO, run

    done = run([PY, "-c", _FRESH_DIAGONAL], cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["3", "0"], done.stdout


@pytest.mark.skipif(
    plain_backend(),
    reason="ORT's gradient builder (and its forked child) is the training build's; the plain "
    "backend's gradients are torch's",
)
def test_a_crashed_gradient_build_falls_back_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def crash(step: object, **where: object) -> object:
        raise sandbox.Crashed("SIGABRT", "Assertion '__n < this->size()' failed.")

    monkeypatch.setattr(sandbox, "run", crash)
    _train_both(TwoBranch, torch.float32)
    stats = _stats(TwoBranch)
    assert stats.ort_calls == 0
    (_, detail), _ = next(iter(stats.fallbacks.items()))
    assert "gradient builder crashed" in detail and "SIGABRT" in detail, stats.fallbacks


@pytest.mark.skipif(not sandbox.available(), reason="children are forked")
def test_closing_a_child_twice_leaves_files_opened_since_alone(tmp_path: Any) -> None:
    """A child's pipes are closed once: a second close (a kept child closed by its timer and
    by a clean-up) must not close whatever file has taken their descriptor numbers since."""

    def serve(receive: Callable[[], Any], send: Callable[[Any], None]) -> None:
        send("ready")

    child = sandbox.Child.spawn(serve)
    assert child is not None
    assert child.receive(60) == "ready"
    child.close()
    opened = [os.open(tmp_path / f"f{k}", os.O_CREAT | os.O_RDWR) for k in range(2)]
    try:
        child.close()
        for fd in opened:
            os.fstat(fd)  # raises if the second close took it
    finally:
        for fd in opened:
            os.close(fd)
