"""The compiled ATen executor: built once per torch and compiler, shared by processes, calling
torch operators by name from ORT's `ATen` node with their non-tensor arguments read by schema."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ort_autopatch.engine import backend, runtime
from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_build, aten_executor

pytestmark = pytest.mark.skipif(
    backend.resolve() == "ort",
    reason="the ATen executor runs the training build's ATen nodes; the plain backend's graphs "
    "have none",
)

needs_compiler = pytest.mark.skipif(
    aten_executor.compiler() is None, reason="needs a C++ compiler (the fallback is tested below)"
)


def _session(nodes: list, inputs: list[str], initializers: dict[str, np.ndarray]) -> object:
    assert aten_executor.executor(aten_executor.default_folder()) is None
    ort, _ = runtime.load()
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()],
        # ORT cannot infer an ATen node's output type: the graph declares it
        value_info=[
            helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
            for n in nodes
            for o in n.output
            if o != "out"
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(aten_executor.DOMAIN, 1)],
        ir_version=8,
    )
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@needs_compiler
def test_an_aten_node_reads_int_list_bool_and_absent_optional_arguments_by_schema() -> None:
    # aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim, *, ScalarType? dtype)
    node = aten_executor.node("aten::sum", ["x", "dims", "keep", ""], ["out"], "sum", "dim_IntList")
    session = _session([node], ["x"], {"dims": np.array([0, 2], np.int64), "keep": np.array(True)})
    x = torch.randn(3, 4, 5)
    (got,) = session.run(None, {"x": x.numpy()})  # type: ignore[attr-defined]
    torch.testing.assert_close(torch.from_numpy(got), x.sum([0, 2], keepdim=True))


@needs_compiler
def test_an_aten_node_reads_a_scalar_argument() -> None:
    node = aten_executor.node("aten::threshold_backward", ["g", "y", "t"], ["out"], "relu_grad")
    session = _session([node], ["g", "y"], {"t": np.array(0.5, np.float32)})
    g, y = torch.randn(100), torch.rand(100)
    (got,) = session.run(None, {"g": g.numpy(), "y": y.numpy()})  # type: ignore[attr-defined]
    torch.testing.assert_close(torch.from_numpy(got), torch.where(y > 0.5, g, 0.0))


@needs_compiler
@pytest.mark.parametrize("approximate", ["tanh", "none", None])
def test_an_aten_node_reads_a_string_argument(approximate: str | None) -> None:
    # gelu_backward(Tensor grad_output, Tensor self, *, str approximate="none"); None: absent
    constants = {} if approximate is None else {"a": np.frombuffer(approximate.encode(), np.uint8)}
    name = "" if approximate is None else "a"
    node = aten_executor.node("aten::gelu_backward", ["g", "x", name], ["out"], "gelu_grad")
    session = _session([node], ["g", "x"], constants)
    g, x = torch.randn(100), torch.randn(100)
    (got,) = session.run(None, {"g": g.numpy(), "x": x.numpy()})  # type: ignore[attr-defined]
    want = torch.ops.aten.gelu_backward(g, x, approximate=approximate or "none")
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=0)


@needs_compiler
def test_a_failing_operator_fails_the_run_with_torchs_message() -> None:
    node = aten_executor.node("aten::threshold_backward", ["g", "y", "t"], ["out"], "relu_grad")
    session = _session([node], ["g", "y"], {"t": np.array(0.0, np.float32)})
    with pytest.raises(Exception, match="must match the size"):
        session.run(None, {"g": np.ones(3, np.float32), "y": np.ones(4, np.float32)})  # type: ignore[attr-defined]


_BUILD = """
import sys
from pathlib import Path
from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor
print(aten_executor.build(Path(sys.argv[1])))
"""


@needs_compiler
def test_concurrent_processes_build_the_executor_once_and_share_it(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(folder)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    paths = {run.communicate(timeout=600)[0].strip() for run in runs}
    assert all(run.returncode == 0 for run in runs)
    (built,) = paths
    assert [p.name for p in folder.glob("*.so")] == [Path(built).name]
    stamp = Path(built).stat().st_mtime_ns
    assert aten_executor.build(folder) == Path(built)  # cached: not built again
    assert Path(built).stat().st_mtime_ns == stamp


_TRAIN = """
import torch
from ort_autopatch.engine import ModuleEngine

model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
engine = ModuleEngine(model)
x = torch.randn(128, 32)
engine(x).sum().backward()
got = model[0].weight.grad.clone()
model.zero_grad()
model(x).sum().backward()
torch.testing.assert_close(got, model[0].weight.grad, rtol=1e-5, atol=1e-5)
print(engine.records[0].torch_nodes)
"""


@pytest.mark.parametrize(
    ("compiler", "said"),
    [
        ({"PATH": "/nonexistent"}, "no C++ compiler found (install g++, or set CXX to one)"),
        ({"CXX": "no-such-c++"}, "$CXX (no-such-c++) is not a compiler on PATH; set CXX to one"),
    ],
    ids=["none-on-path", "bad-cxx"],
)
def test_without_a_compiler_gradient_nodes_go_through_python_and_say_why(
    tmp_path: Path, compiler: dict[str, str], said: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(XDG_CACHE_HOME=str(tmp_path), **compiler)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TRAIN)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'aten::threshold_backward': 1}"
    assert said in done.stderr
    assert "go through Python" in done.stderr
    assert not list(tmp_path.glob("ort_autopatch/*.so"))


@needs_compiler
def test_a_compiler_error_is_reported_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    monkeypatch.setattr(aten_executor, "SOURCE", source)
    with pytest.raises(aten_executor.BuildError, match=r"failed: .*broken\.cpp"):
        aten_executor.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so"))


# -- the build in the background ----------------------------------------------------------------
# A stand-in compiler: it waits for the test's go-ahead, then writes the executor the session
# built at start (tests/conftest.py) to its -o argument; so no test compiles twice, and the
# build lasts exactly as long as the test wants.
_COMPILER = """#!/bin/sh
echo "$$" >> "$COMPILER_RUNS"
while [ ! -e "$COMPILER_GO" ]; do sleep 0.05; done
while [ "$#" -gt 1 ]; do
  if [ "$1" = "-o" ]; then cp "$REAL_EXECUTOR" "$2"; exit; fi
  shift
done
exit 1
"""

_FIRST_STEPS = """
import copy, logging, sys, time
from pathlib import Path
import onnx, torch
from ort_autopatch.engine import EngineOptions, ModuleEngine
from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_build, aten_executor

logging.basicConfig(level=logging.INFO)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
eager = copy.deepcopy(model)
engine = ModuleEngine(model)
x = torch.randn(128, 32)  # 2^15 floats behind the ReLU: its gradient wants torch

def step() -> None:
    engine(x).square().sum().backward()
    eager(x).square().sum().backward()
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)

def graphs() -> list[set[str]]:
    ran = [e.program.saved_graphs["gradient"] for e in engine._cache._entries.values()]
    return [{n.op_type for n in onnx.load_from_string(g).graph.node} for g in ran]

step()  # the first graph: starts the build, does not wait for it
_, target = aten_executor._plan(aten_executor.default_folder())
print("first step, compiler still running:", aten_build.building(target), flush=True)
print("first graph:", "ATen" in graphs()[0], "PythonOp" in graphs()[0], flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)
Path(sys.argv[2]).touch()
deadline = time.monotonic() + 120
while not aten_executor.compiled() and time.monotonic() < deadline:
    time.sleep(0.05)
step()  # the same graph, its session made again with the executor
print("first graph, next step:", "ATen" in graphs()[0], "PythonOp" in graphs()[0], flush=True)
print("builds:", len(engine.records), flush=True)
x = torch.randn(160, 32)
step()  # another batch size: the dynamic graph, a later build, with the executor
print("graphs with ATen:", sorted("ATen" in g for g in graphs()), flush=True)
print("builds:", len(engine.records), engine.records[-1].hot_shape, flush=True)
"""


@pytest.fixture
def slow_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment of a machine whose cache is empty, with a compiler the test releases."""
    compiler = tmp_path / "c++"
    compiler.write_text(_COMPILER)
    compiler.chmod(0o755)
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "CXX": str(compiler),
        "COMPILER_RUNS": str(tmp_path / "runs"),
        "COMPILER_GO": str(tmp_path / "go"),
        "REAL_EXECUTOR": str(aten_executor.build(aten_executor.default_folder())),
        "OMP_NUM_THREADS": "1",
    }
    for name in ("XDG_CACHE_HOME", "CXX"):
        monkeypatch.setenv(name, env[name])
    return env


def _target() -> Path:
    return aten_executor._plan(aten_executor.default_folder())[1]  # as the subprocesses name it


@needs_compiler
def test_first_steps_run_while_the_executor_compiles_once_then_every_graph_uses_it(
    tmp_path: Path, slow_compiler: dict[str, str]
) -> None:
    # two processes at once, as DDP ranks start: one compiler run, neither step waits for it;
    # one exits right after its first step (the build outlives it), the other trains on
    ready = tmp_path / "first-step"
    leaving, staying = (
        subprocess.Popen(
            [sys.executable, "-c", _FIRST_STEPS, mode, str(ready)],
            env=slow_compiler,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in ("exit", "wait")
    )
    left, err = leaving.communicate(timeout=300)
    assert leaving.returncode == 0, err
    deadline = time.monotonic() + 300
    while not ready.exists() and time.monotonic() < deadline:
        assert staying.poll() is None, staying.communicate()
        time.sleep(0.1)
    target = _target()
    assert aten_build.building(target) and not target.exists()  # both first steps are over
    Path(slow_compiler["COMPILER_GO"]).touch()  # let the compiler finish
    out, err = staying.communicate(timeout=300)
    assert staying.returncode == 0, err
    first = [
        "first step, compiler still running: True",
        "first graph: False True",  # a Python node for the ReLU's gradient, not the executor
    ]
    assert left.splitlines() == first
    assert out.splitlines() == [
        *first,
        "first graph, next step: True False",  # taken up without a second export or build
        "builds: 1",
        "graphs with ATen: [True, True]",
        "builds: 2 False",
    ]
    assert err.count("is compiling in the background") == 1  # said once, at INFO
    assert len(Path(slow_compiler["COMPILER_RUNS"]).read_text().split()) == 1
    # the library, and no temporary file beside it
    assert [p.name for p in target.parent.iterdir() if p.suffix == ".so"] == [target.name]


@needs_compiler
def test_a_graph_takes_up_the_executor_another_process_was_compiling(
    tmp_path: Path, slow_compiler: dict[str, str]
) -> None:
    # another process (here: this test) holds the build's lock and writes the library: the
    # training process starts no compiler of its own, and its graph takes the library up
    ready = tmp_path / "first-step"
    target = _target()
    with aten_build.exclusive(aten_build.lock_path(target), wait=True):
        staying = subprocess.Popen(
            [sys.executable, "-c", _FIRST_STEPS, "wait", str(ready)],
            env=slow_compiler,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 300
        while not ready.exists() and time.monotonic() < deadline:
            assert staying.poll() is None, staying.communicate()
            time.sleep(0.1)
        partial = target.with_name(".partial.so")
        partial.write_bytes(Path(slow_compiler["REAL_EXECUTOR"]).read_bytes())
        os.replace(partial, target)
    out, err = staying.communicate(timeout=300)
    assert staying.returncode == 0, err
    lines = out.splitlines()
    assert lines[1] == "first graph: False True"
    assert lines[2] == "first graph, next step: True False"
    assert not Path(slow_compiler["COMPILER_RUNS"]).exists()  # no compiler of its own
