"""Long runs and memory: bounded caches, sessions that die with their model, no stashed
activations left behind."""

from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from ort_autopatch import patcher, report
from ort_autopatch.engine import EngineOptions, heap, session
from tests.helpers import plain_backend, repatch
from tests.reliability.models import Encoder, Mlp, TinyLM, rss_mb

ROOT = Path(__file__).resolve().parents[2]
PLAIN = plain_backend()
#: sessions a graph with a backward holds: the training build's one (its TrainingAgent's), or
#: the plain backend's forward and backward InferenceSessions
TRAINING_SESSIONS = 2 if PLAIN else 1


@pytest.fixture(autouse=True)
def _patched() -> object:
    report.reset()
    for cls in (Encoder, TinyLM, Mlp):
        patcher.patch(cls)
    yield
    patcher.unpatch_all()


def _engine(model: torch.nn.Module) -> object:
    return patcher._instances[model].engine


def test_deleting_a_model_and_its_optimizer_frees_its_sessions() -> None:
    gc.collect()  # models of earlier tests
    # A session of an earlier test that dies during this one would make the count drift (seen
    # once in CI, on a fresh checkout with 2 threads; which earlier test's model outlived its
    # gc.collect() is not pinned down): hold them, so only this model's sessions are counted.
    earlier = list(session._live)
    before = session.live_sessions()
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(6, 8)).sum().backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(6, 8))
    records = _engine(model).records  # type: ignore[attr-defined]
    assert records and session.live_sessions() == before + _sessions(records)
    alive = weakref.ref(model)
    del model, opt
    gc.collect()
    assert alive() is None
    assert session.live_sessions() == before == len(earlier)


def test_sessions_alive_equal_cached_graphs_under_a_small_bound() -> None:
    repatch(Mlp, patcher.Settings(engine=EngineOptions(cache_size=2)))
    gc.collect()  # models of earlier tests
    earlier = list(session._live)  # held: none of them dies during this test
    before = session.live_sessions()
    model = Mlp()
    for rank_extra in range(4):  # four signatures (ranks) through a 2-graph cache
        shape = (6, 8) if rank_extra % 2 == 0 else (2, 6, 8)
        x = torch.randn(*shape)
        out = model(x) if x.dim() == 2 else torch.stack([model(row) for row in x])
        out.sum().backward()
        del out
        gc.collect()
        engine = _engine(model)
        assert engine.cached_graphs <= 2
        assert session.live_sessions() - before == engine.cached_graphs * TRAINING_SESSIONS
    assert len(earlier) == before


def test_forward_without_backward_frees_its_activations() -> None:
    model = Encoder(128)
    x = torch.randn(16, 32, 128)
    model(x)  # build
    gc.collect()
    start = rss_mb()
    for _ in range(30):
        model(x)  # output dropped, autograd graph freed with it
    gc.collect()
    assert rss_mb() - start < 20  # 30 stashed activation sets would be ~100+ MB


def _sessions(records: list) -> int:
    """Sessions the graphs of these build records hold."""
    return sum(TRAINING_SESSIONS if r.has_backward else 1 for r in records)


def _check_only_static(uses: list[bool], records: list, arena: bool) -> None:
    """`uses`, per session of `_static_and_dynamic_graphs`: the static-shape graphs' sessions
    say `arena`, the dynamic graphs' never. The plain backend: graphs traced for one call's
    shapes (the first call's, a shape that earned its graph); the training build: three
    static graphs' sessions (two training, one inference) and two dynamic ones."""
    if not PLAIN:
        assert sorted(uses) == [False, False, arena, arena, arena]
        return
    assert len(uses) == _sessions(records)
    assert any(uses) == arena and not all(uses)


def _uses_shared_arena(ort_session: object) -> bool:
    options = ort_session.get_session_options()  # type: ignore[attr-defined]
    try:
        return bool(options.get_session_config_entry("session.use_env_allocators") == "1")
    except RuntimeError:  # never set
        return False


@pytest.fixture
def heap_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's heap cannot keep freed buffers (a C library other than glibc): sessions
    that serve one shape allocate from ORT's shared arena instead."""
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: False)


def _static_and_dynamic_graphs(arena: bool) -> tuple[list, object]:
    """A first call's static-shape graph, a dynamic one, a static one a shape earned, and the
    inference graphs: the sessions built, and the engine."""
    from ort_autopatch.engine import ModuleEngine

    gc.collect()
    earlier = set(session._live)
    model = Mlp()
    engine = ModuleEngine(model, EngineOptions(static_after=3, memory_arena=arena))
    engine(torch.randn(6, 8)).sum().backward()  # the first call: a static-shape graph
    for _ in range(3):  # another shape: the dynamic graph; the third call earns a static one
        engine(torch.randn(5, 8)).sum().backward()
    model.eval()
    with torch.no_grad():
        engine(torch.randn(6, 8))  # inference graphs: the first call's static one,
        engine(torch.randn(4, 8))  # then the dynamic one
    return [s for s in session._live if s not in earlier], engine


@pytest.mark.parametrize("arena", [True, False])
def test_where_the_heap_keeps_freed_buffers_static_graphs_run_from_it_and_none_takes_the_arena(
    arena: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With glibc the heap PyTorch allocates from keeps a step's buffers for ORT's next step
    and the optimizer's alike (`engine/heap.py`): a graph that serves one shape asks it to
    and runs inside `heap.run_scope` (its large blocks from the heap too); a dynamic graph's
    runs do not, and no session holds a second heap of its own."""
    asked: list[bool] = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: asked.append(True) or True)
    built, engine = _static_and_dynamic_graphs(arena)
    assert not any(map(_uses_shared_arena, built))
    assert bool(asked) == arena
    served = [s in session._heap_served for s in built]
    _check_only_static(served, engine.records, arena)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("heap_keeps_nothing")
@pytest.mark.parametrize("arena", [True, False])
def test_only_static_shape_graphs_allocate_from_the_shared_arena(arena: bool) -> None:
    built, engine = _static_and_dynamic_graphs(arena)
    uses = list(map(_uses_shared_arena, built))
    _check_only_static(uses, engine.records, arena)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("heap_keeps_nothing")
@pytest.mark.parametrize("arena", [True, False])
def test_only_the_first_shape_of_a_model_that_specialises_on_sizes_uses_the_shared_arena(
    arena: bool,
) -> None:
    """Its shapes may change every step, and an arena grown for each new size would keep
    every size's buffers (test_autograd_promises' RSS test): later shapes allocate plainly."""
    from ort_autopatch.engine import ModuleEngine

    class Pooled(torch.nn.Module):  # pooling gradients need static shapes: a graph per shape
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.max_pool2d(self.conv(x), 2)

    gc.collect()
    earlier = set(session._live)
    engine = ModuleEngine(Pooled(), EngineOptions(memory_arena=arena))
    for size in (8, 12, 8):
        engine(torch.randn(2, 1, size, size)).sum().backward()
    built = [s for s in session._live if s not in earlier]
    uses = [_uses_shared_arena(s) for s in built]  # a graph: 1 session, or 2 (plain backend)
    half = len(uses) // 2
    assert len(uses) in (2, 4) and sorted(uses) == sorted([arena] * half + [False] * half)


@pytest.mark.usefixtures("heap_keeps_nothing")
def test_outputs_and_gradients_from_the_shared_arena_outlive_their_model() -> None:
    """They are ORT's buffers handed to PyTorch: the arena must not reuse them while PyTorch
    holds them, even after the model, its engine and its sessions are gone."""
    from ort_autopatch.engine import ModuleEngine

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)
        )

    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    x = torch.randn(64, 32)
    engine = ModuleEngine(model, EngineOptions(static_after=2))
    for _ in range(3):  # the last call runs the static-shape graph
        model.zero_grad(set_to_none=True)
        out = engine(x)
        out.sum().backward()
    grads = [p.grad for p in model.parameters()]
    expected = reference(x)
    expected.sum().backward()
    del engine, model
    gc.collect()
    other = ModuleEngine(build(), EngineOptions(static_after=1))
    for _ in range(3):  # another static-shape graph allocating the same sizes from the arena
        other(torch.randn(64, 32)).sum().backward()
    torch.testing.assert_close(out, expected)
    for grad, p in zip(grads, reference.parameters(), strict=True):
        torch.testing.assert_close(grad, p.grad)


FIXED_SHAPE_LOOP = """
import gc, json, os, resource
import torch
from torch import nn
from ort_autopatch import patcher, report

class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

def rss_pages():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1])

patcher.patch(Wide)
torch.manual_seed(0)
model = Wide()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # updates in place: no temporaries
x = torch.randn(256, 1024)

def step():
    opt.zero_grad(set_to_none=True)  # ORT's gradients are freed every step
    model(x).sum().backward()
    opt.step()

for _ in range(12):  # the 8th call earns the static-shape graph
    step()
gc.collect()
faults, growth = [], []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, rss_pages()
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before[0])
    growth.append(rss_pages() - before[1])
page = os.sysconf("SC_PAGE_SIZE")
stats = report.stats_for(patcher.class_name(Wide))
print(json.dumps({"faults": faults, "growth_mb": sum(growth) * page / 2**20, "page": page,
                  "ort_calls": stats.ort_calls, "eager_calls": sum(stats.eager_calls.values())}))
"""


def test_a_fixed_shape_loop_reuses_ort_memory_instead_of_faulting_it_in_each_step() -> None:
    """Freed plainly, a step's buffers go back to the system and every page of the next
    step's is faulted in again (240 to 580 faults a step here); kept in the heap, they are
    reused. The heap settles over the first steps: now and then a step still finds no free
    block where it needs one and grows the heap by a 1 MiB activation (about 12 MiB in all,
    at steps that vary from run to run and come later on a loaded machine), so the typical
    step is what is held to it, and the growth to less than two steps' gradients, where a
    step's buffers kept and never reused would add 20 MiB a step."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FIXED_SHAPE_LOOP)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])
    assert (data["ort_calls"], data["eager_calls"]) == (32, 0)
    gradient_pages = 4 * 1024 * 1024 * 4 / data["page"]  # the weights' gradients alone, 16 MiB
    assert statistics.median(data["faults"]) < 0.02 * gradient_pages, data
    assert data["growth_mb"] < 32, data


SOAK = """
import gc, os, random, sys, json
import torch
from ort_autopatch import patcher
from ort_autopatch.engine import EngineOptions, heap, session
sys.path.insert(0, {root!r})
from tests.reliability.models import Encoder, TinyLM, rss_mb

steps, every = int(sys.argv[1]), int(sys.argv[2])  # sample RSS every `every` steps
settings = patcher.Settings(engine=EngineOptions(cache_size=8))
patcher.patch(Encoder, settings); patcher.patch(TinyLM, settings)
random.seed(0); torch.manual_seed(0)
models = [Encoder(), TinyLM()]
opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
samples, worst_cache = [], 0
for step in range(steps):
    for model, opt in zip(models, opts):
        batch, length = random.randint(1, 8), random.randint(4, 40)
        opt.zero_grad()
        if isinstance(model, Encoder):
            loss = model(torch.randn(batch, length, 64))
        else:
            loss = model(torch.randint(0, 97, (batch, length)))
        loss.backward()
        opt.step()
        if step % (2 * every) == 2 * every - 1:
            model.eval()
            with torch.no_grad():
                if isinstance(model, Encoder):
                    model(torch.randn(2, 8, 64))
                else:
                    model(torch.randint(0, 97, (2, 8)))
            model.train()
        if step % 300 == 299:
            if isinstance(model, Encoder):
                model.scale = 2.0 if model.scale == 1.0 else 1.0
            else:
                model.temperature = 2.0 if model.temperature == 1.0 else 1.0
    engines = [patcher._instances[m].engine for m in models]
    worst_cache = max(worst_cache, *(e.cached_graphs for e in engines))
    if step % every == every - 1:
        gc.collect()
        samples.append(rss_mb())
engines = [patcher._instances[m].engine for m in models]
gc.collect()
# sessions the cached graphs hold: a training graph of the plain backend holds two
per_graph = [
    2 if {plain!r} and entry.recipe.has_backward else 1
    for e in engines for entry in e._cache._entries.values()
    if hasattr(entry, "recipe")  # not a remembered failure
]
print(json.dumps({{"samples": samples, "worst_cache": worst_cache,
                  "cached": sum(e.cached_graphs for e in engines),
                  "held": sum(per_graph), "sessions": session.live_sessions()}}))
"""


def _soak(steps: int, every: int, tmp_path: Path) -> dict[str, object]:
    """`steps` steps of both models; RSS sampled every `every` steps, an eval pass every
    2 * `every` and an attribute toggled every 300."""
    import json

    script = tmp_path / "soak.py"
    script.write_text(textwrap.dedent(SOAK.format(root=str(ROOT), plain=PLAIN)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, str(script), str(steps), str(every)],
        capture_output=True,
        text=True,
        timeout=3000,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _check_soak(data: dict[str, object]) -> None:
    samples = data["samples"]
    assert isinstance(samples, list) and len(samples) >= 4
    warm = samples[len(samples) // 4]  # after warm-up: every signature class seen
    assert max(samples[len(samples) // 4 :]) <= warm * 1.05
    assert data["worst_cache"] <= 8
    assert data["sessions"] == data["held"]


def test_a_short_soak_keeps_memory_and_caches_bounded(tmp_path: Path) -> None:
    # RSS is flat from about step 20 on (391-395 MB over 110 steps here): 100 steps suffice.
    _check_soak(_soak(100, 20, tmp_path))


@pytest.mark.soak
@pytest.mark.timeout(3600)  # its subprocess may take 3000 s
def test_soak_2000_steps_of_two_models_with_varying_shapes(tmp_path: Path) -> None:
    _check_soak(_soak(2000, 50, tmp_path))
