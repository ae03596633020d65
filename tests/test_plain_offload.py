"""A process's first graphs are lowered in a forked child that imported the exporter while
this process traced: the same ONNX bytes as lowering here, the same decomposition table, and
whatever the child cannot take or fails at is lowered here instead."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch.engine import ModuleEngine, sandbox, signature
from ort_autopatch.engine.recipe import EngineOptions
from tests.plain_helpers import PLAIN_READY, SKIP_REASON, ran_in_plain_ort

pytestmark = [
    pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON),
    pytest.mark.skipif(not sandbox.available(), reason="the lowering child is forked"),
]


@pytest.fixture(autouse=True)
def _no_kept_child() -> Any:
    """Each test starts and ends without a child kept from an earlier build."""
    from ort_autopatch.engine.backends.ort import offload

    offload.close_kept()
    yield
    offload.close_kept()


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.head(y.flatten(1))


class Scaled(nn.Module):
    """Reads a plain tensor attribute: a constant of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    return layer, (torch.randn(2, 5, 16),)


def _conv() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Conv(), (torch.randn(2, 3, 8, 8),)


def _lstm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return nn.LSTM(4, 6, batch_first=True), (torch.randn(2, 3, 4),)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "transformer": _transformer,
    "conv_batchnorm_pool": _conv,
    "lstm": _lstm,
    "tensor_attribute": lambda: (Scaled(), (torch.randn(3, 4),)),
}


def _captured(module: nn.Module, *args: torch.Tensor) -> Any:
    from ort_autopatch.engine.backends.ort import capture, decompositions

    call = signature.flatten_call("M", args, {})
    return capture.capture(
        module,
        lambda m, *a, **k: m(*a, **k),
        call.spec(),
        call.tensors,
        "M",
        decompositions.table(),
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_child_lowers_a_capture_to_the_bytes_lowering_here_gives(name: str) -> None:
    from ort_autopatch.engine.backends.ort import lowered, offload

    torch.manual_seed(0)
    module, args = MODELS[name]()
    # two captures of one call: lowering rewrites the outputs of the graphs it is given
    sent, kept = _captured(module, *args), _captured(module, *args)
    lowerer = offload.Lowerer.spawn()
    assert lowerer is not None
    try:
        there = lowerer.lower(sent.forward, sent.backward, "M")
    finally:
        lowerer.close()
    assert there is not None, "the child lowered nothing"
    here = lowered.lower_graphs(kept.forward, kept.backward, "M")
    assert there.forward == here.forward
    assert there.backward == here.backward
    assert there == here  # the output plans and what sessions need to know, too


def _lowered_where(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Which process lowered each graph of the next `Lowerer.lower` (by role; to be called
    before the child is forked, which inherits the tagging)."""
    from ort_autopatch.engine.backends.ort import lowered

    lower_graph, of = lowered.lower_graph, lowered.Graphs.of
    where: dict[str, int] = {}

    def tagged(*args: Any, **kwargs: Any) -> Any:
        part = lower_graph(*args, **kwargs)
        part.lowered_in = os.getpid()
        return part

    def recorded(parts: list[Any]) -> Any:
        where.update({part.role: part.lowered_in for part in parts})
        return of(parts)

    monkeypatch.setattr(lowered, "lower_graph", tagged)
    monkeypatch.setattr(lowered.Graphs, "of", recorded)
    return where


def test_an_operator_of_ours_counts_as_the_onnx_nodes_it_adds_to_the_lowering() -> None:
    """ResNet-50's backward (259 ATen operators and 103 of ours: its convolutions' and
    BatchNorms' backwards one node each) is large enough to be lowered beside forward; a
    transformer layer's is not."""
    from ort_autopatch.engine.backends.ort import offload

    assert offload.lowering_work(["aten"] * 259 + ["ort_autopatch"] * 103) >= offload.ASIDE_WORK
    assert offload.lowering_work(["aten"] * 362) < offload.ASIDE_WORK
    torch.manual_seed(0)
    module, args = _transformer()
    layer = _captured(module, *args)
    assert layer.backward is not None
    assert offload._graph_work(layer.backward) < offload.ASIDE_WORK
    assert offload._encoded_work(offload.encode(layer.backward)) == offload._graph_work(
        layer.backward
    )


@pytest.mark.parametrize("grandchild", ["lowers", "dies"])
def test_a_large_backward_is_lowered_in_a_second_child_beside_forward(
    monkeypatch: pytest.MonkeyPatch, grandchild: str
) -> None:
    from ort_autopatch.engine.backends.ort import lowered, offload

    torch.manual_seed(0)
    module, args = _transformer()
    sent, kept = _captured(module, *args), _captured(module, *args)
    monkeypatch.setattr(offload, "ASIDE_WORK", 1)  # this layer's backward counts as large
    where = _lowered_where(monkeypatch)
    if grandchild == "dies":
        here = os.getpid()
        lower_graph = lowered.lower_graph

        def dying(*args: Any, **kwargs: Any) -> Any:
            if here not in (os.getpid(), os.getppid()):  # the grandchild: its child takes over
                os._exit(3)
            return lower_graph(*args, **kwargs)

        monkeypatch.setattr(lowered, "lower_graph", dying)
    lowerer = offload.Lowerer.spawn()
    assert lowerer is not None
    try:
        there = lowerer.lower(sent.forward, sent.backward, "M")
        child, by = lowerer._child.pid, dict(where)
    finally:
        lowerer.close()
    assert there is not None, "the children lowered nothing"
    assert there == lowered.lower_graphs(kept.forward, kept.backward, "M")
    assert by["forward"] == child
    if grandchild == "lowers":
        assert by["backward"] not in (child, os.getpid()), "backward was not lowered aside"
    else:
        assert by["backward"] == child


def _mapped_pages(pid: int, start: int, length: int) -> int:
    """How many pages of [start, start + length) process `pid` maps (bit 63 of each page's
    entry in /proc/PID/pagemap, which a process's owner may read)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open(f"/proc/{pid}/pagemap", "rb") as entries:
        entries.seek(start // page * 8)
        data = entries.read(length // page * 8)
    return sum(int.from_bytes(data[k : k + 8], "little") >> 63 for k in range(0, len(data), 8))


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux's page map")
@pytest.mark.parametrize("counts", [True, False], ids=["after its count run", "at once"])
def test_the_child_lets_go_of_the_modules_memory(
    monkeypatch: pytest.MonkeyPatch, counts: bool
) -> None:
    """A forked child shares this process's pages until one side writes them: while it maps
    them, the first write here to each page copies it (BERT-base's first AdamW step, which
    writes every parameter, took 3.0 s against 0.9 s). The child reads the module's tensors
    only in its count run, and lets go of them then (or at once, with no count run); this
    process's tensors keep their values, and other memory stays shared."""
    from ort_autopatch.engine.backends.ort import offload

    monkeypatch.setattr(offload, "_implemented", [])  # the names are this child's answer
    module = nn.Linear(1024, 1024)  # a 4 MB weight
    other = torch.randn(1 << 20)  # not the module's
    before = module.weight.detach().clone()
    read: list[float] = []
    count = (lambda: read.append(float(module.weight.sum()))) if counts else None
    (weight_pages,) = sandbox.shared_pages([module.weight])
    (other_pages,) = sandbox.shared_pages([other])
    lowerer = offload.Lowerer.spawn(count, list(module.parameters()))
    assert lowerer is not None
    try:
        if counts:
            lowerer.verdict("M")(True)  # the count run's verdict: sent once it let go
        else:
            assert lowerer.implemented() is not None  # its answer after its imports
        pid = lowerer._child.pid
        assert _mapped_pages(pid, *weight_pages) == 0, "the child still maps the weight"
        assert _mapped_pages(pid, *other_pages) > 0, "the child let go of other memory"
        captured = _captured(module, torch.randn(2, 1024))
        lowered = lowerer.lower(captured.forward, captured.backward, "M")
    finally:
        lowerer.close()
    assert lowered is not None, "the child lowered nothing after letting go"
    assert torch.equal(module.weight, before)


def test_the_childs_operator_names_give_the_decomposition_table_of_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ort_autopatch.engine.backends.ort import decompositions, offload

    monkeypatch.setattr(offload, "_implemented", [])  # no earlier child's answer
    lowerer = offload.Lowerer.spawn()
    assert lowerer is not None
    try:
        named = lowerer.implemented()
    finally:
        lowerer.close()
    assert named is not None
    # both made now: the cached table predates what later imports registered (collectives)
    there, here = decompositions.table.__wrapped__(named), decompositions.table.__wrapped__()
    assert set(there) == set(here)
    for op, function in there.items():
        assert _same(function, here[op]), op


def test_the_operators_read_from_torchlibs_sources_give_the_same_table() -> None:
    """A trace starts from the names read from torchlib's sources, before the child has
    imported it: for the torchlib installed they decide every decomposition alike."""
    from ort_autopatch.engine.backends.ort import decompositions, lowering

    read, imported = lowering.read_implemented(), lowering.implemented()
    assert decompositions.alike(read, imported)
    there = decompositions.table.__wrapped__(read)
    here = decompositions.table.__wrapped__(imported)
    assert set(there) == set(here)
    for op, function in there.items():
        assert _same(function, here[op]), op
    assert not decompositions.alike(frozenset(), imported)  # (the check can fail)


def _same(a: Any, b: Any) -> bool:
    """One function, or partials of one (torch makes its CIA decompositions anew per table)."""
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return _described(a) == _described(b)
    return a is b


def _described(partial: functools.partial[Any]) -> tuple[Any, ...]:
    return partial.func.__qualname__, partial.args, partial.keywords


def test_a_graph_with_symbolic_sizes_is_not_sent() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import offload

    gm = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.randn(3, 4))
    with pytest.raises(offload.Unsupported, match="symbolic"):
        offload.encode(gm)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_graph_calling_a_python_function_is_not_sent() -> None:
    from ort_autopatch.engine.backends.ort import offload

    graph = torch.fx.Graph()
    graph.output(graph.call_function(_double, (graph.placeholder("x"),)))
    with pytest.raises(offload.Unsupported, match="_double"):
        offload.encode(torch.fx.GraphModule(nn.Module(), graph))


def _first_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[Any]:
    """A transformer layer's first call, forward and backward, through a fresh engine whose
    build starts a lowering child (as a process's first build does) and against eager; what
    each build's child gave back."""
    from ort_autopatch.engine.backends.ort import offload

    # a child every build, however busy the machine
    monkeypatch.setattr(offload, "_EXPORTER", "not.imported.anywhere")
    monkeypatch.setattr(offload, "_core_to_spare", lambda probe=None: True)
    answers: list[Any] = []
    lower = offload.Lowerer.lower

    def recorded(self: offload.Lowerer, *args: Any) -> Any:
        answers.append(lower(self, *args))
        return answers[-1]

    monkeypatch.setattr(offload.Lowerer, "lower", recorded)
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    eager = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    eager.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 16)
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=tmp_path))
    out, expected = engine(x), eager(x)
    assert ran_in_plain_ort(out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    return answers


def test_a_build_lowered_by_its_child_runs_in_ort_with_eagers_numbers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    answers = _first_call(monkeypatch, tmp_path)
    assert len(answers) == 1 and answers[0] is not None, "the child lowered nothing"


def test_a_build_whose_child_fails_lowers_here_with_eagers_numbers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from ort_autopatch.engine.backends.ort import offload

    def broken() -> None:
        raise RuntimeError("injected: the child's translator is broken")

    monkeypatch.setattr(offload, "_warm_up", broken)  # runs in the child only
    assert _first_call(monkeypatch, tmp_path) == [None]


@pytest.mark.parametrize("misread", ["relu", "everything", "layer_norm"])
def test_a_trace_from_misread_operators_is_traced_again_with_the_childs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, misread: str
) -> None:
    """Operators read wrongly from torchlib's sources give another trace once the child has
    named them, lowered by the child too, with eager's numbers: relu missed (the first trace
    decomposed the layer's ReLU, and was lowered for nothing), or none read at all
    (a table that decomposes whatever torch can: on torch 2.13 the first trace fails; on
    2.15 it succeeds into operators torchlib does not translate, which the child declines;
    either way it is made again). LayerNorm missed changes nothing: its entry is ours
    whatever torchlib translates, and the first trace stands."""
    from ort_autopatch.engine.backends.ort import lowering, offload

    read = lowering.read_implemented()
    missed = {"relu": torch.ops.aten.relu, "layer_norm": torch.ops.aten.native_layer_norm}
    wrong = read - {missed[misread].default} if misread in missed else set()
    monkeypatch.setattr(offload, "_implemented", [])  # no earlier child's answer
    monkeypatch.setattr(lowering, "read_implemented", lambda: frozenset(wrong))
    answers = _first_call(monkeypatch, tmp_path)
    assert answers and answers[-1] is not None, answers
    if misread == "relu":
        assert len(answers) == 2 and answers[0] is not None
        assert answers[0].forward != answers[1].forward
    elif misread == "everything":
        assert len(answers) == 1 or (len(answers) == 2 and answers[0] is None), answers
    else:
        assert len(answers) == 1


def _counted_where(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Callable[[], list[int]]:
    """Every build forks a child; the processes that made a count run, by pid."""
    import os

    from ort_autopatch.engine import budget
    from ort_autopatch.engine.backends.ort import offload

    monkeypatch.setattr(offload, "_EXPORTER", "not.imported.anywhere")
    monkeypatch.setattr(offload, "_core_to_spare", lambda probe=None: True)
    log = tmp_path / "counted"
    log.write_text("")
    count_run = budget.count_run

    def noted(run: Callable[[], object]) -> None:
        with log.open("a") as out:
            out.write(f"{os.getpid()}\n")
        count_run(run)

    monkeypatch.setattr(budget, "count_run", noted)
    return lambda: [int(line) for line in log.read_text().split()]


def test_the_child_makes_the_count_run_while_this_process_traces(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The build's count run (forward on the call's tensors, counting its operators against
    the node limit) is made by the child, on the other core, before its imports: this
    process only traces. The graph is eager's, forward and backward."""
    import os

    counted = _counted_where(monkeypatch, tmp_path)
    _first_call(monkeypatch, tmp_path)
    pids = counted()
    assert len(pids) == 1 and pids[0] != os.getpid(), pids


def test_the_count_run_stays_here_where_torch_distributed_is_initialised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A forward may join a collective (SyncBatchNorm's all-reduce), which the child would
    make on this process's connections: with a process group up, the count run is made
    here."""
    import torch.distributed as dist

    counted = _counted_where(monkeypatch, tmp_path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _first_call(monkeypatch, tmp_path)
    finally:
        dist.destroy_process_group()
    assert counted() == [os.getpid()]


def test_a_forward_past_the_node_limit_counted_by_the_child_stops_the_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """An LSTMCell unrolled over 2000 steps is refused as the count run in this process
    refuses it (the same cause and remedy), while the trace has barely begun; the class runs
    in PyTorch with eager's numbers."""
    import os
    import time

    from ort_autopatch.engine.errors import BuildOverBudget
    from tests.test_build_budget import Unrolled

    counted = _counted_where(monkeypatch, tmp_path)
    torch.manual_seed(0)
    model = Unrolled()
    x = torch.randn(2, 2000)
    options = EngineOptions(backend="ort", threads=1, cache_dir=tmp_path, max_graph_nodes=3000)
    engine = ModuleEngine(model, options)
    start = time.perf_counter()
    with pytest.raises(BuildOverBudget, match="counted as forward ran on the call's tensors"):
        engine(x)
    assert time.perf_counter() - start < 20
    pids = counted()
    assert len(pids) == 1 and pids[0] != os.getpid(), pids


def test_a_child_that_dies_before_its_count_leaves_the_limit_to_the_trace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A child gone before its verdict: the trace's own node checks hold the limit, and a
    graph under it is built here, with eager's numbers."""
    import os

    from ort_autopatch.engine.backends.ort import offload

    def dies(count: Any) -> Any:
        os._exit(3)

    monkeypatch.setattr(offload, "_count", dies)  # runs in the child only
    assert _first_call(monkeypatch, tmp_path) == [None]


class Wide(nn.Module):
    """A large constant: forward's ONNX graph holds it, and so does backward's request when
    the input needs a gradient (each more than a pipe holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(256, 512)  # a plain tensor: a constant of the graph
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.table
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_large_answer_while_a_large_graph_is_sent_does_not_hang(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The child answers forward (a constant-laden graph) while this process, slow to promote
    backward's types, is still sending backward: the build ends, in ORT, with eager's numbers
    (both sides once wrote and waited for the other to read: a BERT's first call hung)."""
    import threading
    import time

    from ort_autopatch.engine.backends.ort import lowering, offload

    monkeypatch.setattr(offload, "_EXPORTER", "not.imported.anywhere")
    monkeypatch.setattr(offload, "_core_to_spare", lambda probe=None: True)
    promote = lowering.promote_types
    promoted: list[int] = []

    def slow(graph: torch.fx.GraphModule) -> None:
        promoted.append(len(graph.graph.nodes))
        if len(promoted) == 2:  # backward's, once forward has gone to the child
            time.sleep(1.0)
        promote(graph)

    monkeypatch.setattr(lowering, "promote_types", slow)
    torch.manual_seed(0)
    model, eager = Wide(), Wide()
    eager.load_state_dict(model.state_dict())
    eager.table = model.table
    x = torch.randn(4, 256, requires_grad=True)
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=tmp_path))
    results: list[Any] = []
    building = threading.Thread(target=lambda: results.append(engine(x)), daemon=True)
    building.start()
    building.join(60)
    assert not building.is_alive(), "the build waits on its lowering child forever"
    assert len(promoted) == 2
    assert ran_in_plain_ort(results[0])
    torch.testing.assert_close(results[0], eager(x), rtol=1e-5, atol=1e-5)


def test_a_busy_machine_lowers_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """No child where no core is free now: its extra CPU would slow both processes down. What
    decides is the CPUs' idle time over a short window (/proc/stat), less this process's own
    CPU time, never the 1-minute load average, which lags a minute behind."""
    import os

    from ort_autopatch.engine.backends.ort import offload

    monkeypatch.setattr(offload, "_EXPORTER", "not.imported.anywhere")
    monkeypatch.setattr(offload, "_quota_cores", lambda: None)
    monkeypatch.setattr(offload, "WINDOW_SECONDS", 0.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    # this process's own CPU over the window is none, so the CPUs' ticks alone decide (the
    # real one counted ORT's spinning threads of an earlier test: the busy machine looked free)
    wall = iter(range(10**6))
    monkeypatch.setattr(
        offload,
        "time",
        SimpleNamespace(
            perf_counter=lambda: next(wall) * 0.05, process_time=lambda: 0.0, sleep=lambda s: None
        ),
    )
    clock = iter(range(10**6))

    def ticks(busy: float) -> object:
        # (idle, total) so far: each reading 100 more ticks, `busy` of them not idle
        def read(cpus: set[int]) -> tuple[int, int]:
            k = next(clock)
            return int(k * 100 * (1 - busy)), k * 100

        return read

    # an idle load average does not let the child on while the other core is busy now
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(offload, "_cpu_ticks", ticks(busy=0.95))
    assert offload.Lowerer.start() is None
    # a high load average (a job that just ended) does not keep it off when the CPUs idle
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(offload, "_cpu_ticks", ticks(busy=0.1))
    lowerer = offload.Lowerer.start()
    assert lowerer is not None
    lowerer.close()
    # without /proc/stat, the load average decides
    monkeypatch.setattr(offload, "_cpu_ticks", lambda cpus: None)
    assert offload.Lowerer.start() is None


def test_no_child_is_forked_while_another_thread_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock another thread holds at the fork stays held in the child forever (four threads
    building at once hung on one): no fork while a thread runs or waits on a lock; a thread
    at rest in `Event.wait` (tqdm's monitor, a queue) or `Thread.join` does not keep the child
    off."""
    import threading
    import time

    from ort_autopatch.engine.backends.ort import offload

    monkeypatch.setattr(offload, "_EXPORTER", "not.imported.anywhere")
    monkeypatch.setattr(offload, "_core_to_spare", lambda probe=None: True)
    held, release = threading.Lock(), threading.Event()
    held.acquire()
    working = threading.Thread(target=held.acquire, name="user-working", daemon=True)
    resting = threading.Thread(target=release.wait, name="user-resting", daemon=True)
    joining = threading.Thread(target=resting.join, name="user-joining", daemon=True)
    resting.start()
    joining.start()
    deadline = time.monotonic() + 10  # until both have reached their wait
    while sandbox.working_thread() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sandbox.working_thread() is None, "a thread at rest counts as working"
    working.start()
    try:
        assert sandbox.working_thread() == "user-working"
        assert offload.Lowerer.start() is None
    finally:
        held.release()
        working.join(10)
    assert sandbox.working_thread() is None  # the resting and joining threads are still there
    lowerer = offload.Lowerer.start()
    assert lowerer is not None
    lowerer.close()
    release.set()
    resting.join(10)
    joining.join(10)


def test_the_probe_reads_this_machines_cpus() -> None:
    from ort_autopatch.engine.backends.ort import offload

    probe = offload._CoreProbe.begin()
    assert probe.cpus and isinstance(probe.free(), bool)


_FRESH = """
import sys, tempfile
import torch
from torch import nn
from ort_autopatch.engine import ModuleEngine
from ort_autopatch.engine.backends.ort import offload
from ort_autopatch.engine.recipe import EngineOptions

offload._core_to_spare = lambda probe=None: True  # however busy the machine running the tests

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
with tempfile.TemporaryDirectory() as folder:
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=folder))
    out = engine(torch.randn(5, 6))
    out.sum().backward()
print(type(out.grad_fn).__name__, "onnx" in sys.modules, "onnxscript" in sys.modules)
"""


def test_a_fresh_processs_first_build_imports_neither_onnx_nor_the_exporter() -> None:
    """The child imported and lowered: this process traced, and runs the graphs."""
    from tests.proc_helpers import PY, REPO, run

    done = run([PY, "-c", _FRESH], cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["GraphFunctionBackward", "False", "False"], done.stdout


def test_a_later_build_reuses_the_child_and_a_quiet_one_is_closed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A process's second graph (another class, here) is lowered by the child the first build
    forked, which has the exporter imported: one fork, not one per build (each new child paid
    the exporter's imports again, 1.3 s). A child no build asks for within `IDLE_SECONDS` is
    closed: it holds this process's memory as it was at the fork."""
    import os

    from ort_autopatch.engine.backends.ort import offload
    from tests.proc_helpers import ended

    spawned: list[offload.Lowerer] = []
    spawn = offload.Lowerer.spawn.__func__  # type: ignore[attr-defined]

    def counted(
        cls: type[offload.Lowerer], count: Any = None, shared: Any = ()
    ) -> offload.Lowerer | None:
        lowerer = spawn(cls, count, shared)
        if lowerer is not None:
            spawned.append(lowerer)
        return lowerer

    monkeypatch.setattr(offload.Lowerer, "spawn", classmethod(counted))
    _first_call(monkeypatch, tmp_path)  # a transformer layer, lowered by a new child
    assert len(spawned) == 1
    torch.manual_seed(0)
    model, eager = Conv(), Conv()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 8, 8)
    out = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=tmp_path))(x)
    assert ran_in_plain_ort(out)
    torch.testing.assert_close(out, eager(x), rtol=1e-5, atol=1e-5)
    assert len(spawned) == 1, "the second build forked a child of its own"
    pid = spawned[0]._child.pid
    os.kill(pid, 0)  # kept between builds
    monkeypatch.setattr(offload, "IDLE_SECONDS", 0.05)
    offload.Lowerer.start().release()  # type: ignore[union-attr]  # taken, given back
    assert ended(pid), "the idle child was not closed"


def test_the_import_hook_forks_the_child_before_the_first_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A class the import hook patches has its backend prepare (`Backend.prepare`): the
    plain backend forks the lowering child then, once per process, so its imports overlap
    the user's setup; the first build takes that child (no second fork) and gives eager's
    numbers."""
    import ort_autopatch
    from ort_autopatch import patcher
    from ort_autopatch.config import Config
    from ort_autopatch.engine.backends.ort import offload

    monkeypatch.setattr(offload, "_EXPORTER", "not.imported.anywhere")
    monkeypatch.setattr(offload, "_core_to_spare", lambda probe=None: True)
    monkeypatch.setattr(offload, "_prestarted", [])
    monkeypatch.setattr(patcher, "_prepared", [])
    spawned: list[offload.Lowerer] = []
    spawn = offload.Lowerer.spawn.__func__  # type: ignore[attr-defined]

    def counted(
        cls: type[offload.Lowerer], count: Any = None, shared: Any = ()
    ) -> offload.Lowerer | None:
        lowerer = spawn(cls, count, shared)
        if lowerer is not None:
            spawned.append(lowerer)
        return lowerer

    monkeypatch.setattr(offload.Lowerer, "spawn", classmethod(counted))

    class Found(Conv):
        pass

    class AlsoFound(Conv):
        pass

    config = Config(backend="ort", background_builds=False)
    try:
        ort_autopatch._patch_found_class(config, Found)
        ort_autopatch._patch_found_class(config, AlsoFound)
        assert len(spawned) == 1 and offload._kept, "no child forked at patch time"
        torch.manual_seed(0)
        model, eager = Found(), Conv()
        eager.load_state_dict(model.state_dict())
        x = torch.randn(2, 3, 8, 8)
        out = ModuleEngine(model, EngineOptions(backend="ort", threads=1, cache_dir=tmp_path))(x)
        assert ran_in_plain_ort(out)
        torch.testing.assert_close(out, eager(x), rtol=1e-5, atol=1e-5)
        assert len(spawned) == 1, "the first build forked a child of its own"
    finally:
        patcher.unpatch(Found)
        patcher.unpatch(AlsoFound)
