"""The persistent graph cache and saved graphs: hits, misses, damage, concurrency, safety."""

from __future__ import annotations

import logging
import os
import stat
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
from tests.helpers import plain_backend
from tests.proc_helpers import FOREGROUND_BUILDS

ROOT = Path(__file__).resolve().parent.parent


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)) * self.scale


@pytest.fixture(autouse=True)
def _fresh_stores() -> None:
    persist._stores.clear()


def _engine(model: nn.Module, folder: Path, **options: object) -> ModuleEngine:
    return ModuleEngine(model, EngineOptions(cache_dir=folder, **options))  # type: ignore[arg-type]


def _train_once(engine: ModuleEngine, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = engine(x)
    out.sum().backward()
    return out


def test_a_second_engine_loads_the_graph_instead_of_exporting(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Small()
    x = torch.randn(5, 4)
    first = _train_once(_engine(model, tmp_path), x)
    grad = model.fc.weight.grad.clone()
    model.zero_grad()
    second_engine = _engine(model, tmp_path)
    second = _train_once(second_engine, x)
    assert second_engine.records[0].from_disk
    torch.testing.assert_close(second, first)
    torch.testing.assert_close(model.fc.weight.grad, grad)


#: why the tests of routed gradient nodes skip on the plain backend
ROUTED_GRADIENTS = (
    "ReLU's and LayerNorm's gradients run in torch on the training build only (its gradient "
    "builder's ATen nodes); the plain backend lowers both to ONNX, and calls torch only for "
    "operators ONNX cannot express (tests/test_plain_torch_nodes.py)"
)


class Wide(nn.Module):
    """Big enough for its ReLU and LayerNorm gradients to run in torch on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 256)
        self.norm = nn.LayerNorm(256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.up(x)))


@pytest.mark.skipif(plain_backend(), reason=ROUTED_GRADIENTS)
def test_a_graph_whose_gradients_run_in_torch_is_stored_and_loads_with_them(
    tmp_path: Path,
) -> None:
    """The stored graph names no process's callables: the torch-calling gradient nodes are
    put in again when a loaded graph gets its session."""
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(128, 16)
    expected_nodes = {"aten::threshold_backward": 1, "aten::native_layer_norm_backward": 1}
    first_engine = _engine(model, tmp_path)
    first = _train_once(first_engine, x)
    assert first_engine.records[0].torch_nodes == expected_nodes
    grad = model.up.weight.grad.clone()
    model.zero_grad()
    second_engine = _engine(model, tmp_path)
    second = _train_once(second_engine, x)
    assert second_engine.records[0].from_disk
    assert second_engine.records[0].torch_nodes == expected_nodes
    torch.testing.assert_close(second, first)
    torch.testing.assert_close(model.up.weight.grad, grad)


ROUTED_FORWARD = (
    "routing an operator to torch (--torch-ops) is the training build's; the plain backend "
    "cuts its graphs at torch nodes instead, which name this process's callables"
)


class Mixes(nn.Module):
    """A forward node routed to torch by --torch-ops (einsum), a scalar argument and a dtype
    among the arguments of another (cumsum's)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ij,jk->ik", x, self.w).cumsum(1, dtype=torch.float32)


ROUTED = ("aten::einsum", "aten::cumsum")


@pytest.mark.skipif(plain_backend(), reason=ROUTED_FORWARD)
def test_a_graph_with_a_routed_forward_node_is_stored_and_loads_with_it(tmp_path: Path) -> None:
    """Routed nodes are named by what they call, the same in every process: a graph holding
    them is stored, and a loaded one registers them again, with eager's numbers."""
    torch.manual_seed(0)
    model = Mixes()
    x = torch.randn(5, 4)
    first_engine = _engine(model, tmp_path, torch_ops=ROUTED)
    first = _train_once(first_engine, x)
    assert first_engine.records[0].torch_nodes == {"aten::einsum": 1, "aten::cumsum": 1}
    grad = model.w.grad.clone()
    model.zero_grad()
    second_engine = _engine(model, tmp_path, torch_ops=ROUTED)
    second = _train_once(second_engine, x)
    assert second_engine.records[0].from_disk, "the graph with routed nodes was not stored"
    assert second_engine.records[0].torch_nodes == {"aten::einsum": 1, "aten::cumsum": 1}
    torch.testing.assert_close(second, first)
    torch.testing.assert_close(model.w.grad, grad)
    expected = torch.einsum("ij,jk->ik", x, model.w).cumsum(1)
    torch.testing.assert_close(second, expected)
    # the restored nodes take other sizes too (a graph per shape or one of symbolic sizes)
    for rows in (7, 2):
        y = torch.randn(rows, 4)
        model.zero_grad()
        out = _train_once(second_engine, y)
        grad = model.w.grad.clone()
        model.zero_grad()
        expected = torch.einsum("ij,jk->ik", y, model.w).cumsum(1)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(grad, model.w.grad)
    assert all(
        r.torch_nodes == {"aten::einsum": 1, "aten::cumsum": 1} for r in second_engine.records
    )


@pytest.mark.skipif(plain_backend(), reason=ROUTED_FORWARD)
def test_a_graph_calling_a_custom_function_is_not_stored(tmp_path: Path) -> None:
    """A custom autograd.Function's node calls this process's class: never stored."""
    from tests.test_torch_nodes import Quantised  # a straight-through estimator's Function

    torch.manual_seed(0)
    model = Quantised()
    x = torch.randn(5, 8)
    first_engine = _engine(model, tmp_path)
    _train_once(first_engine, x)
    assert first_engine.records[0].torch_nodes
    second_engine = _engine(model, tmp_path)
    _train_once(second_engine, x)
    assert not second_engine.records[0].from_disk


@pytest.mark.skipif(plain_backend(), reason=ROUTED_GRADIENTS)
def test_saved_graphs_show_the_torch_calling_gradient_nodes(tmp_path: Path) -> None:
    engine = ModuleEngine(Wide(), EngineOptions(save_onnx=tmp_path))
    engine(torch.randn(128, 16)).sum().backward()
    (gradient,) = tmp_path.glob("*.gradient.onnx")
    called = [
        a.s.decode()
        for n in onnx.load(gradient).graph.node
        if n.op_type == "ATen"
        for a in n.attribute
        if a.name == "operator"
    ]
    assert sorted(called) == ["aten::native_layer_norm_backward", "aten::threshold_backward"]


def test_entries_are_onnx_and_json_only_in_a_private_folder(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    _train_once(_engine(Small(), folder), torch.randn(5, 4))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".onnx", ".json") for p in files)
    for graph in folder.rglob("*.onnx"):
        onnx.checker.check_model(onnx.load(graph))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def test_a_different_input_dtype_misses(tmp_path: Path) -> None:
    model = Plain()
    with torch.no_grad():  # float64 training is refused before any build (no ORT kernels)
        _engine(model, tmp_path)(torch.randn(5, 4))
        model.double()
        engine = _engine(model, tmp_path)
        engine(torch.randn(5, 4, dtype=torch.float64))
    assert not engine.records[0].from_disk


def test_another_torch_version_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Small()
    _engine(model, tmp_path)(torch.randn(5, 4))
    monkeypatch.setattr(persist.torch, "__version__", "9.9.9")
    engine = _engine(model, tmp_path)
    engine(torch.randn(5, 4))
    assert not engine.records[0].from_disk


def test_a_changed_attribute_value_misses(tmp_path: Path) -> None:
    class Guards:
        def values(self) -> tuple[object, ...]:
            return (model.scale,)

        def labels(self) -> list[str]:
            return ["Small.scale"]

        def paths(self) -> list[str]:
            return ["scale"]

        def adopt(self, root: nn.Module, paths: list[str]) -> None:
            pass

    model = Small()
    ModuleEngine(model, EngineOptions(cache_dir=tmp_path), guards=Guards())(torch.randn(5, 4))
    model.scale = 3.0
    engine = ModuleEngine(model, EngineOptions(cache_dir=tmp_path), guards=Guards())
    torch.testing.assert_close(engine(x := torch.randn(5, 4)), model.forward(x))
    assert not engine.records[0].from_disk


def test_a_truncated_graph_is_ignored_with_a_warning_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = Small()
    _engine(model, tmp_path)(torch.randn(5, 4))
    for graph in tmp_path.rglob("*.onnx"):
        graph.write_bytes(graph.read_bytes()[:50])
    persist._stores.clear()
    engine = _engine(model, tmp_path)
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        x = torch.randn(5, 4)
        torch.testing.assert_close(engine(x), model.forward(x))
    assert not engine.records[0].from_disk
    assert any("ignoring cache entry" in r.getMessage() for r in caplog.records)


def test_a_foreign_sidecar_is_ignored(tmp_path: Path) -> None:
    model = Small()
    _engine(model, tmp_path)(torch.randn(5, 4))
    for sidecar in tmp_path.rglob("*.json"):
        if sidecar.name != "paths.json":
            sidecar.write_text('{"format": 999}')
    persist._stores.clear()
    engine = _engine(model, tmp_path)
    engine(torch.randn(5, 4))
    assert not engine.records[0].from_disk


def test_a_world_writable_folder_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tmp_path.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        store = GraphStore(tmp_path)
    assert not store.usable
    assert "world-writable" in caplog.text
    engine = _engine(Small(), tmp_path)
    engine(torch.randn(5, 4))  # runs, without the cache
    assert not list(tmp_path.iterdir())


def test_the_folder_is_bounded_least_recently_used_first(tmp_path: Path) -> None:
    store = GraphStore(tmp_path)
    entry = {"forward": b"x" * 1000}
    store.save("static", "key0", {"training": False}, entry, [])
    size = sum(p.stat().st_size for p in (tmp_path / "static").glob("key0.*"))
    store.max_bytes = int(size * 2.5)
    os.utime(tmp_path / "static" / "key0.json", (1, 1))
    store.save("static", "key1", {"training": False}, entry, [])
    os.utime(tmp_path / "static" / "key1.json", (2, 2))
    store.save("static", "key2", {"training": False}, entry, [])
    assert store.load("static", "key0") is None
    assert store.load("static", "key1") is not None
    assert store.load("static", "key2") is not None


def test_clear_removes_every_entry(tmp_path: Path) -> None:
    _engine(Small(), tmp_path)(torch.randn(5, 4))
    assert GraphStore(tmp_path).clear() == 1
    assert not list(tmp_path.iterdir())


def test_saved_graphs_say_class_mode_and_signature_and_pass_the_checker(tmp_path: Path) -> None:
    model = Small()
    engine = ModuleEngine(model, EngineOptions(save_onnx=tmp_path))
    engine(torch.randn(5, 4)).sum().backward()
    model.eval()
    with torch.no_grad():
        engine(torch.randn(5, 4))
    names = sorted(p.name for p in tmp_path.iterdir())
    # the training build's gradient graph, or the plain backend's backward graph
    backward = (".gradient.onnx", ".backward.onnx")
    assert any(n.startswith("Small-train-") and n.endswith(backward) for n in names)
    assert any(n.startswith("Small-eval-") for n in names)
    for path in tmp_path.iterdir():
        onnx.checker.check_model(onnx.load(path))


SCRIPT = """
import sys, torch
from torch import nn
from ort_autopatch.engine import EngineOptions, ModuleEngine

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
    def forward(self, x):
        return torch.tanh(self.fc(x))  # VARIANT

torch.manual_seed(0)
engine = ModuleEngine(Net(), EngineOptions(cache_dir=sys.argv[1]))
out = engine(torch.ones(3, 4))
out.sum().backward()
print(engine.records[0].from_disk, round(float(out.sum()), 5))
"""


def _run(script: Path, cache: Path) -> str:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **FOREGROUND_BUILDS}
    result = subprocess.run(
        [sys.executable, str(script), str(cache)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_second_process_hits_and_an_edited_model_file_misses(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cache = tmp_path / "cache"
    cold, warm = _run(script, cache), _run(script, cache)
    assert cold.split()[0] == "False" and warm.split()[0] == "True"
    assert cold.split()[1] == warm.split()[1]
    script.write_text(textwrap.dedent(SCRIPT).replace("torch.tanh(", "torch.sigmoid("))
    edited = _run(script, cache)
    assert edited.split()[0] == "False" and edited.split()[1] != cold.split()[1]


WARM_SCRIPT = """
import json, sys, torch
from torch import nn
from ort_autopatch.engine import EngineOptions, ModuleEngine

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    def forward(self, x):
        return self.layer(x)

torch.manual_seed(0)
model = Net()
engine = ModuleEngine(model, EngineOptions(cache_dir=sys.argv[1]))
before = set(sys.modules)
x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1))
out = engine(x)
out.sum().backward()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
expected = model.layer(x)
expected.sum().backward()
print(json.dumps({
    "from_disk": [r.from_disk for r in engine.records],
    "in_ort": type(out.grad_fn).__name__ == "GraphFunctionBackward",
    "output_diff": (out - expected).abs().max().item(),
    "grad_diff": max((g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters())),
    "imported": sorted(m for m in set(sys.modules) - before
        if m.split(".")[0] in ("onnx", "onnxscript", "onnx_ir")
        or m.startswith(("torch.onnx", "torch._functorch.aot_autograd", "torch._dynamo"))),
}))
"""


def test_a_fresh_process_loads_a_stored_graph_without_onnx_or_the_exporter(
    tmp_path: Path,
) -> None:
    """A cache hit finds its entry from a key computed without tracing, and makes its
    sessions without parsing ONNX (onnx's import alone is half a second): a transformer
    layer whose gradient nodes run in torch, on either backend."""
    import json

    script = tmp_path / "warm.py"
    script.write_text(WARM_SCRIPT)
    runs = [json.loads(_run(script, tmp_path / "cache").splitlines()[-1]) for _ in range(3)]
    for found in runs:
        assert found["in_ort"]
        assert found["output_diff"] < 1e-4 and found["grad_diff"] < 1e-3, found
    assert [r["from_disk"] for r in runs] == [[False], [True], [True]]
    assert runs[0]["imported"]  # the build exported
    assert runs[1]["imported"] == runs[2]["imported"] == []


ROUTED_SCRIPT = """
import json, sys, torch
from torch import nn
from ort_autopatch.engine import EngineOptions, ModuleEngine

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
    def forward(self, x):
        return torch.einsum("ij,jk->ik", x, self.w).cumsum(1, dtype=torch.float32)

torch.manual_seed(0)
model = Net()
options = EngineOptions(cache_dir=sys.argv[1], torch_ops=("aten::einsum", "aten::cumsum"))
engine = ModuleEngine(model, options)
before = set(sys.modules)
x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
out = engine(x)
out.sum().backward()
grad = model.w.grad.clone()
model.zero_grad()
expected = model.forward(x)
expected.sum().backward()
print(json.dumps({
    "from_disk": [r.from_disk for r in engine.records],
    "torch_nodes": engine.records[0].torch_nodes,
    "output_diff": (out - expected).abs().max().item(),
    "grad_diff": (grad - model.w.grad).abs().max().item(),
    "imported": sorted(m for m in set(sys.modules) - before
        if m.split(".")[0] in ("onnx", "onnxscript", "onnx_ir") or m.startswith("torch.onnx")),
}))
"""


@pytest.mark.skipif(plain_backend(), reason=ROUTED_FORWARD)
def test_a_fresh_process_loads_a_graph_with_routed_nodes_and_registers_them(
    tmp_path: Path,
) -> None:
    """Another process has none of the routed nodes: loading the graph registers them from
    their stored descriptions (no exporter import), and they give eager's numbers."""
    import json

    script = tmp_path / "routed.py"
    script.write_text(ROUTED_SCRIPT)
    runs = [json.loads(_run(script, tmp_path / "cache").splitlines()[-1]) for _ in range(2)]
    assert [r["from_disk"] for r in runs] == [[False], [True]]
    for found in runs:
        assert found["torch_nodes"] == {"aten::einsum": 1, "aten::cumsum": 1}, found
        assert found["output_diff"] < 1e-5 and found["grad_diff"] < 1e-5, found
    assert runs[0]["imported"] and runs[1]["imported"] == []


def test_two_processes_writing_at_once_leave_a_loadable_entry(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cache = tmp_path / "cache"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **FOREGROUND_BUILDS}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    assert _run(script, cache).split()[0] == "True"
    assert not list(cache.rglob("*.tmp"))
