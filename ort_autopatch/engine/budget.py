"""What one build may cost, and where a build that would cost more stops.

A graph pays for its build only over many calls, so a build that costs more than the calls it
could speed up must not hold the user's script: it gives up with the reason, and the calls run
in PyTorch. Each limit is checked where the build is still in Python; the parts in C++ (ONNX
Runtime's session creation above all) cannot be stopped once started, so their cost is
predicted from the size of the trace:

- graph size (`Limits.nodes`): the nodes of the traced graph, read every so often while forward
  is traced (at submodule calls) and once the trace is complete, before the exporter's passes.
  pytorch/examples' time_sequence_prediction unrolls two LSTMCells over 1000 time steps, about
  39 traced nodes a step; ORT's session creation grows faster than the graph (100 steps: 6,500
  ONNX nodes, 12 s; 200 steps: 43 s), so the whole loop would take hours. A 12-layer GPT-2
  traces to about 3,100 nodes, a 12-layer BERT to 1,000. The plain backend first counts the
  operators of a run of forward on the call's own tensors (`count_run`), as fast as eager
  (made by the lowering child while this process traces, where one is forked for the build:
  `counted_aside`), and then the nodes aot's trace records;
- time (`Limits.seconds`): a deadline checked at every submodule call of the trace, at every
  node the exporter converts, and between the build's phases;
- rebuilds: `too_many_rebuilds` says when a module keeps missing its cache (a new constant
  argument each call, more input shapes than the cache holds).

The limits of the build under way are per thread (`limited`); `enforced` puts the checks into
torch's tracer and exporter for the length of one export, under the engine's export lock, and
takes them out again however the export ends; `count_run` and `enforced_fx` (the plain
backend's) are modes of the tracing thread alone.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ort_autopatch.engine.errors import BuildOverBudget

#: Builds a module makes before `too_many_rebuilds` may stop it.
REBUILD_FLOOR = 8
#: Fewer calls than this per graph built (past the floor) is a module rebuilding on every call.
CALLS_PER_BUILD = 2

REMEDY = (
    "Its calls run in PyTorch. To build it anyway, raise ORT_AUTOPATCH_MAX_GRAPH_NODES or "
    "ORT_AUTOPATCH_MAX_BUILD_SECONDS (0 lifts the limit)"
)

_state = threading.local()


@dataclass(frozen=True)
class Limits:
    """The most one build may cost; 0 lifts a limit."""

    seconds: float = 0.0
    nodes: int = 0


class _Budget:
    def __init__(self, cls: str, limits: Limits) -> None:
        self.cls = cls
        self.limits = limits
        self.deadline = time.perf_counter() + limits.seconds if limits.seconds > 0 else math.inf
        self.events = 0  # traced values named and submodules called, in this trace
        self.next_count = 1  # the event at which the growing trace is counted next
        self.made = 0  # tensors made while aot learns the outputs (`tracing_fx`)
        self.traced = 0  # torch functions called while aot records the graph
        self.next_traced = 1  # the call at which that graph is counted next
        #: the verdict of a count run made by another process (`counted_aside`)
        self.counted: Callable[[bool], None] | None = None

    def check_time(self, where: str) -> None:
        if time.perf_counter() > self.deadline:
            raise BuildOverBudget(
                self.cls,
                f"building its graph took longer than {self.limits.seconds:g} s (stopped "
                f"{where}), more than the calls it could speed up",
                REMEDY,
            )

    def check_nodes(self, count: int, where: str) -> None:
        limit = self.limits.nodes
        if limit > 0 and count > limit:
            raise BuildOverBudget(
                self.cls,
                f"forward traces to more than {limit} graph nodes ({count} {where}; a loop "
                "unrolled over many steps?): ONNX Runtime would take longer to build the graph "
                "than the calls it could speed up",
                REMEDY,
            )

    def tracing(self) -> None:
        """At each value the tracer names and each submodule call: the deadline, and the
        trace's size at events spaced to reach the limit in a few counts (each walks the
        graph): half the way to the limit at the rate seen so far, at least a twentieth."""
        self.events += 1
        if self.events & 63 == 0:
            self.check_time("while tracing forward")
        limit = self.limits.nodes
        if limit <= 0 or self.events < self.next_count:
            return
        state = torch._C._get_tracing_state()
        if state is None:
            return
        self._counted(_count(state.graph()))

    def tracing_fx(self, result: Any, args: Any) -> None:
        """After each torch function the plain backend's trace (aot_autograd's) calls: the
        deadline, and the size of the graph it records so far. aot first runs forward on fake
        tensors to learn its outputs, recording nothing: there the tensors the calls made
        stand in for the nodes, of which each makes at least one."""
        self.events += 1
        if self.events & 63 == 0:
            self.check_time("while tracing forward")
            if self.counted is not None:
                self.counted(False)
        limit = self.limits.nodes
        if limit <= 0:
            return
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            self.made += _made(result, args)
            if self.made > limit:
                self.check_nodes(self.made, "by the middle of the trace")
            return
        self.traced += 1
        if self.traced >= self.next_traced:
            count = len(mode.tracer.graph.nodes)
            self.check_nodes(count, "by the middle of the trace")
            per_call = max(count, 1) / self.traced
            self.next_traced = self.traced + max(
                16, limit // 20, int((limit - count) / per_call / 2)
            )

    def _counted(self, count: int) -> None:
        limit = self.limits.nodes
        self.check_nodes(count, "by the middle of the trace")
        per_event = max(count, 1) / self.events
        self.next_count = self.events + max(16, limit // 20, int((limit - count) / per_event / 2))


def _made(result: Any, args: Any) -> int:
    """Tensors a torch function made (not one of its arguments returned as it is)."""
    if isinstance(result, torch.Tensor):
        return 0 if any(result is a for a in args) else 1
    if isinstance(result, (tuple, list)):
        return sum(isinstance(r, torch.Tensor) for r in result)
    return 0


def _count(graph: Any) -> int:
    """Nodes of a TorchScript graph, those inside blocks too: while tracing, each submodule's
    operations sit in the block of its call's node (the exporter inlines them later)."""
    total = 0
    pending = [graph]
    while pending:
        for node in pending.pop().nodes():
            total += 1
            if node.kind() in _WITH_BLOCKS:  # asking every node for its blocks costs 50 us
                pending.extend(node.blocks())
    return total


#: Node kinds that hold blocks in a trace.
_WITH_BLOCKS = frozenset({"prim::TracedModuleForward", "prim::If", "prim::Loop"})


@contextlib.contextmanager
def limited(cls: str, limits: Limits) -> Iterator[None]:
    """The limits of the build this thread runs now."""
    previous = getattr(_state, "budget", None)
    _state.budget = _Budget(cls, limits)
    try:
        yield
    finally:
        _state.budget = previous


def check(where: str) -> None:
    """Stop the build this thread runs if it is past its deadline."""
    budget: _Budget | None = getattr(_state, "budget", None)
    if budget is not None:
        budget.check_time(where)


def check_size(count: int, where: str) -> None:
    """Stop the build this thread runs if its graph has more than its limit of nodes."""
    budget: _Budget | None = getattr(_state, "budget", None)
    if budget is not None:
        budget.check_nodes(count, where)


class _TracedCalls(torch.overrides.TorchFunctionMode):
    """Every torch function a trace calls passes `_Budget.tracing_fx` after it."""

    def __init__(self, budget: _Budget) -> None:
        super().__init__()
        self.budget = budget

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        self.budget.tracing_fx(result, args)
        return result


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of a tensor's memory; None for a tensor without storage of its own."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # a tensor subclass, a sparse tensor
        return None


class _CountedOperators(TorchDispatchMode):
    """Counts the operators a run of forward on real tensors dispatches, against the node
    limit and the deadline. The run leaves every tensor it did not make as it was: a write
    into other memory (a parameter, a buffer, an input, a tensor attribute) lands in a copy
    of its target, which is all the count needs. Higher-order operators count as one."""

    supports_higher_order_operators = True

    def __init__(self, budget: _Budget) -> None:
        super().__init__()
        self.budget = budget
        self.made: set[int] = set()  # storages the run allocated, by address
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        schema = getattr(func, "_schema", None)  # a higher-order operator has none
        if schema is not None and schema.is_mutable:
            args = list(args)
            for k, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                if k < len(args):
                    args[k] = self._own(args[k])
                elif argument.name in kwargs:
                    kwargs[argument.name] = self._own(kwargs[argument.name])
        result = func(*args, **kwargs)
        self.count += 1
        if self.count & 63 == 0:
            self.budget.check_time("while tracing forward")
        if self.count > self.budget.limits.nodes:
            self.budget.check_nodes(
                self.count,
                "operators by the middle of the trace, counted as forward ran on the call's "
                "tensors",
            )
        if schema is not None:
            outputs = result if isinstance(result, (tuple, list)) else (result,)
            for returned, output in zip(schema.returns, outputs, strict=False):
                if returned.alias_info is None:  # fresh memory, not a view of an argument
                    for tensor in output if isinstance(output, (tuple, list)) else (output,):
                        self._made(tensor)
        return result

    def _own(self, value: Any) -> Any:
        """`value` if the run made its memory, else a copy to write into."""
        if isinstance(value, (tuple, list)):
            return type(value)(self._own(v) for v in value)
        if not isinstance(value, torch.Tensor) or _storage(value) in self.made:
            return value
        copy = value.clone()
        self._made(copy)
        return copy

    def _made(self, value: Any) -> None:
        address = _storage(value) if isinstance(value, torch.Tensor) else None
        if address is not None:
            self.made.add(address)


def counts() -> bool:
    """Whether the build this thread runs makes a count run (`count_run`): it has a node
    limit."""
    budget: _Budget | None = getattr(_state, "budget", None)
    return budget is not None and budget.limits.nodes > 0


def count_run(run: Callable[[], object]) -> None:
    """Run forward on the call's real tensors first, counting its operators: each becomes at
    least one node of the graph, so a forward past the node limit stops here, at about
    eager's speed. aot's trace runs on fake tensors at about 0.5 ms an operator, and the
    first of its two runs of forward (which learns the outputs) records no node to count: an
    LSTMCell unrolled over 1000 steps spent 10 s of CPU there before the trace had a node.
    The run changes no tensor it did not make (`_CountedOperators`); the caller restores
    what else forward changes, as it does for the trace."""
    budget: _Budget | None = getattr(_state, "budget", None)
    if budget is None or budget.limits.nodes <= 0:
        return
    with _CountedOperators(budget):
        run()


@contextlib.contextmanager
def counted_aside(verdict: Callable[[bool], None] | None) -> Iterator[None]:
    """The count run made by another process (a child forked for it before the trace):
    `verdict(wait)` raises the count's refusal once it has come (`BuildOverBudget`, as
    `count_run` here would), waiting for it only with `wait`. Asked every so often while the
    block traces, so that a forward past the limit stops the trace at once, and once more at
    its end, waiting: the build goes on only where the count allowed it, as with the count
    made here. None: nothing to ask (the count was made here, or none is made)."""
    budget: _Budget | None = getattr(_state, "budget", None)
    if verdict is None or budget is None:
        yield
        return
    budget.counted = verdict
    try:
        yield
        verdict(True)
    finally:
        budget.counted = None


@contextlib.contextmanager
def enforced_fx() -> Iterator[None]:
    """The limits inside the plain backend's trace (`backends/ort/capture.py`), for one
    trace: a torch function mode, this thread's own, so other threads' traces pass straight
    through."""
    budget: _Budget | None = getattr(_state, "budget", None)
    if budget is None:
        yield
        return
    with _TracedCalls(budget):
        yield


@contextlib.contextmanager
def enforced() -> Iterator[None]:
    """The checks inside torch's tracer (the name lookup it calls for every value it records,
    and `Module._slow_forward`, which every submodule call takes while tracing) and at the end
    of the trace (the exporter's `_optimize_graph`), for one export; the caller holds the
    export lock. Other threads' traces pass straight through."""
    if getattr(_state, "budget", None) is None:
        yield
        return
    from torch.jit import _trace
    from torch.onnx._internal.torchscript_exporter import utils

    slow_forward = torch.nn.Module._slow_forward
    optimize = utils._optimize_graph
    name_lookup = _trace._create_interpreter_name_lookup_fn

    def bounded_slow_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        budget: _Budget | None = getattr(_state, "budget", None)
        if budget is not None:
            budget.tracing()
        return slow_forward(self, *args, **kwargs)

    def bounded_name_lookup(frames_up: int = 1) -> Any:
        # The lookup names a value after the caller's local variable holding it, found
        # `frames_up` frames above it: one more for the frame of ours between them.
        lookup = name_lookup(frames_up + 1)

        def bounded_lookup(var: Any) -> Any:
            budget: _Budget | None = getattr(_state, "budget", None)
            if budget is not None:
                budget.tracing()
            return lookup(var)

        return bounded_lookup

    def bounded_optimize(graph: Any, *args: Any, **kwargs: Any) -> Any:
        budget: _Budget | None = getattr(_state, "budget", None)
        if budget is not None:
            budget.check_nodes(_count(graph), "in the complete trace")
            budget.check_time("after tracing forward")
        return optimize(graph, *args, **kwargs)

    torch.nn.Module._slow_forward = bounded_slow_forward  # type: ignore[method-assign]
    utils._optimize_graph = bounded_optimize
    _trace._create_interpreter_name_lookup_fn = bounded_name_lookup
    try:
        yield
    finally:
        _trace._create_interpreter_name_lookup_fn = name_lookup
        utils._optimize_graph = optimize
        torch.nn.Module._slow_forward = slow_forward  # type: ignore[method-assign]


def too_many_rebuilds(cls: str, builds: int, calls: int) -> BuildOverBudget | None:
    """The refusal for a module that has built `builds` graphs over `calls` calls, if it keeps
    rebuilding: past `REBUILD_FLOOR` builds, fewer than `CALLS_PER_BUILD` calls per graph."""
    if builds < REBUILD_FLOOR or calls >= CALLS_PER_BUILD * builds:
        return None
    return BuildOverBudget(
        cls,
        f"it built {builds} graphs for {calls} calls: a new constant argument or input shape "
        "on almost every call makes each graph cost a build it never pays back; the graphs it "
        "has keep serving their calls",
        "Its other calls run in PyTorch; pass changing numbers as tensors, or raise "
        "ORT_AUTOPATCH_CACHE_SIZE if the shapes repeat",
    )
