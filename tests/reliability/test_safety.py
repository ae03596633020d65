"""Configuration and cache safety: nothing imported behind the user's back, nothing loaded
from disk but checked ONNX and JSON."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from ort_autopatch.engine import EngineOptions, ModuleEngine, persist
from ort_autopatch.engine.store import GraphStore
from tests.helpers import store_invalid_graphs

ROOT = Path(__file__).resolve().parents[2]


def test_the_configuration_never_imports_a_selected_module(tmp_path: Path) -> None:
    (tmp_path / "sideeffect.py").write_text("print('IMPORTED')\n")
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, ort_autopatch
            ort_autopatch.install()
            print("sideeffect" in sys.modules)
            """
        )
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{ROOT}:{tmp_path}",
        "ORT_AUTOPATCH_MODULES": "sideeffect:Net,sideeffect.*:*",
    }
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.stdout.split() == ["False"], result.stderr


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_checksummed_but_invalid_graph_is_rebuilt(tmp_path: Path) -> None:
    persist._stores.clear()
    model = Small()
    ModuleEngine(model, EngineOptions(cache_dir=tmp_path))(torch.randn(3, 4))
    # Replace every stored graph by an invalid one with a matching checksum: only the checker
    # can tell, or ONNX Runtime as it loads it (a cache hit does not import onnx to check).
    bad = store_invalid_graphs(tmp_path)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(onnx.load_from_string(bad))
    persist._stores.clear()
    engine = ModuleEngine(model, EngineOptions(cache_dir=tmp_path))
    x = torch.randn(3, 4)
    torch.testing.assert_close(engine(x), model.fc(x))
    assert not engine.records[0].from_disk


def test_nothing_but_onnx_and_json_is_read_from_the_folder(tmp_path: Path) -> None:
    persist._stores.clear()
    model = Small()
    ModuleEngine(model, EngineOptions(cache_dir=tmp_path))(torch.randn(3, 4))
    for sidecar in tmp_path.rglob("*.json"):
        if sidecar.name != "paths.json":
            (sidecar.parent / (sidecar.name[:-5] + ".pkl")).write_bytes(b"\x80\x04not read")
    store = GraphStore(tmp_path)
    suffixes = {p.suffix for p in tmp_path.rglob("*") if p.is_file()}
    assert suffixes == {".onnx", ".json", ".pkl"}
    persist._stores.clear()
    engine = ModuleEngine(model, EngineOptions(cache_dir=tmp_path))
    engine(torch.randn(3, 4))
    assert engine.records[0].from_disk and store.usable


def test_a_folder_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setattr(os, "getuid", lambda: 4242)
    assert not GraphStore(tmp_path).usable
