"""An untested torch runs the script eagerly, saying why, instead of risking a wrong graph."""

from __future__ import annotations

import logging

import pytest

import ort_autopatch
from ort_autopatch import versions
from ort_autopatch.config import Config


@pytest.mark.parametrize("version", ["2.13.0", "2.13.1+cpu", "2.13.0a0+git1234"])
def test_the_tested_torch_is_accepted(version: str) -> None:
    assert versions.untested_torch_reason(version) is None


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0", "3.0.0"])
def test_another_torch_is_named_with_the_tested_one(version: str) -> None:
    reason = versions.untested_torch_reason(version)
    assert reason is not None and f"torch {version} is not a version" in reason
    assert "Install torch 2.13.x" in reason


def test_the_installed_torch_is_a_tested_one() -> None:
    assert versions.untested_torch_reason(versions.installed_torch()) is None


def test_install_on_an_untested_torch_patches_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(versions, "installed_torch", lambda: "2.14.0")
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        installed = ort_autopatch.install(Config(modules=("m:Net",)))
    if installed:  # pragma: no cover - only when the check is broken
        ort_autopatch.uninstall()
    assert not installed
    assert "runs in PyTorch: torch 2.14.0 is not a version" in caplog.text
    assert "set ORT_AUTOPATCH_UNTESTED_TORCH=1 (--untested-torch) to try this one" in caplog.text


def test_untested_torch_option_installs_anyway_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(versions, "installed_torch", lambda: "2.14.0")
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        installed = ort_autopatch.install(Config(modules=("m:Net",), untested_torch=True))
    ort_autopatch.uninstall()
    assert installed
    assert "torch 2.14.0 is not a version" in caplog.text and "trying it, as asked" in caplog.text
