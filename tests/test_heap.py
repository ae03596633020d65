"""The process's heap: a step's freed buffers stay for the next step (`engine/heap.py`), and
the first training step's pages are faulted in while the gradient child builds
(`engine/backends/ort_training/heap.py`): later allocations of the process find them
resident, once per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ort_autopatch.engine import heap as process_heap
from ort_autopatch.engine.backends.ort_training import heap

glibc = pytest.mark.skipif(heap._glibc() is None, reason="glibc's malloc")

# Writes 8 MiB in 2 MiB blocks malloc'ed after `heap` ran (or not), and prints the page
# faults that took: each fresh page faults once (2048 pages), a resident one never.
_FAULTS = """
import ctypes, resource, sys
from ort_autopatch.engine import heap as process_heap
from ort_autopatch.engine.backends.ort_training import heap
if sys.argv[1] == "prefault":
    with heap.FirstStepPages(limit=8 << 20) as pages:
        while pages.more():
            pass
malloc = ctypes.CDLL(None).malloc
malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
blocks = [malloc(2 << 20) for _ in range(4)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for block in blocks:
    ctypes.memset(block, 1, 2 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@glibc
def test_memory_the_process_allocates_afterwards_is_resident_already() -> None:
    assert _faults("plain") > 1500  # fresh pages: the cost this removes
    assert _faults("prefault") < 200


@glibc
def test_more_writes_chunks_up_to_the_limit_and_the_block_frees_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(heap, "_used", False)
    with heap.FirstStepPages(limit=3 * heap.CHUNK_BYTES) as pages:
        assert [pages.more() for _ in range(4)] == [True, True, True, False]
        assert len(pages._chunks) == 3
    assert pages._chunks == []


@glibc
def test_only_the_first_block_in_a_process_does_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_used", False)
    with heap.FirstStepPages() as first:
        assert first.more()
    with heap.FirstStepPages() as second:
        assert not second.more()


def test_without_glibc_nothing_is_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_used", False)
    monkeypatch.setattr(heap, "_glibc", lambda: None)
    with heap.FirstStepPages() as pages:
        assert not pages.more()


# Three steps, each allocating, writing and freeing six blocks of 20 MiB (glibc's adaptive
# thresholds return them: the first is mapped afresh, the others leave more than twice its size
# free at the heap's top); prints the page faults of the third step.
_STEPS = """
import ctypes, resource, sys
from ort_autopatch.engine import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
def step():
    blocks = [libc.malloc(20 << 20) for _ in range(6)]
    for block in blocks:
        ctypes.memset(block, 1, 20 << 20)
    for block in reversed(blocks):
        libc.free(block)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _step_faults(mode: str, **env: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return int(done.stdout.split()[-1])


@glibc
def test_a_step_finds_the_buffers_the_step_before_freed() -> None:
    assert _step_faults("plain") > 25000  # 120 MiB faulted in again: 30,720 pages
    assert _step_faults("keep") < 500


@glibc
@pytest.mark.parametrize(
    "setting",
    [
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
    ids=["trim", "mmap", "tunables"],
)
def test_thresholds_the_user_set_stay_as_they_are(setting: dict[str, str]) -> None:
    assert _step_faults("keep", **setting) > 25000


def test_without_glibc_the_heap_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process_heap, "_kept", None)
    monkeypatch.setattr(process_heap, "glibc", lambda: None)
    assert not process_heap.keep_freed_memory()
    process_heap.release_freed()  # nothing to release: no error


@glibc
def test_release_freed_gives_a_builds_free_pages_back() -> None:
    script = """
import ctypes
from ort_autopatch.engine import heap
assert heap.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
kept = libc.malloc(1 << 20)
blocks = [libc.malloc(8 << 20) for _ in range(12)]
last = libc.malloc(1 << 20)  # keeps the blocks below the heap's top
for block in blocks:
    ctypes.memset(block, 1, 8 << 20)
for block in blocks:
    libc.free(block)
before = rss()
heap.release_freed()
print(before - rss())
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert int(done.stdout.split()[-1]) > 80  # of the 96 MiB freed in the heap's middle


# Blocks of 48 MiB, above the largest mmap threshold glibc accepts: three steps (`_STEP`,
# defined by each script) allocate, write and free two, then the page faults of the third
# step, and how much of a 48 MiB block allocated and freed after it, outside any step, stays
# resident (mapped apart, as glibc always does, it goes back to the system when freed).
_TWO_BLOCKS = """
import ctypes, resource, sys, torch
from ort_autopatch.engine import heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
def two_blocks():
    blocks = [libc.malloc(48 << 20) for _ in range(2)]
    for block in blocks:
        ctypes.memset(block, 1, 48 << 20)
    return blocks
"""
_THIRD_STEP = """
_STEP(); _STEP()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
_STEP()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
start = rss()
libc.free(two_blocks()[0])
print(faults, rss() - start)
"""
# a graph's runs: the blocks allocated inside `WHOLE_HEAP` (or not), freed after it
_LARGE = """
assert heap.keep_freed_memory()
scope = heap.run_scope() if sys.argv[1] == "scoped" else heap.NO_SCOPE
def _STEP():
    with scope:
        blocks = two_blocks()
    for block in blocks:
        libc.free(block)
"""


def _faults_and_kept(script: str, mode: str) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", _TWO_BLOCKS + script + _THIRD_STEP, mode],
        capture_output=True,
        text=True,
        check=True,
    )
    faults, kept = done.stdout.split()[-2:]
    return int(faults), int(kept)


@glibc
def test_a_static_graphs_runs_find_their_large_blocks_in_the_heap_and_only_they() -> None:
    faults, kept = _faults_and_kept(_LARGE, "scoped")
    assert faults < 500  # 96 MiB found in the heap, not mapped afresh
    assert kept < 8  # after the runs, a large block goes back to the system when freed
    faults, _ = _faults_and_kept(_LARGE, "plain")
    assert faults > 20000  # 24,576 pages mapped afresh every step


def test_the_scope_is_a_no_op_where_the_thresholds_are_not_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process_heap, "_kept", True)
    monkeypatch.setattr(process_heap, "_mallopt", None)  # the user's settings, or no glibc
    assert process_heap.run_scope() is process_heap.NO_SCOPE


# An optimizer whose step allocates, writes and frees two 48 MiB blocks (the temporaries of
# a large parameter's update, as glibc's malloc gives them to torch), with the heap's
# thresholds set by the tool or not.
_OPTIMIZER = """
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
class Temporaries(torch.optim.Optimizer):
    def step(self, closure=None):
        for block in two_blocks():
            libc.free(block)
_STEP = Temporaries([torch.nn.Parameter(torch.zeros(4))], {}).step
"""


@glibc
def test_an_optimizer_steps_large_temporaries_stay_in_the_heap_for_its_next_step() -> None:
    faults, kept = _faults_and_kept(_OPTIMIZER, "keep")
    assert faults < 500  # 96 MiB found in the heap, not mapped afresh
    assert kept < 8  # outside an optimizer step a large block is mapped apart, as ever
    faults, _ = _faults_and_kept(_OPTIMIZER, "plain")
    assert faults > 20000  # 24,576 pages mapped afresh every step
