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


ENGINE = "ort_autopatch.engine"
BACKENDS = f"{ENGINE}.backends"


def test_the_engines_longest_import_chain_is_at_most_eight_modules() -> None:
    """Shared types sit low (calls, recipe, backend), behaviour above them: no tower of
    behaviour modules importing each other for a type (function-level imports count)."""
    tool = _tool()
    layers = tool.layers(tool.graph(), ENGINE)
    assert len(layers) <= 8, "\n".join(f"{k} {', '.join(v)}" for k, v in sorted(layers.items()))


def test_a_backends_package_is_imported_only_from_inside_it() -> None:
    """The engine, the CLI and the other backend reach a backend only through the registry
    (`engine.backend`, by name): each backend's package holds everything only it uses."""
    edges = _tool().graph()
    crossing = [
        f"{source} -> {target}"
        for source, targets in edges.items()
        for target in targets
        if target.startswith(f"{BACKENDS}.")
        and not source.startswith(f"{BACKENDS}.{target.split('.')[3]}")
    ]
    assert crossing == []


def test_the_backend_interface_imports_nothing_above_the_bottom() -> None:
    """engine/backend.py (the interface and the registry) is read by the configuration, the
    report and --check without torch: it imports only what says which packages exist."""
    edges = _tool().graph()
    assert edges[f"{ENGINE}.backend"] <= {ENGINE, f"{ENGINE}.errors", f"{ENGINE}.runtime"}
