"""The first training step's heap pages, faulted in while the gradient child builds
(`engine/backends/ort_training/heap.py`): later allocations of the process find them
resident, once per process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ort_autopatch.engine.backends.ort_training import heap

glibc = pytest.mark.skipif(heap._glibc() is None, reason="glibc's malloc")

# Writes 8 MiB in 2 MiB blocks malloc'ed after `heap` ran (or not), and prints the page
# faults that took: each fresh page faults once (2048 pages), a resident one never.
_FAULTS = """
import ctypes, resource, sys
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
