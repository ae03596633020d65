"""The exit report of a real run: counters and reasons a user reads without reading code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.proc_helpers import FOREGROUND_BUILDS, without_progress

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.scale = 1.0
        self.step = 0

    def forward(self, x, extra=None):
        return self.fc(x) * self.scale


net = Net()
x = torch.randn(3, 4)
for _ in range(3):
    net(x).sum().backward()
    net.step += 1            # never read by forward: counted, no re-export
net.scale = 2.0              # read by forward: one re-export
net(x).sum().backward()
for _ in range(2):
    net(x, extra=object())   # cannot be a graph input: falls back, warned once
"""


def _launch(
    tmp_path: Path, *options: str, cache: Path | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **FOREGROUND_BUILDS}
    if cache is not None:
        env["ORT_AUTOPATCH_CACHE_DIR"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "ort_autopatch", *options, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )


@dataclass(frozen=True)
class Run:
    folder: Path  # the script's folder
    result: subprocess.CompletedProcess[str]

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.folder / "report.json").read_text())  # type: ignore[no-any-return]

    def cache_copy(self, to: Path) -> Path:
        """A copy of the run's graph cache, for a test that changes it."""
        return Path(shutil.copytree(self.folder / "cache", to / "cache"))


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One launch shared by the tests of its report, its summary and its cache (each launch
    costs a Python start with torch and ONNX Runtime): a JSON report, the summary at INFO, a
    graph cache to start empty."""
    folder = tmp_path_factory.mktemp("run")
    result = _launch(
        folder,
        *("--modules", "__main__:Net,nowhere.models:Missing", "--log-level", "INFO"),
        *("--report", str(folder / "report.json")),
        cache=folder / "cache",
    )
    assert result.returncode == 0, result.stderr
    return Run(folder, result)


def test_the_report_names_exports_rebuilds_fallbacks_and_unmatched_patterns(cold_run: Run) -> None:
    data = cold_run.report
    assert {"version", "torch", "onnxruntime", "classes", "unmatched"} <= set(data)
    net = data["classes"]["__main__:Net"]
    assert net["instances"] == 1
    assert net["ort_calls"] == 4 and net["eager_calls"] == 2
    assert net["exports"] == 2 and net["ignored_writes"] == 3 and net["cache_loads"] == 0
    assert net["rebuilds"] == [{"reason": "attribute Net.scale written", "count": 1}]
    (fallback,) = net["fallbacks"]
    assert fallback["reason"] == "unsupported input" and fallback["count"] == 2
    assert "extra" in fallback["detail"]
    assert net["export_seconds"] > 0 and net["build_seconds"] > 0
    assert data["unmatched"] == ["nowhere.models:Missing"]
    assert cold_run.result.stderr.count("runs in PyTorch (unsupported input)") == 1


def test_the_text_summary_at_info_is_one_compact_table(cold_run: Run) -> None:
    stderr = cold_run.result.stderr
    summary = stderr[stderr.index("ort_autopatch 0.1.0 summary") :]
    line = next(x for x in summary.splitlines() if x.strip().startswith("__main__:Net"))
    assert line.split()[1:5] == ["1", "4", "2", "2"]  # instances, ORT calls, eager, exports
    assert "rebuilt: attribute Net.scale written x1" in summary
    assert "fell back: unsupported input" in summary
    assert len(summary.splitlines()) < 25


# A package as a wildcard meets it: weight enums, helpers and the model's own blocks.
PACKAGE = """
import enum

import torch
from torch import nn

{helpers}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(x).sum()


class Unused(nn.Module):
    pass
"""


def test_a_wildcard_over_a_package_warns_of_nothing_and_lists_the_classes_called(
    tmp_path: Path,
) -> None:
    helpers = "\n".join(
        f"class Weights{i}(enum.Enum):\n    A = {i}\n\nclass Helper{i}:\n    pass\n"
        for i in range(30)
    )
    (tmp_path / "vision").mkdir()
    (tmp_path / "vision" / "__init__.py").write_text("")
    (tmp_path / "vision" / "models.py").write_text(PACKAGE.format(helpers=helpers))
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom vision.models import Net\nNet()(torch.ones(2, 4)).backward()\n"
    )
    report = tmp_path / "report.json"
    options = ["--modules", "vision.*:*", "--report", str(report)]
    result = subprocess.run(
        [sys.executable, "-m", "ort_autopatch", *options, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}", **FOREGROUND_BUILDS},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert without_progress(result.stderr) == ""
    data = json.loads(report.read_text())
    assert list(data["classes"]) == ["vision.models:Net"]
    assert data["classes"]["vision.models:Net"]["ort_calls"] == 1
    assert data["uncalled_classes"] == 2  # Block (inside Net's graph) and Unused
    assert data["unmatched"] == []


def test_a_second_run_loads_its_graphs_from_the_cache(cold_run: Run, tmp_path: Path) -> None:
    cache = cold_run.cache_copy(tmp_path)
    report = tmp_path / "report.json"
    options = ("--modules", "__main__:Net", "--report", str(report))
    result = _launch(cold_run.folder, *options, cache=cache)  # the same script file
    assert result.returncode == 0, result.stderr
    net = json.loads(report.read_text())["classes"]["__main__:Net"]
    assert net["exports"] == 0 and net["cache_loads"] == 2
    assert net["rebuilds"] == [{"reason": "attribute Net.scale written", "count": 1}]


def test_clear_cache_empties_the_folder(cold_run: Run, tmp_path: Path) -> None:
    cache = cold_run.cache_copy(tmp_path)
    assert any(cache.iterdir())
    result = subprocess.run(
        [sys.executable, "-m", "ort_autopatch", "--clear-cache", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **FOREGROUND_BUILDS},
    )
    assert result.returncode == 0 and "removed 1" in result.stdout
    assert not any(cache.iterdir())


def test_clear_cache_without_a_folder_says_how_to_name_one(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ort_autopatch", "--clear-cache"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **FOREGROUND_BUILDS},
    )
    assert result.returncode == 2
    assert "--cache-dir" in result.stderr and "ORT_AUTOPATCH_CACHE_DIR" in result.stderr


LIBRARY_SCRIPT = """
import importlib, json, sys
import torch
from torch import nn

imported = {}
for name in ("transformers", "accelerate", "lightning", "pytorch_lightning"):
    try:
        imported[name] = importlib.import_module(name).__version__
    except ImportError:
        pass
import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (transformers 5: elastic agent modules)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


net = Net()
for _ in range(2):
    net(torch.randn(3, 4)).sum().backward()
print(json.dumps(imported))
"""


def test_the_report_is_written_with_transformers_accelerate_and_lightning_imported(
    tmp_path: Path,
) -> None:
    """transformers 5 imports torchrun's elastic-agent modules in every process; the report
    must still be written (only torchrun's own agent leaves it to its ranks)."""
    pytest.importorskip("transformers")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LIBRARY_SCRIPT))
    report = tmp_path / "report.json"
    options = ["--modules", "__main__:Net", "--report", str(report)]
    done = subprocess.run(
        [sys.executable, "-m", "ort_autopatch", *options, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **FOREGROUND_BUILDS},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert "transformers" in imported
    data = json.loads(report.read_text())
    assert data["classes"]["__main__:Net"]["ort_calls"] == 2, data
