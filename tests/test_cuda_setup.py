"""The GPU path names the packages a user can install today, and `--check` says when torch's
CUDA build and ONNX Runtime's CUDA provider are built for different CUDA majors. There is no
GPU here: both sides are faked (torch's `torch.version.cuda`, ONNX Runtime's build info)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import pytest
import torch

from ort_autopatch import cli_check
from ort_autopatch.config import load_config
from ort_autopatch.engine import backend, runtime, session
from ort_autopatch.engine.errors import UnsupportedDeviceError


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, torch_cuda: str | None, ort_cuda: str | None):
    monkeypatch.setattr(cli_check, "_torch_cuda", lambda: torch_cuda)
    monkeypatch.setattr(runtime, "cuda_version", lambda: ort_cuda)


def _check_text(monkeypatch: pytest.MonkeyPatch, torch_cuda: str | None, ort_cuda: str | None):
    _fake_cuda(monkeypatch, torch_cuda, ort_cuda)
    return cli_check.check(load_config(environ={}))


def test_check_says_when_torch_and_onnx_runtime_are_built_for_different_cuda_majors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text, ok = _check_text(monkeypatch, "12.6", "13.0")
    said = "torch is built for CUDA 12.6, "
    assert said in text and "CUDA provider for CUDA 13.0" in text, text
    if backend.resolve("auto") == "ort":
        # the plain backend finds its CUDA libraries beside torch's: GPU tensors cannot run
        assert "  problem: torch is built for CUDA 12.6" in text
        assert "https://download.pytorch.org/whl/cu130" in text
        assert not ok and "accelerate    no" in text
    else:  # the training build's CUDA 11.8 is never torch's: it brings its own libraries
        assert "  note: torch is built for CUDA 12.6" in text
        assert "nvidia-*-cu13 wheels" in text
        assert ok and "accelerate    yes" in text


@pytest.mark.parametrize(
    ("torch_cuda", "ort_cuda"),
    [("13.2", "13.0"), ("12.6", "12.2"), (None, "13.0"), ("12.6", None), (None, None)],
    ids=["match-13", "match-12", "cpu-torch", "cpu-onnxruntime", "cpu-both"],
)
def test_check_is_silent_when_the_cuda_majors_match_or_a_side_has_no_cuda(
    monkeypatch: pytest.MonkeyPatch, torch_cuda: str | None, ort_cuda: str | None
) -> None:
    text, ok = _check_text(monkeypatch, torch_cuda, ort_cuda)
    assert ok, text
    assert "built for CUDA" not in text and "CUDA provider" not in text


def test_cuda_version_reads_onnx_runtime_s_build_info_without_importing_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    package = tmp_path / "onnxruntime"
    (package / "capi").mkdir(parents=True)
    (package / "__init__.py").write_text("raise AssertionError('imported')\n")
    (package / "capi" / "build_and_package_info.py").write_text(
        "package_name = 'onnxruntime-gpu'\n__version__ = '1.31.1'\ncuda_version = '13.0'\n"
    )
    spec = importlib.util.spec_from_file_location(
        "onnxruntime", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    fake = types.ModuleType("onnxruntime")
    fake.__spec__ = spec
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    assert runtime.cuda_version() == "13.0"
    # a CPU build's info has no cuda_version
    (package / "capi" / "build_and_package_info.py").write_text(
        "package_name = 'onnxruntime'\n__version__ = '1.32.0'\n"
    )
    assert runtime.cuda_version() is None


def test_the_installed_cpu_build_has_no_cuda_version() -> None:
    found = runtime.installed_distributions()
    assert not {"onnxruntime-gpu", "onnxruntime-training"} & set(found), found
    assert runtime.cuda_version() is None


@pytest.mark.parametrize(
    ("installed", "named", "not_named"),
    [
        ({"onnxruntime": "1.32.0"}, "Install ort-autopatch[gpu] (onnxruntime-gpu)", "training"),
        (
            {"onnxruntime-training-cpu": "1.19.2"},
            "Install ort-autopatch[training-gpu] (onnxruntime-training 1.19.2, CUDA 11.8)",
            "Install onnxruntime-training (the CUDA build)",
        ),
    ],
    ids=["plain", "training-build"],
)
def test_gpu_tensors_on_a_cpu_only_onnx_runtime_name_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch, installed: dict[str, str], named: str, not_named: str
) -> None:
    monkeypatch.setattr(runtime, "installed_distributions", lambda: installed)
    with pytest.raises(UnsupportedDeviceError) as raised:
        session._providers(torch.device("cuda", 0))
    message = str(raised.value)
    assert "tensors on cuda:0 but this onnxruntime build offers only " in message
    assert named in message and not_named not in message
