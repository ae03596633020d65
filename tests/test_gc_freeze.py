"""While a graph builds, the collector leaves the process's older objects alone: the build's
own collections walk only what the build made, and everything is as it was afterwards."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ort_autopatch.engine import gc_freeze
from ort_autopatch.engine.module_engine import EngineOptions, ModuleEngine
from tests.helpers import assert_close


@pytest.fixture(autouse=True)
def _nothing_frozen() -> Iterator[None]:
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


class Watched(nn.Module):
    """Notes, at each run of forward (the build traces it too), how many objects are frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.frozen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.frozen.append(gc.get_freeze_count())
        return torch.tanh(self.fc(x))


def test_a_build_runs_with_the_process_objects_frozen_and_thaws_them(tmp_path) -> None:
    model = Watched()
    x = torch.randn(4, 6, requires_grad=True)
    engine = ModuleEngine(model, EngineOptions(cache_dir=str(tmp_path)))
    held = len(gc.get_objects())
    out = engine(x)
    assert len(engine.records) == 1 and not engine.records[0].from_disk
    traced = model.frozen[:-1] if len(model.frozen) > 1 else model.frozen
    assert traced and min(traced) >= held // 2  # the build traced forward with them frozen
    assert gc.get_freeze_count() == 0
    model.frozen.clear()
    again = engine(x)  # a cached graph: no build, nothing frozen
    assert engine.records and len(engine.records) == 1
    expected = torch.tanh(model.fc(x))
    assert_close(out, expected, "the built graph's output")
    assert_close(again, expected, "the cached graph's output")
    assert gc.get_freeze_count() == 0


def _frozen(item: object) -> bool:
    """Whether `item` (tracked by the collector) sits in its permanent generation."""
    return all(id(item) != id(other) for other in gc.get_objects())


def test_a_build_leaves_a_freeze_of_the_processes_own_alone() -> None:
    theirs: list[object] = []
    gc.freeze()
    assert _frozen(theirs)
    with gc_freeze.frozen_heap():
        ours: list[object] = []  # made in the build: no freeze of ours would take it
        assert _frozen(theirs) and not _frozen(ours)
    assert _frozen(theirs), "the build undid the process's own freeze"


def test_nothing_is_frozen_where_the_collector_is_off() -> None:
    gc.disable()
    try:
        with gc_freeze.frozen_heap():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_overlapping_builds_share_one_freeze_until_the_last_ends() -> None:
    inside, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def other_build() -> None:
        with gc_freeze.frozen_heap():
            inside.set()
            release.wait(10)
            seen.append(gc.get_freeze_count())

    thread = threading.Thread(target=other_build)
    try:
        with gc_freeze.frozen_heap():
            assert gc.get_freeze_count() > 0
            thread.start()
            assert inside.wait(10)
        assert gc.get_freeze_count() > 0  # the other build still runs
    finally:
        release.set()
        thread.join(10)
    assert seen and seen[0] > 0
    assert gc.get_freeze_count() == 0


def test_the_build_s_garbage_among_older_objects_is_collected_after_it() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    made = Cycle()
    gone = threading.Event()
    weakref.finalize(made, gone.set)
    with gc_freeze.frozen_heap():
        del made  # unreachable now, but frozen: no collection inside the build frees it
        gc.collect()
        assert not gone.is_set()
    gc.collect()
    assert gone.is_set()
