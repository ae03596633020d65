"""Loading ONNX Runtime: lazily, cheaply, without side effects on torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ort_autopatch.engine import backend as registry
from ort_autopatch.engine import runtime
from tests.helpers import plain_backend

#: what `runtime.load` is asked for here: the training build's primitives, or (plain backend)
#: an inference build
LOAD = f"runtime.load(training={not plain_backend()})\n"


class _Version(tuple[int, int]):
    """Stands in for sys.version_info: compares as a tuple, has major/minor."""

    def __new__(cls, major: int, minor: int) -> _Version:
        return super().__new__(cls, (major, minor))

    @property
    def major(self) -> int:
        return self[0]

    @property
    def minor(self) -> int:
        return self[1]


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return result.stdout.strip()


def test_importing_the_engine_does_not_import_onnxruntime() -> None:
    out = _run("import sys, ort_autopatch.engine; print('onnxruntime' in sys.modules)")
    assert out == "False"


def test_loading_keeps_torch_manual_seed_and_checkpoint() -> None:
    out = _run(
        "import torch, torch.utils.checkpoint as c\n"
        "seed, ckpt = torch.manual_seed, c.checkpoint\n"
        "from ort_autopatch.engine import runtime\n"
        f"{LOAD}"
        "print(torch.manual_seed is seed, c.checkpoint is ckpt)"
    )
    assert out == "True True"


def test_loading_does_not_leave_onnxruntime_training_blocked() -> None:
    out = _run(
        "import sys\n"
        "from ort_autopatch.engine import runtime\n"
        f"{LOAD}"
        "blocked = sys.modules.get('onnxruntime.training', 0) is None\n"
        "print(blocked)"
    )
    assert out == "False"


def test_the_installed_build_is_reported_available() -> None:
    assert registry.unavailable_reason() is None
    if plain_backend():  # the latest maintained onnxruntime, whichever release that is
        from importlib import metadata

        assert registry.unavailable_reason("ort") is None
        assert registry.version("ort") == metadata.version("onnxruntime")
        return
    assert registry.unavailable_reason("ort-training") is None
    assert registry.version("ort-training") == "1.19.2"


def test_package_metadata_is_read_once_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call computes a store key while its graph builds aside, and the key names ONNX
    Runtime's version: a metadata read each time cost 1.25 ms a call."""
    from importlib import metadata

    reads: list[str] = []
    real = metadata.version

    def counted(name: str) -> str:
        reads.append(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", counted)
    runtime._read_distributions.cache_clear()
    try:
        first = runtime.installed_distributions()
        assert reads
        read = len(reads)
        assert runtime.version() == next(iter(first.values()))
        assert runtime.installed_distributions() == first
        assert len(reads) == read
        runtime.installed_distributions()["onnxruntime"] = "a caller's change"
        assert runtime.installed_distributions() == first
    finally:
        runtime._read_distributions.cache_clear()


def _installed(monkeypatch: pytest.MonkeyPatch, found: dict[str, str], onnxscript: bool) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(runtime, "installed_distributions", lambda: dict(found))
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if onnxscript else None) if name == "onnxscript" else real(name),
    )


def test_auto_prefers_the_training_build_when_it_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _installed(monkeypatch, {"onnxruntime-training-cpu": "1.19.2"}, onnxscript=True)
    assert registry.resolve("auto") == "ort-training"


def test_auto_takes_the_plain_backend_with_the_maintained_onnxruntime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _installed(monkeypatch, {"onnxruntime": "1.32.0"}, onnxscript=True)
    assert registry.unavailable_reason("auto") is None
    assert registry.resolve("auto") == "ort"
    assert registry.version("ort") == "1.32.0"


def test_insisting_on_the_training_build_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, {"onnxruntime": "1.20.0"}, onnxscript=True)
    monkeypatch.setattr(runtime.sys, "version_info", _Version(3, 11))
    reason = registry.unavailable_reason("ort-training")
    assert reason is not None
    assert "onnxruntime==1.20.0 is an inference-only build" in reason
    assert "ort-autopatch[training-cpu]" in reason


def test_insisting_on_the_plain_backend_beside_the_training_build_says_what_to_remove(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _installed(monkeypatch, {"onnxruntime-training-cpu": "1.19.2"}, onnxscript=True)
    reason = registry.unavailable_reason("ort")
    assert reason is not None
    assert "onnxruntime-training-cpu==1.19.2 is installed" in reason
    assert "ort-autopatch[cpu]" in reason


@pytest.mark.parametrize(
    ("found", "onnxscript", "named"),
    [({}, True, "no ONNX Runtime is installed"), ({"onnxruntime": "1.32.0"}, False, "onnxscript")],
)
def test_the_plain_backend_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, found: dict[str, str], onnxscript: bool, named: str
) -> None:
    _installed(monkeypatch, found, onnxscript)
    for backend in ("ort", "auto"):
        reason = registry.unavailable_reason(backend)
        assert reason is not None and named in reason and "ort-autopatch[cpu]" in reason
    assert registry.resolve("auto") == "ort"  # the default, whose reason says what to install


def test_python_without_training_wheels_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "installed_distributions", lambda: {})
    monkeypatch.setattr(runtime.sys, "version_info", _Version(3, 12))
    reason = registry.unavailable_reason("ort-training")
    assert reason is not None and "Python 3.12" in reason and "--backend ort" in reason
