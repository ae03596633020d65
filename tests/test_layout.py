"""The package's layout rules that code can check."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def _tool() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "tools" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_cycle() -> None:
    tool = _tool()
    edges = tool.graph()
    assert "ort_autopatch.engine.module_engine" in edges
    assert tool.cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    tool = _tool()
    assert tool.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_engine_imports_onnxruntime() -> None:
    root = Path(__file__).resolve().parent.parent / "ort_autopatch"
    outside = [
        p.relative_to(root)
        for p in root.rglob("*.py")
        if "engine" not in p.relative_to(root).parts
        and ("import onnxruntime" in p.read_text() or "from onnxruntime" in p.read_text())
    ]
    assert outside == []
