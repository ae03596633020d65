"""The plain backend through the engine: the cache, per-shape graphs, the first-call check and
the backend's choice, call by call against eager."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from ort_autopatch.engine import ModuleEngine
from ort_autopatch.engine.errors import EngineError
from ort_autopatch.engine.recipe import EngineOptions
from tests.helpers import store_invalid_graphs
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)

PLAIN = EngineOptions(backend="ort", threads=1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def test_training_through_the_engine_gives_eagers_numbers_call_by_call() -> None:
    model, eager = _net(), _net()
    engine = ModuleEngine(model, PLAIN)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(5, 6)
        out, expected = engine(x), eager(x)
        assert ran_in_plain_ort(out), f"step {step} ran elsewhere"
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        out.pow(2).mean().backward()
        expected.pow(2).mean().backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        for a, b in zip(model.buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        optimizer.step()
        eager_optimizer.step()
    assert engine.builds == 1


def test_a_graph_serves_only_the_input_shape_it_was_traced_for() -> None:
    model, eager = _net(), _net()
    engine = ModuleEngine(model, PLAIN)
    for batch in (5, 7, 5):
        x = torch.randn(batch, 6)
        torch.testing.assert_close(engine(x), eager(x), rtol=1e-5, atol=1e-6)
    # the first graph serves batches of 5 only; a second, symbolic in the batch, serves 7
    assert engine.builds == 2
    assert [r.dynamic for r in engine.records] == [False, True]


def test_eval_calls_run_forward_alone_in_ort() -> None:
    model, eager = _net().eval(), _net().eval()
    engine = ModuleEngine(model, PLAIN)
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), eager(x))
    assert engine.builds == 1


def test_a_graph_that_differs_from_eager_at_its_first_call_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ort_autopatch.engine import verify
    from ort_autopatch.engine.backends.ort import decompositions

    dropped = torch.ops.aten._native_batch_norm_legit_functional.default
    table = {k: v for k, v in decompositions.table().items() if k is not dropped}
    monkeypatch.setattr(decompositions, "table", lambda implemented=None: table)
    model = _net()
    before = copy.deepcopy(model.state_dict())
    engine = ModuleEngine(model, PLAIN)
    with pytest.raises(verify.VerificationError, match="differs"):
        engine(torch.randn(5, 6))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed by the refused call"


def _first_call(
    monkeypatch: pytest.MonkeyPatch, model: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, list[str]]:
    """`model`'s first call through the engine, and the graph runs it made."""
    from ort_autopatch.engine import entry

    runs: list[str] = []
    original = entry.Entry.run

    def counted(self: entry.Entry, state: object, call: object, *args: object) -> object:
        own = call.tensors[0] is x  # type: ignore[attr-defined]
        runs.append("own" if own else "copy")
        return original(self, state, call, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(entry.Entry, "run", counted)
    return ModuleEngine(model, PLAIN)(x), runs


def test_the_call_that_builds_a_graph_is_the_checks_run_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first-call check runs the graph on the call's own input and, once it matches
    eager, that run is the call's result: forward runs once, BatchNorm's statistics move
    once, the user's backward goes through that run's graph (the check's backward fired no
    hook of the user's), and a second backward raises as eager's does."""
    model, eager = _net(), _net()
    seen: list[torch.Tensor] = []
    model[0].weight.register_hook(seen.append)
    x = torch.randn(5, 6)
    out, runs = _first_call(monkeypatch, model, x)
    expected = eager(x)
    assert runs == ["own"]
    assert ran_in_plain_ort(out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert len(seen) == 1
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


def test_a_kept_run_that_no_call_takes_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that fails after its check (here, as it files its record) hands no call the
    kept run: BatchNorm's statistics stay as the call found them, for the fallback's eager
    run to move once."""
    from ort_autopatch.engine import build

    def broken(*args: object) -> None:
        raise RuntimeError("injected: the build's record failed")

    monkeypatch.setattr(build.Builder, "_record", broken)
    model = _net()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="injected"):
        ModuleEngine(model, PLAIN)(torch.randn(5, 6))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed by a run no call took"


def test_a_first_call_whose_input_requires_grad_runs_the_graph_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check takes the input's gradient too, which the user's backward must be the
    first to see: the check runs on a copy, and the call runs the graph itself."""
    model, eager = _net(), _net()
    x = torch.randn(5, 6, requires_grad=True)
    out, runs = _first_call(monkeypatch, model, x)
    assert runs == ["copy", "own"]
    x_eager = x.detach().clone().requires_grad_()
    expected = eager(x_eager)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-4, atol=1e-6)
    for a, b in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Doubling(nn.Module):
    """Writes into its input before its layer reads it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.linear(x)


def test_a_first_call_whose_graph_writes_its_input_writes_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check's run wrote the caller's tensor: it is put back, and the call runs the
    graph itself, so the input is doubled once, as eager doubles it."""
    x = torch.randn(5, 6)
    x_eager = x.clone()
    out, runs = _first_call(monkeypatch, _Doubling(), x)
    expected = _Doubling()(x_eager)
    assert runs == ["own", "own"]
    assert ran_in_plain_ort(out)
    torch.testing.assert_close(x, x_eager)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_first_call_under_saved_tensor_hooks_runs_the_graph_under_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The build runs outside the caller's saved-tensor hooks (offloading, checkpointing):
    its check's run saved nothing through them, so the call runs the graph itself, whose
    saved tensors the hooks take."""
    packed: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(1)
        return tensor

    model, eager = _net(), _net()
    x = torch.randn(5, 6)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, runs = _first_call(monkeypatch, model, x)
    assert runs == ["copy", "own"]
    assert packed
    expected = eager(x)
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    for a, b in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_insisting_on_a_backend_that_is_not_installed_names_its_package() -> None:
    engine = ModuleEngine(_net(), EngineOptions(backend="ort-training"))
    with pytest.raises(EngineError, match="ort-autopatch\\[training-cpu\\]"):
        engine(torch.randn(3, 6))


def test_a_second_engine_loads_both_graphs_from_the_persistent_cache(tmp_path: Path) -> None:
    options = EngineOptions(backend="ort", threads=1, cache_dir=tmp_path)
    x = torch.randn(5, 6)
    first = ModuleEngine(_net(), options)
    first(x).sum().backward()
    model, eager = _net(), _net()
    second = ModuleEngine(model, options)
    out, expected = second(x), eager(x)
    assert [r.from_disk for r in second.records] == [True]
    assert ran_in_plain_ort(out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_a_graph_from_the_persistent_cache_is_not_checked_against_eager_again(
    tmp_path: Path,
) -> None:
    """Every graph built is checked against eager on the call that built it, and the check
    is counted with --verify's (the report's verifications); a stored graph passed its check
    when it was built."""
    options = EngineOptions(backend="ort", threads=1, cache_dir=tmp_path)
    x = torch.randn(5, 6)
    first = ModuleEngine(_net(), options)
    first(x)
    assert len(first.verifications) == 1  # the graph built now
    assert first.verifications[0].mismatch is None
    second = ModuleEngine(_net(), options)
    torch.testing.assert_close(second(x), _net()(x), rtol=1e-5, atol=1e-6)
    assert [r.from_disk for r in second.records] == [True]
    assert second.verifications == []


_CACHED_RUN = """
import json, sys
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


from ort_autopatch.engine import ModuleEngine
from ort_autopatch.engine.recipe import EngineOptions

model, eager = Net(), Net()
engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=sys.argv[1]))
x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
out, expected = engine(x), eager(x)
out.pow(2).sum().backward()
expected.pow(2).sum().backward()
pairs = zip(model.parameters(), eager.parameters())
grads = [(p.grad - q.grad).abs().max().item() for p, q in pairs]
print(json.dumps({
    "from_disk": [r.from_disk for r in engine.records],
    "in_ort": type(out.grad_fn).__name__ == "GraphFunctionBackward",
    "output_diff": (out - expected).abs().max().item(),
    "grad_diff": max(grads),
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("onnx", "onnxscript", "onnx_ir")
        or m.startswith(("torch._functorch.aot_autograd", "torch.onnx._internal.exporter",
                         "torch._inductor.pattern_matcher"))),
}))
"""


def test_a_fresh_process_loads_a_stored_graph_without_tracing_or_the_exporter(
    tmp_path: Path,
) -> None:
    import json

    from tests.proc_helpers import PY, run

    script = tmp_path / "net.py"
    script.write_text(_CACHED_RUN)
    runs = []
    for _ in range(2):
        done = run([PY, str(script), str(tmp_path / "cache")], timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    built, loaded = runs
    assert built["from_disk"] == [False] and loaded["from_disk"] == [True]
    for found in runs:
        assert found["in_ort"]
        assert found["output_diff"] < 1e-5 and found["grad_diff"] < 1e-4, found
    assert "torch._functorch.aot_autograd" in built["modules"]  # the build traced
    assert "torch._inductor.pattern_matcher" not in built["modules"]  # (the partition's CSE)
    assert loaded["modules"] == []  # no trace, no exporter, not even onnx


def test_a_stored_graph_onnx_runtime_refuses_is_rebuilt(tmp_path: Path) -> None:
    """A stored graph is not run through `onnx.checker` (its import alone costs a second):
    one whose checksum fits but which is not valid ONNX is refused by ONNX Runtime as it
    loads it, and the call builds its graph again."""
    options = EngineOptions(backend="ort", threads=1, cache_dir=tmp_path)
    x = torch.randn(5, 6)
    ModuleEngine(_net(), options)(x)
    store_invalid_graphs(tmp_path)
    engine = ModuleEngine(_net(), options)
    out = engine(x)
    assert [r.from_disk for r in engine.records] == [False]
    assert ran_in_plain_ort(out)
    torch.testing.assert_close(out, _net()(x), rtol=1e-5, atol=1e-6)
