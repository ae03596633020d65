"""Threads: four training their own instances, two sharing one; results equal serial work."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from ort_autopatch import patcher, report
from tests.helpers import patched
from tests.reliability.models import Mlp

TIMEOUT = 120


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched((Mlp,))


def _train(model: Mlp, seed: int, steps: int = 5) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 8, generator=generator)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _run_threads(targets: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guard(fn), daemon=True) for fn in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "deadlock: a thread did not finish"
    assert not errors, errors


def test_four_threads_training_their_own_instances_match_serial_training() -> None:
    torch.manual_seed(0)
    models = [Mlp() for _ in range(4)]
    serial = [copy.deepcopy(m) for m in models]
    expected = [_train(m, seed) for seed, m in enumerate(serial)]
    got: dict[int, list[float]] = {}

    def work(k: int) -> Callable[[], None]:
        return lambda: got.__setitem__(k, _train(models[k], k))

    _run_threads([work(k) for k in range(4)])
    for k in range(4):
        assert got[k] == pytest.approx(expected[k], rel=1e-5)
        for p, q in zip(models[k].parameters(), serial[k].parameters(), strict=True):
            torch.testing.assert_close(p, q)
    # the serial copies are instances of the patched class too: 20 calls each way
    assert report.snapshot()[patcher.class_name(Mlp)]["ort_calls"] == 40


def test_two_threads_sharing_one_instance_compute_what_serial_calls_compute() -> None:
    torch.manual_seed(0)
    model = Mlp().eval()  # shared weights; each thread computes outputs and input grads
    inputs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    expected = []
    for x in inputs:
        leaf = x.clone().requires_grad_()
        out = model.forward(leaf)
        out.sum().backward()
        expected.append((out.detach(), leaf.grad))
    got: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {0: [], 1: []}

    def work(k: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(10):
                leaf = inputs[k].clone().requires_grad_()
                out = model(leaf)
                out.sum().backward()
                got[k].append((out.detach(), leaf.grad))

        return run

    model.zero_grad()
    _run_threads([work(0), work(1)])
    for k in range(2):
        for out, grad in got[k]:
            torch.testing.assert_close(out, expected[k][0])
            torch.testing.assert_close(grad, expected[k][1])
    records = patcher._instances[model].engine.records
    # the one shape both threads send has its graph, built once
    assert len(records) == 1


def test_exports_in_two_threads_run_one_after_the_other() -> None:
    """Exports rebind process-wide state (symbolics, exporter logging, checkpoint): two of them
    must never overlap, or one could restore the other's rebinding."""
    import time

    from ort_autopatch.engine import tracing

    events: list[tuple[str, int]] = []
    original = tracing.export_rewrites

    def slow_rewrites():  # type: ignore[no-untyped-def]
        ident = threading.get_ident()
        with original():
            events.append(("in", ident))
            time.sleep(0.2)
            events.append(("out", ident))
            yield

    import contextlib

    tracing.export_rewrites = contextlib.contextmanager(slow_rewrites)  # type: ignore[assignment]
    try:
        models = [Mlp(), Mlp()]
        _run_threads([lambda m=m: m(torch.randn(2, 8)).sum().backward() for m in models])
    finally:
        tracing.export_rewrites = original  # type: ignore[assignment]
    assert len(events) == 4
    assert [kind for kind, _ in events] == ["in", "out", "in", "out"]
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1]
