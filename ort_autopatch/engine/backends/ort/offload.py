"""Lowering a process's first graphs in a forked child, while this process traces them.

A cold first call spent most of its time importing: torch's aot_autograd (the trace) and the
exporter's stack (torchlib, onnx, onnx_ir: the lowering), one after the other on one core. A
`Lowerer` forked at the start of a build imports the exporter's stack on the other core while
this process imports aot_autograd and traces; the child names the operators torchlib
translates, warms the translator up, then lowers the two graphs the trace sent it and returns
their ONNX bytes. This process then never imports the exporter or onnx for that build. Before
its imports, a child forked for a build also makes that build's count run (`budget.count_run`:
forward on the call's CPU tensors, its operators counted against the node limit), which this
process would otherwise make before its trace: its verdict is the child's first answer, asked
for while the trace runs (`budget.counted_aside`). Only where a core is free: on a busy machine
the child's own CPU costs more than the overlap gains (`_core_to_spare`). The child then stays
for the process's next build while builds keep coming (`Lowerer.release`, `IDLE_SECONDS`): a
second class, shape or mode pays no import.

The decomposition table the trace needs depends on what torchlib translates, which the child
knows only once its imports are done (1.5 s of a fresh process, most of the first call): the
trace does not wait for it but starts from the same names read from torchlib's sources
(`Lowerer.expected`, `lowering.read_implemented`), and its graphs are used only once the
child's answer gives the same table (`decompositions.alike`), else the call is traced again
with the child's (for the torchlib installed, the two agree on every operator the table reads:
a test checks it).

FX graphs do not pickle with their node meta (the translator reads each node's `val`), so the
graphs cross as plain data (`encode`): each node's op, name, target by qualified name, its
arguments (node references and plain constants), and its fake value as shape, strides,
dtype and storage offset (the translator writes no other meta into the graph:
`lowering.to_onnx`). The exporter's type-promotion pass runs the graph on fake tensors, and
a process's first fake tensor mode imports torch._dynamo (a second): it runs here, on the
traced graphs in place (as lowering here would run it), and the child rebuilds the promoted
graph on meta tensors, which carry all the translator reads. Only CPU graphs of exact shapes
cross: a node this cannot carry (a symbolic size, a CUDA value, an unknown target), a failed
type promotion, a child that fails, hangs or dies, all mean lowering here, as without the
child, with the same result.

Fork safety: no child is forked while another thread of this process may be working
(`sandbox.working_thread`): a lock such a thread holds at the fork (a module's import lock, a
lock of torch's) stays held in the child forever, and the build would wait for an answer that
never comes (four threads building at once hung this way); a child stuck anyway dies with this
process (`sandbox`). The child runs no parallel torch kernel (its thread count is set to 1
before any torch work: OpenMP's pool does not survive a fork) and touches no CUDA (only CPU
graphs are sent); this package's own locks, which another thread may have held at the fork,
are made anew in the child. Its stdout and stderr go nowhere. Where fork is unavailable
(`sandbox.available`), nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ort_autopatch.engine import budget, calls, sandbox
from ort_autopatch.engine.backends.ort import stages
from ort_autopatch.engine.errors import BuildOverBudget, ExportError

if TYPE_CHECKING:
    from ort_autopatch.engine.backends.ort.lowered import Graphs

log = logging.getLogger("ort_autopatch")

#: How long this process waits for a child's answer before lowering itself (a child stuck on
#: a lock held at fork time never answers).
TIMEOUT_SECONDS = 300.0

#: What the child spares this process; once imported here, lowering here costs no import.
_EXPORTER = "onnxscript.function_libs.torch_lib.ops"

#: What both the trace (torch's symbolic shapes) and the exporter (onnx, onnx_ir) import: a
#: third of a second of CPU a child would spend again.
_SHARED = ("numpy", "sympy")

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format)
_CALLABLE_MODULES = ("_operator", "math")  # targets besides ATen's (`operator.getitem`)

_implemented: list[frozenset[Any]] = []  # the first child's answer: the same for every child


class Unsupported(Exception):
    """A graph holds something `encode` cannot carry: it is lowered in this process."""


@dataclass(frozen=True)
class _Counted:
    """The child's count run (`budget.count_run` of the call it was forked for): what
    stopped it, if anything (a refusal's cause; a failure as its type and message)."""

    over: str | None = None
    failed: str | None = None


def _count(count: Callable[[], None]) -> _Counted:
    try:
        count()
    except BuildOverBudget as exc:
        return _Counted(over=exc.cause)
    except Exception as exc:
        from ort_autopatch.engine.backends.ort import capture

        return _Counted(failed=capture.describe(exc))
    return _Counted()


@dataclass(frozen=True)
class _Ref:
    """An argument that is another node's value, by the node's name."""

    name: str


@dataclass(frozen=True)
class _Fake:
    """A fake tensor as its metadata (`decode` makes it again)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Node:
    """One FX node as plain data."""

    op: str
    name: str
    target: Any  # a str for placeholders, attributes and the output; else ("op"|"py", ...)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    val: Any


@dataclass(frozen=True)
class Encoded:
    """One graph as plain data, with its real constants."""

    nodes: list[_Node]
    constants: dict[str, torch.Tensor]
    #: the inputs the graph's caller hands over (`stages.HANDED`)
    handed: frozenset[str] = frozenset()


def _target(target: Any) -> tuple[str, ...]:
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target.overloadpacket._qualified_op_name.split("::")
        found: tuple[str, ...] = ("op", namespace, name, target._overloadname)
    else:
        module = getattr(target, "__module__", None)
        name = getattr(target, "__name__", None)
        if module not in _CALLABLE_MODULES or not isinstance(name, str):
            raise Unsupported(f"the target {target!r}")
        found = ("py", module, name)
    if _resolve(found) is not target:
        raise Unsupported(f"the target {target!r}, which its name does not find")
    return found


def _resolve(target: tuple[str, ...]) -> Any:
    if target[0] == "op":
        _, namespace, name, overload = target
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    return getattr(importlib.import_module(target[1]), target[2])


def _arg(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return _Ref(value.name)
    if isinstance(value, list | tuple):
        items = [_arg(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.device) and value.type == "cpu":
        return value
    raise Unsupported(f"an argument {value!r}")


def _val(value: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, FakeTensor):
        if value.device.type != "cpu" or value.layout != torch.strided:
            raise Unsupported(f"a value on {value.device}, {value.layout}")
        sizes = (*value.shape, *value.stride(), value.storage_offset())
        if not all(type(size) is int for size in sizes):
            raise Unsupported("a symbolic size")
        shape, stride = tuple(map(int, value.shape)), tuple(map(int, value.stride()))
        return _Fake(shape, stride, int(value.storage_offset()), value.dtype)
    if isinstance(value, list | tuple):
        items = [_val(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    if type(value) in (int, float, bool) or value is None:
        return value
    raise Unsupported(f"a value {type(value).__name__}")


def encode(gm: torch.fx.GraphModule) -> Encoded:
    """`gm` as plain data, or `Unsupported`."""
    nodes = []
    constants: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            target: Any = node.target
            val = _val(node.meta.get("val")) if node.op == "placeholder" else None
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            if (
                "." in node.target
                or type(value) is not torch.Tensor
                or value.device.type != "cpu"
                or node.meta.get("val") is not value
            ):
                raise Unsupported(f"an attribute {node.target!r}")
            constants[node.target] = value
            target, val = node.target, None
        elif node.op == "call_function":
            target = _target(node.target)
            val = _val(node.meta.get("val"))
        else:
            raise Unsupported(f"a {node.op} node")
        if node.type is not None:  # the translator writes it into the graph's metadata
            raise Unsupported(f"a node typed {node.type!r}")
        nodes.append(
            _Node(
                node.op,
                node.name,
                target,
                _arg(tuple(node.args)),
                {key: _arg(value) for key, value in node.kwargs.items()},
                val,
            )
        )
    return Encoded(nodes, constants, frozenset(gm.meta.get(stages.HANDED, ())))


def decode(encoded: Encoded, fake: bool) -> torch.fx.GraphModule:
    """The graph `encode` was given, its values fake tensors of a new fake mode (`fake`), or
    tensors on the meta device: the same shapes, strides and dtypes, all the translator
    reads of a graph whose types were promoted, and no fake mode (whose first use imports
    torch._dynamo, a second of the child's time)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode() if fake else contextlib.nullcontext()

    def value_of(value: Any) -> Any:
        if isinstance(value, _Fake):
            extent = 1 + sum(
                (size - 1) * step for size, step in zip(value.shape, value.stride, strict=True)
            )
            with mode:
                base = torch.empty(
                    value.offset + max(extent, 0),
                    dtype=value.dtype,
                    device="cpu" if fake else "meta",
                )
                return base.as_strided(value.shape, value.stride, value.offset)
        if isinstance(value, list | tuple):
            items = [value_of(item) for item in value]
            return items if isinstance(value, list) else tuple(items)
        return value

    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}

    def arg(value: Any) -> Any:
        if isinstance(value, _Ref):
            return made[value.name]
        if isinstance(value, list | tuple):
            items = [arg(item) for item in value]
            return items if isinstance(value, list) else tuple(items)
        return value

    root = torch.nn.Module()
    for name, tensor in encoded.constants.items():
        setattr(root, name, tensor)
    for spec in encoded.nodes:
        target = _resolve(spec.target) if spec.op == "call_function" else spec.target
        node = graph.create_node(
            spec.op,
            target,
            arg(spec.args),
            {key: arg(value) for key, value in spec.kwargs.items()},
            name=spec.name,
        )
        if node.name != spec.name:
            raise ValueError(f"node {spec.name!r} came back as {node.name!r}")
        made[spec.name] = node
        if spec.op == "get_attr":
            node.meta["val"] = encoded.constants[spec.target]
        elif spec.op != "output":
            node.meta["val"] = value_of(spec.val)
    gm = torch.fx.GraphModule(root, graph)
    gm.meta[stages.HANDED] = encoded.handed
    return gm


def _implemented_names() -> list[tuple[str, ...]]:
    """The ATen operators torchlib translates, by name (all the decomposition table reads)."""
    from ort_autopatch.engine.backends.ort import lowering

    names = []
    for target in lowering.implemented():
        if isinstance(target, torch._ops.OpOverload):
            try:
                names.append(_target(target))
            except Unsupported:
                continue
    return names


def _found(names: list[tuple[str, ...]]) -> list[Any]:
    """The operators of `names` that exist here (the exporter's imports register a few of
    their own, which no table of this process holds)."""
    found = []
    for name in names:
        try:
            found.append(_resolve(name))
        except AttributeError:
            continue
    return found


def _warm_up() -> None:
    """Lower a one-node graph while the parent traces: a process's first translation and
    serialisation cost more than a small graph's own; and make the ONNX operators'
    signatures (`lowering.warm_signatures`)."""
    from ort_autopatch.engine.backends.ort import lowered, lowering

    x = _Fake((2,), (1,), 0, torch.float32)
    nodes = [
        _Node("placeholder", "x", "x", (), {}, x),
        _Node("call_function", "mul", ("op", "aten", "mul", "Tensor"), (_Ref("x"),) * 2, {}, x),
        _Node("output", "output", "output", ((_Ref("mul"),),), {}, None),
    ]
    lowered.lower_graphs(decode(Encoded(nodes, {}), fake=False), None, "warm-up", promoted=True)
    lowering.warm_signatures()


def _serve(
    receive: Callable[[], Any],
    send: Callable[[Any], None],
    count: Callable[[], None] | None = None,
    shared: Sequence[tuple[int, int]] = (),
) -> None:
    """The child: make the build's count run (`count`, if given: its verdict is the first
    answer), let go of the parent's tensors (`shared`, `sandbox.let_go`: nothing here reads
    them after the count), import, name what torchlib translates, lower each graph that
    comes (more follow a trace made again with the child's names) until this process closes
    it."""
    # one thread: ATen's parallel loops run inline, never entering an OpenMP region, whose
    # thread pool (libgomp's) does not survive a fork
    torch.set_num_threads(1)
    counted = None if count is None else _count(count)
    sandbox.let_go(shared)  # before the verdict: a parent that has read it writes freely
    del count
    if counted is not None:
        send(counted)
    # no automatic collections: its imports and translations make objects by the hundred
    # thousand (0.05 s of collections measured in the imports alone); one collection after
    # each answer, while the parent has its graphs, frees what a lowering left
    gc.disable()
    from ort_autopatch.engine.backends.ort import lowering

    calls.EXPORT_LOCK = lowering.EXPORT_LOCK = threading.RLock()  # maybe held at fork
    lowering._lock = threading.Lock()
    send(_implemented_names())
    _warm_up()
    while True:
        try:
            request = receive()
            answers = _answers(request, receive)
        except EOFError:
            return
        for answer in answers:
            send(answer)
        del answers
        # kept for later builds: the build's garbage goes while the parent runs
        gc.collect()


#: A build's first graph of at least this much lowering work (`lowering_work`) is lowered in
#: a second child, beside the next graph lowered here (`_answers`); a smaller one (a layer's:
#: a few hundred operators, tens of milliseconds) costs less than the fork would save.
ASIDE_WORK = 600
#: An operator of ours (`norms`, `convolutions`, `linears`, `recurrent`, `windows`) adds up
#: to twenty ONNX nodes to a graph where an ATen operator adds one to three: its lowering
#: work counts as this many operators'. (Counted as one, ResNet-50's backward, its 53
#: BatchNorms' and 53 convolutions' backwards each one operator, fell below the mark, and
#: its lowering, 0.9 s, no longer overlapped forward's.)
OURS_WORK = 10


def lowering_work(namespaces: Iterable[str]) -> int:
    """A graph's lowering work from the namespaces of its operator nodes (other nodes, the
    getitems of tuples, add no ONNX node of their own): one per ATen operator, `OURS_WORK`
    per operator of ours."""
    from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE

    return sum(OURS_WORK if space == OPERATOR_NAMESPACE else 1 for space in namespaces)


def _encoded_work(encoded: Encoded) -> int:
    operators = [n.target for n in encoded.nodes if n.op == "call_function"]
    return lowering_work(t[1] for t in operators if t[0] == "op")


def _graph_work(graph: torch.fx.GraphModule) -> int:
    operators = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    return lowering_work(t.namespace for t in operators if isinstance(t, torch._ops.OpOverload))


def _answers(request: Any, receive: Callable[[], Any]) -> list[Any]:
    """The answers to a build's requests, `request` and those after it up to its last, in
    order: each graph lowered, or None where the parent is to lower it.

    A large first graph (backward, which the parent sends first: `Lowerer.lower`) is lowered
    in a grandchild while this child takes the next request and lowers that one: on two
    cores the two graphs' lowerings overlap (BERT-base's 0.8 s and 0.5 s; ResNet-50's 1.0 s
    and 0.5 s). A grandchild that fails or dies leaves its graph to this child."""
    cls, role, encoded, last = request
    if last or _encoded_work(encoded) < ASIDE_WORK:
        answers = [_answer(cls, role, encoded)]
        while not last:
            cls, role, encoded, last = receive()
            answers.append(_answer(cls, role, encoded))
        return answers
    rest: list[Any] = []

    def meanwhile() -> None:
        more = False
        while not more:
            cls, role, encoded, more = receive()
            rest.append(_answer(cls, role, encoded))

    try:
        first = sandbox.run(functools.partial(_answer, cls, role, encoded), meanwhile)
    except (sandbox.Crashed, sandbox.ChildError):
        first = _answer(cls, role, encoded)
    return [first, *rest]


def _answer(cls: str, role: str, encoded: Encoded) -> Any:
    """One graph lowered, or None: lowered (or cut at torch nodes: `torch_nodes`) by the
    parent."""
    from ort_autopatch.engine.backends.ort import lowered

    try:
        return lowered.lower_graph(decode(encoded, fake=False), cls, role, promoted=True, cut=False)
    except ExportError:
        return None


#: The shortest window over which CPU use is read (`/proc/stat` counts in 10 ms ticks).
WINDOW_SECONDS = 0.05
#: A core counts as free for the child when other processes leave at least this much of the
#: CPUs this process may use idle, besides the core this process itself keeps busy.
FREE_CORE = 0.7


def _cpu_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(idle, total) ticks of `cpus` so far, from /proc/stat; None where it cannot be read."""
    idle = total = 0
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) not in cpus:
                    continue
                ticks = [
                    int(f) for f in fields[:8]
                ]  # user nice system idle iowait irq softirq steal
                idle += ticks[3] + ticks[4]
                total += sum(ticks)
    except (OSError, ValueError):
        return None
    return (idle, total) if total else None


def _quota_cores() -> float | None:
    """The cgroup's CPU quota in cores (cgroup v2 `cpu.max`), None when unlimited or unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as limit:
            quota, period = limit.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


class _CoreProbe:
    """Whether a core is free for the child, read from what the CPUs do now: the idle time of
    the CPUs this process may run on (`/proc/stat`) over a short window, less the CPU time
    this process spent in it. The 1-minute load average that decided before lags a minute
    behind both ways (a job that just stopped keeps the child off, one that just started lets
    it on). Where /proc/stat cannot be read, the load average decides as before.

    `begin` starts the window; `free` ends it, after work this process does anyway (the
    imports both sides share), waiting only for what is left of `WINDOW_SECONDS`."""

    def __init__(self) -> None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.cpus = set(affinity) if affinity else set(range(os.cpu_count() or 1))
        self._start = time.perf_counter()
        self._own = time.process_time()
        self._ticks = _cpu_ticks(self.cpus)

    @classmethod
    def begin(cls) -> _CoreProbe:
        return cls()

    def free(self) -> bool:
        cores = len(self.cpus)
        quota = _quota_cores()
        if quota is not None:
            cores = min(cores, int(quota))
        if cores < 2:
            return False
        if self._ticks is None:
            return os.getloadavg()[0] < cores
        wait = WINDOW_SECONDS - (time.perf_counter() - self._start)
        if wait > 0:
            time.sleep(wait)
        ticks = _cpu_ticks(self.cpus)
        elapsed = time.perf_counter() - self._start
        if ticks is None or ticks[1] <= self._ticks[1]:
            return os.getloadavg()[0] < cores
        idle, total = ticks[0] - self._ticks[0], ticks[1] - self._ticks[1]
        busy = len(self.cpus) * (1 - idle / total)  # cores busy in the window, this one's too
        own = (time.process_time() - self._own) / elapsed
        others = max(busy - own, 0.0)
        log.debug("lowering child: %.2f cores busy elsewhere of %d", others, cores)
        # this process keeps one core busy (the trace): the child needs another one idle
        return cores - 1 - others >= FREE_CORE


def _core_to_spare(probe: _CoreProbe | None = None) -> bool:
    """Whether a core of this process's is idle enough for a child to help, over the window
    `probe` began (`_CoreProbe`; None: one beginning now). Measured on 2 shared cores
    (TransformerEncoderLayer, cold first call, median of 5): at load 1.5 to 2, 2.19 s with the
    child against 2.85 s without; at load 7, 11.6 s against 10.5 s (the child's own CPU, the
    fork and the encoding delay both processes when no core is free)."""
    return (probe or _CoreProbe.begin()).free()


#: A child no build has asked for this long is closed. Between builds it costs no CPU, but
#: it holds this process's memory as it was at the fork, page by page as this process writes
#: its own copy (the parameters a training step updates): kept only while builds come.
IDLE_SECONDS = 15.0

_kept_lock = threading.Lock()
_kept: list[tuple[Lowerer, threading.Timer]] = []  # the child between two builds, if any


def _forget_kept() -> None:
    """In a forked process (a build child, `aside.py`; a data loader's worker): the kept
    child is the parent's to use and close, and our lock may have been held at the fork."""
    global _kept_lock
    _kept_lock = threading.Lock()
    _kept.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_kept)


class Lowerer:
    """A child lowering the exact-shape graphs of a process's builds (see the module's
    docstring): forked for one build and kept for the next (`release`), whose lowering then
    pays no import (a DCGAN's three graphs: 1.3 s of the exporter's imports each, before)."""

    def __init__(self, child: sandbox.Child, counts: bool = False) -> None:
        self._child = child
        self._names: list[tuple[str, ...]] | None = None
        self._failed = False  # the child failed: nothing more is asked of it
        #: the child makes this build's count run (`verdict` tells its outcome)
        self.counts = counts
        self._count_pending = counts  # the verdict, its first answer, is still to be read
        self._counted: _Counted | None = None  # that verdict, once read

    @classmethod
    def start(
        cls,
        count: Callable[[], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
        shared: Iterable[torch.Tensor] = (),
    ) -> Lowerer | None:
        """The child kept from an earlier build; else a child importing the exporter now,
        which first makes the build's count run (`count`: `counts` says so; on the other
        core, while this process traces); None where forking is unavailable, where this
        process has imported the exporter already (lowering here costs no import), or where
        no core is free for a new child (`_core_to_spare`: a kept child has its imports done
        and costs what lowering here would). `meanwhile()`, work the build needs whatever is
        decided, runs in the probe's window, which is otherwise waited out (50 ms of a
        first call); not run where no window is needed. A new child lets go of the memory
        of the `shared` tensors (the module's, the call's) once its count run is made
        (`sandbox.shared_pages`): this process's writes to them copy nothing then."""
        with _kept_lock:
            if _kept:
                kept, timer = _kept.pop()
                timer.cancel()
                kept.counts = False  # forked for an earlier build: this one counts here
                return kept
        if _EXPORTER in sys.modules:
            return None
        probe = _CoreProbe.begin()
        for name in _SHARED:  # once, before the fork, rather than once on each side
            importlib.import_module(name)
        if meanwhile is not None:
            meanwhile()
        if not _core_to_spare(probe):
            return None
        return cls.spawn(count, shared)

    @classmethod
    def spawn(
        cls, count: Callable[[], None] | None = None, shared: Iterable[torch.Tensor] = ()
    ) -> Lowerer | None:
        """A child, whatever this process has imported (making `count` first, if given,
        then letting go of the `shared` tensors' memory); None where forking is unavailable
        or another thread may be working (`sandbox.working_thread`)."""
        busy = sandbox.working_thread()
        if busy is not None:
            log.debug("lowering child: not forked while thread %r works", busy)
            return None
        pages = sandbox.shared_pages(shared)
        child = sandbox.Child.spawn(functools.partial(_serve, count=count, shared=pages))
        return None if child is None else cls(child, counts=count is not None)

    def _receive(self) -> Any:
        return self._child.receive(TIMEOUT_SECONDS)

    def _read_count(self, wait: bool) -> None:
        """Read the count's verdict, if the child made one and it has not been read (now,
        or only if it has come, without `wait`): before any other answer. A child that fails
        first counts nothing: the trace's own node checks then hold the limit (at the
        trace's speed)."""
        if not self._count_pending or self._failed:
            return
        if not wait and not self._child.answered():
            return
        self._count_pending = False
        try:
            counted = self._receive()
        except (sandbox.ChildError, TimeoutError, EOFError, OSError) as exc:
            log.debug("the lowering child made no count run (%s)", exc)
            self._failed = True
            return
        assert isinstance(counted, _Counted), f"a count's verdict, not {type(counted)}"
        self._counted = counted

    def _read_names(self) -> bool:
        """Read the child's operator names, its answer after the count's verdict, if not
        read yet; False if the child failed first (raises as `_receive`)."""
        if self._names is None:
            self._read_count(wait=True)
            if self._failed:
                return False
            self._names = self._receive()
        return True

    def verdict(self, cls: str) -> Callable[[bool], None]:
        """`budget.counted_aside`'s question for the child's count run of `cls`'s call: its
        refusal, raised as the count made here would raise it."""

        def verdict(wait: bool) -> None:
            self._read_count(wait)
            counted = self._counted
            if counted is None or not self.counts:
                return
            if counted.over is not None:
                raise BuildOverBudget(cls, counted.over, budget.REMEDY)
            if counted.failed is not None:
                from ort_autopatch.engine.backends.ort import capture

                raise capture.untraceable(cls, counted.failed)

        return verdict

    @staticmethod
    def expected() -> frozenset[Any]:
        """What torchlib translates, as this process can tell without importing it: an
        earlier child's answer, else torchlib's sources read (`lowering.read_implemented`).
        A trace may start from it; `implemented` confirms it before its graphs are used."""
        if _implemented:
            return _implemented[0]
        from ort_autopatch.engine.backends.ort import lowering

        return lowering.read_implemented()

    def implemented(self) -> frozenset[Any] | None:
        """The operators torchlib translates, from the child (or an earlier child); None if
        it failed: `lowering.implemented()` then."""
        if _implemented:
            return _implemented[0]
        if self._failed:
            return None
        try:
            if not self._read_names():
                return None
            assert self._names is not None
            found = frozenset(_found(self._names))
        except (sandbox.ChildError, TimeoutError, EOFError, OSError) as exc:
            log.debug("the lowering child named no operators (%s)", exc)
            self._failed = True
            return None
        _implemented.append(found)
        return found

    def lower(
        self,
        forward: torch.fx.GraphModule,
        backward: torch.fx.GraphModule | None,
        cls: str,
        meanwhile: Callable[[], Any] | None = None,
    ) -> Graphs | None:
        """Both graphs lowered by the child, or None: lower them here. `meanwhile()` runs
        while the child lowers them (time this process would spend waiting).

        Types are promoted here, in place (the pass runs the graph on fake tensors, which the
        child would have to import torch._dynamo for), as lowering here would promote them:
        a graph promoted is marked (`lowering.PROMOTED`), so lowering it here after all does
        not promote it twice. Each graph is sent once promoted: the child lowers forward
        while this process promotes backward. A large backward goes first instead: the child
        lowers it in a second child while it lowers forward (`_answers`)."""
        from ort_autopatch.engine.backends.ort import lowered, lowering

        pairs = (("forward", forward), ("backward", backward))
        graphs = [(role, graph) for role, graph in pairs if graph is not None]
        if backward is not None and _graph_work(backward) >= ASIDE_WORK:
            graphs.reverse()
        if self._failed:
            return None
        sent = 0
        kept = True  # every graph sent
        try:
            for k, (role, graph) in enumerate(graphs):
                try:
                    if not graph.meta.get(lowering.PROMOTED):
                        lowering.promote_types(graph)
                    encoded = encode(graph)
                except Unsupported as exc:
                    log.debug("%s: lowered in this process: the graph has %s", cls, exc)
                    kept = False
                    break
                except Exception as exc:  # lowering here says what the exporter makes of it
                    log.debug("%s: lowered in this process: promotion failed (%s)", cls, exc)
                    kept = False
                    break
                if not self._read_names():
                    return None
                self._child.send((cls, role, encoded, k == len(graphs) - 1), TIMEOUT_SECONDS)
                sent += 1
            if kept and meanwhile is not None:
                meanwhile()
            parts: list[lowered.LoweredGraph | None] = [self._receive() for _ in range(sent)]
        except (sandbox.ChildError, TimeoutError, EOFError, OSError) as exc:
            log.debug("%s: lowered in this process: the child failed (%s)", cls, exc)
            self._failed = True
            return None
        if not kept or any(part is None for part in parts):  # None: lower here
            return None
        got = [part for part in parts if part is not None]
        return lowered.Graphs.of(sorted(got, key=lambda part: part.role == "backward"))

    def release(self, idle: float | None = None) -> None:
        """The build is done with the child: kept for the next build for `idle` seconds
        (`IDLE_SECONDS` by default; one child per process; a failed one, or a second, is
        closed)."""
        with _kept_lock:
            if self._failed or _kept:
                self.close()
                return
            timer = threading.Timer(IDLE_SECONDS if idle is None else idle, self._expire)
            timer.daemon = True
            timer.name = "ort_autopatch-lowering-child"
            _kept.append((self, timer))
            timer.start()

    def _expire(self) -> None:
        with _kept_lock:
            if not any(kept is self for kept, _ in _kept):
                return  # a build took it meanwhile
            _kept.clear()
        self.close()

    def close(self) -> None:
        self._child.close()


#: A child forked before any build waits this long for the first one (a script's setup:
#: imports, data, the model and optimizer) before it is closed.
PRESTART_IDLE_SECONDS = 120.0

_prestarted: list[bool] = []  # once per process


def prestart() -> None:
    """Fork the lowering child now, before the process's first build, where a core is free:
    its 1.3 s of imports then overlap the user's script setting up instead of the first
    call. Once per process; nothing where the exporter is imported here already, a child is
    kept, or forking is unavailable. Reading whether a core is free waits out the probe's
    window (`WINDOW_SECONDS`, once per process, in the import that patched the class)."""
    with _kept_lock:
        if _prestarted or _kept or _EXPORTER in sys.modules:
            return
        _prestarted.append(True)
    if not _core_to_spare():
        return
    lowerer = Lowerer.spawn()
    if lowerer is not None:
        lowerer.release(PRESTART_IDLE_SECONDS)


def close_kept() -> None:
    """Close the child kept between builds, if any (a test's clean state)."""
    with _kept_lock:
        kept = list(_kept)
        _kept.clear()
    for lowerer, timer in kept:
        timer.cancel()
        lowerer.close()
