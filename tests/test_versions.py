"""An untested torch runs the script eagerly, saying why, instead of risking a wrong graph."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

import ort_autopatch
from ort_autopatch import versions
from ort_autopatch.config import Config
from tests.proc_helpers import PY, run


@pytest.mark.parametrize(
    "version", ["2.13.0", "2.13.1+cpu", "2.13.0a0+git1234", "2.14.1", "2.15.0+cu126"]
)
def test_the_tested_torch_is_accepted(version: str) -> None:
    assert versions.untested_torch_reason(version) is None


@pytest.mark.parametrize("version", ["2.12.1", "2.16.0", "3.0.0"])
def test_another_torch_is_named_with_the_tested_one(version: str) -> None:
    reason = versions.untested_torch_reason(version)
    assert reason is not None and f"torch {version} is not a version" in reason
    assert "Install torch 2.13.x to 2.15.x" in reason


def test_the_installed_torch_is_a_tested_one() -> None:
    assert versions.untested_torch_reason(versions.installed_torch()) is None


def test_install_on_an_untested_torch_patches_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(versions, "installed_torch", lambda: "2.16.0")
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        installed = ort_autopatch.install(Config(modules=("m:Net",)))
    if installed:  # pragma: no cover - only when the check is broken
        ort_autopatch.uninstall()
    assert not installed
    assert "runs in PyTorch: torch 2.16.0 is not a version" in caplog.text
    assert "set ORT_AUTOPATCH_UNTESTED_TORCH=1 (--untested-torch) to try this one" in caplog.text


def test_untested_torch_option_installs_anyway_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(versions, "installed_torch", lambda: "2.16.0")
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        installed = ort_autopatch.install(Config(modules=("m:Net",), untested_torch=True))
    ort_autopatch.uninstall()
    assert installed
    assert "torch 2.16.0 is not a version" in caplog.text and "trying it, as asked" in caplog.text


def test_check_on_an_untested_torch_names_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ort_autopatch import cli
    from ort_autopatch.config import load_config

    monkeypatch.setattr(torch, "__version__", "2.16.0")
    text, ok = cli.check(load_config(environ={}))
    assert not ok and "accelerate    no" in text
    assert "problem: torch 2.16.0 is not a version" in text
    assert "set ORT_AUTOPATCH_UNTESTED_TORCH=1 (--untested-torch) to try this one" in text


def test_check_with_untested_torch_accelerates_and_notes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from ort_autopatch import cli
    from ort_autopatch.config import load_config

    monkeypatch.setattr(torch, "__version__", "2.16.0")
    text, ok = cli.check(load_config(environ={"ORT_AUTOPATCH_UNTESTED_TORCH": "1"}))
    assert ok and "accelerate    yes" in text
    assert "problem:" not in text
    assert "note: torch 2.16.0 is not a version" in text and "tried anyway" in text


# The launcher as a user runs it, with the installed torch's version read as 2.16.0.
_UNTESTED_LAUNCHER = (
    "import sys; from ort_autopatch import versions; "
    "versions.installed_torch = lambda: '2.16.0'; "
    "from ort_autopatch.cli import main; sys.exit(main(sys.argv[1:]))"
)
_SCRIPT = """
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
    def forward(self, x):
        return self.fc(x)
Net()(torch.ones(1, 3)).sum().backward()
print("done")
"""


def test_report_of_a_run_refused_for_its_torch_says_why(tmp_path: pathlib.Path) -> None:
    (tmp_path / "s.py").write_text(_SCRIPT)
    report = tmp_path / "report.json"
    args = ["--modules", "__main__:Net", "--report", str(report), "s.py"]
    result = run([PY, "-c", _UNTESTED_LAUNCHER, *args], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "done\n"
    data = json.loads(report.read_text())
    assert data["refused"].startswith("torch 2.16.0 is not a version")
    assert data["classes"] == {}
    assert "matched no class" not in result.stderr  # nothing looked for the classes


def test_summary_of_a_run_refused_for_its_torch_says_why(tmp_path: pathlib.Path) -> None:
    (tmp_path / "s.py").write_text(_SCRIPT)
    args = ["--modules", "__main__:Net", "--report", "-", "s.py"]
    result = run([PY, "-c", _UNTESTED_LAUNCHER, *args], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "summary (torch" in result.stderr
    assert "nothing accelerated, the script ran in PyTorch: torch 2.16.0 is not a version" in (
        result.stderr
    )
