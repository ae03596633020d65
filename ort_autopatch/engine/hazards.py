"""Trace hazards: where a traced graph holds one call's sizes or values instead of the rule.

The TorchScript tracer records tensor operations; anything the traced Python code decides from a
tensor's value (`if bool(mask.any())`, `range(x.size(1))`, `len(x)`, `int(t.shape[0])`,
`torch.split(x, 1, dim=1)`) is frozen into the graph as it was for the example call. Such a
graph silently returns the example's numbers for another input. While the engine traces, every
conversion of a traced tensor to a Python value and every call that unrolls a dimension is
recorded with the user's file:line, and classified by walking the trace back from the converted
value:

- **shape**: the value depends on sizes only (`aten::size`, constants). The graph recomputes
  each such value as an extra output (`Check`) and is used for a call only while every value
  equals the traced one; when one differs, or when the graph's very structure follows a size
  (`split`, `unbind`, iteration), sizes join the cache key (one graph per input shape);
- **value**: the value depends on tensor data (inputs, parameters, buffers, random numbers): no
  graph can be trusted for another input, and the class runs in PyTorch with that reason.

While recording, a second source of frozen sizes is removed: the TorchScript exporter falls
back to the example's traced sizes wherever ONNX shape inference loses a dimension
(nn.MultiheadAttention's `k.view(k.shape[0], ...)` after the packed in-projection), and then
folds `Shape` of such values into constants. Without the traced sizes the exporter keeps them
symbolic, so shape-generic models get one graph for every length.
"""

from __future__ import annotations

import contextlib
import dis
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ort_autopatch.engine import random_ops

SHAPE = "shape"
VALUE = "value"
NONE = "none"  # a conversion whose value is the same for every input

_state = threading.local()
_patch_lock = threading.Lock()
_patch_depth = 0
_originals: dict[tuple[Any, str], Any] = {}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SKIPPED_DIRS = (_TORCH_DIR, _OWN_DIR, os.path.dirname(contextlib.__file__) + os.sep)
#: Trace nodes whose value is a size, not data: the walk back stops there.
_SHAPE_SOURCES = frozenset(
    {"aten::size", "aten::numel", "aten::dim", "prim::Constant", "onnx::Shape", "aten::len"}
)
_DATA_SOURCES = frozenset({"prim::Param", "prim::TracedAttr", "prim::GetAttr"})


@dataclass(frozen=True)
class Hazard:
    """One place where a trace froze something of the example call."""

    kind: str  # SHAPE or VALUE
    what: str  # e.g. "Python int from a tensor (range, int(), indexing)"
    where: str  # the user's file:line

    def describe(self) -> str:
        return f"{self.what} at {self.where}"


@dataclass(frozen=True)
class Check:
    """A Python value the trace took from sizes, which the graph recomputes as an extra output:
    a graph is used for a call only while every check gives the value seen at trace time."""

    expected: Any
    hazard: Hazard

    def holds(self, got: int | list[int]) -> bool:
        return bool(got == self.expected)

    @property
    def is_list(self) -> bool:
        return isinstance(self.expected, list)

    @property
    def width(self) -> int:
        return len(self.expected) if isinstance(self.expected, list) else 1


#: More checks than this in one trace: the graph is exported per input shape instead.
MAX_CHECKS = 64


class _Recorder:
    def __init__(self) -> None:
        self.found: dict[tuple[str, str], Hazard] = {}
        # traced tensors whose Python value the trace used, with that value
        self.checks: list[tuple[torch.Tensor, Check]] = []
        self.static = False  # a hazard no check can cover: one graph per input shape

    def add(self, kind: str, what: str, where: str) -> None:
        key = (what, where)
        if key not in self.found or kind == VALUE:
            self.found[key] = Hazard(kind, what, where)

    def check(self, traced: Any, value: Any, hazard: Hazard) -> None:
        if not isinstance(traced, torch.Tensor) or not _integral(value):
            self.static = True
        elif len(self.checks) < MAX_CHECKS:
            self.checks.append((traced, Check(value, hazard)))
        else:
            self.static = True


def _recorder() -> _Recorder | None:
    recorder: _Recorder | None = getattr(_state, "recorder", None)
    if recorder is None or torch._C._get_tracing_state() is None:
        return None  # not this thread's trace (or the exporter's symbolic phase)
    return recorder


def user_location(skip: int = 2) -> str:
    """file:line of the innermost frame outside torch, this tool and contextlib, followed by
    the innermost torch frame when the hazard lies inside torch's own code."""
    frame: Any = sys._getframe(skip)
    inner = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED_DIRS) and not filename.startswith("<"):
            where = f"{filename}:{frame.f_lineno}"
            return f"{where} (in {inner})" if inner else where
        if inner is None and filename.startswith(_TORCH_DIR):
            inner = f"torch/{filename[len(_TORCH_DIR) :]}:{frame.f_lineno}"
        frame = frame.f_back
    return inner or "<unknown>"


def _classify(tensor: torch.Tensor) -> str:
    """SHAPE when the traced value depends on sizes and constants only, else VALUE."""
    state = torch._C._get_tracing_state()
    if state is None:  # pragma: no cover - callers check
        return VALUE
    try:
        with torch.no_grad():
            tensor.detach()  # records aten::detach(value): a handle on the traced value
        node = _last_node(state.graph().return_node().prev())
        if node.kind() != "aten::detach":
            return VALUE
        pending = [node.inputsAt(0)]
    except Exception:  # a tensor the tracer does not know: be conservative
        return VALUE
    if _never_true(pending[0]):
        return NONE
    seen: set[int] = set()
    while pending:
        value = pending.pop()
        if value.unique() in seen:
            continue
        seen.add(value.unique())
        producer = value.node()
        kind = producer.kind()
        if kind in _SHAPE_SOURCES:
            continue
        if kind in _DATA_SOURCES or random_ops.aten(kind):
            return VALUE
        pending.extend(producer.inputs())
    return SHAPE


def _never_true(value: Any) -> bool:
    """`torch.rand([]) < p` with a constant p <= 0 (transformers' LayerDrop at its default 0):
    the branch is the same for every draw, so nothing is frozen. (A larger p is a VALUE
    hazard: the class runs in PyTorch. The plain backend decides alike, in plain/draws.py.)"""
    node = value.node()
    if node.kind() != "aten::lt":
        return False
    drawn, bound = node.inputsAt(0), node.inputsAt(1)
    if drawn.node().kind() not in ("aten::rand", "aten::rand_like"):
        return False
    if bound.node().kind() != "prim::Constant":
        return False
    try:
        limit = bound.toIValue()
    except Exception:
        return False
    return isinstance(limit, (int, float)) and limit <= 0


def _last_node(node: Any) -> Any:
    """The node recorded last: inside a submodule's forward the tracer appends to the block of
    a `prim::TracedModuleForward` node."""
    while node.kind() == "prim::TracedModuleForward":
        blocks = list(node.blocks())
        if not blocks:
            break
        block = blocks[-1]
        inner = block.returnNode().prev()
        if inner.kind() == "prim::Param":  # an empty block
            break
        node = inner
    return node


def _conversion(name: str, what: str) -> Callable[..., Any]:
    original = _originals[(torch.Tensor, name)]

    def convert(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder = _recorder()
        if recorder is None or _benign(sys._getframe(1), name):
            return original(self, *args, **kwargs)
        kind = _classify(self)
        if kind == NONE:
            return original(self, *args, **kwargs)
        where = user_location()
        recorder.add(kind, what, where)
        result = original(self, *args, **kwargs)
        if kind == SHAPE:
            recorder.check(self, result, Hazard(kind, what, where))
        return result

    convert.__name__ = name
    return convert


def _shape_use(
    owner: Any, name: str, what: str, applies: Callable[..., bool]
) -> Callable[..., Any]:
    original = _originals[(owner, name)]

    def use(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder()
        if recorder is None or not applies(*args, **kwargs):
            return original(*args, **kwargs)
        where = user_location()
        recorder.add(SHAPE, what, where)
        result = original(*args, **kwargs)
        # The graph's structure follows the size of one dimension: check that size.
        tensor, dim = args[0], _dim_of(name, args, kwargs)
        size = tensor.size(dim)
        as_int = _originals[(torch.Tensor, "__int__")]  # not recorded: this is our own read
        expected = as_int(size) if isinstance(size, torch.Tensor) else int(size)
        recorder.check(size, expected, Hazard(SHAPE, what, where))
        return result

    use.__name__ = name
    return use


def _dim_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if name in ("__len__", "__iter__"):
        return 0
    position = 1 if name == "unbind" else 2
    dim = kwargs.get("dim", args[position] if len(args) > position else 0)
    return int(dim)


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


def _split_by_size(tensor: Any, split_size: Any = None, *args: Any, **kwargs: Any) -> bool:
    size = kwargs.get("split_size_or_sections", kwargs.get("split_size", split_size))
    return not isinstance(size, (list, tuple))  # an int size: the piece count follows the size


#: Code whose conversions the engine makes right itself: BatchNorm's `float(num_batches_tracked)`
#: only sets the running-statistics factor, which the training build applies by PyTorch's rule
#: (`backends/ort_training/run.BatchNormUpdate`) instead of the graph.
_BENIGN = frozenset({torch.nn.modules.batchnorm._BatchNorm.forward.__code__})

#: Subscripts: `x[..., : t.shape[-1] // 2]` asks the bound's `__index__`, yet the tracer records
#: a traced tensor bound as a dynamic slice, so the graph stays right for every size.
_SUBSCRIPTS = frozenset(dis.opmap[name] for name in ("BINARY_SUBSCR", "STORE_SUBSCR"))


def _benign(caller: Any, name: str) -> bool:
    if caller.f_code in _BENIGN:
        return True
    return name == "__index__" and caller.f_code.co_code[caller.f_lasti] in _SUBSCRIPTS


#: the conversions of tensor data to Python values -> how a hazard names them
CONVERSIONS = {
    "__bool__": "Python bool from a tensor (a branch taken for this call)",
    "__int__": "Python int from a tensor",
    "__index__": "Python int from a tensor (range, indexing)",
    "__float__": "Python float from a tensor",
    "item": "tensor.item()",
    "tolist": "tensor.tolist()",
    "numpy": "tensor.numpy()",
    "__array__": "NumPy array from a tensor",
}
_SHAPE_USES: list[tuple[Any, str, str, Callable[..., bool]]] = [
    (torch.Tensor, "__len__", "len() of a tensor", _always),
    (torch.Tensor, "__iter__", "iteration over a tensor's first dimension", _always),
    (torch.Tensor, "unbind", "unbind over a dimension", _always),
    (torch, "unbind", "unbind over a dimension", _always),
    (torch.Tensor, "split", "split into pieces of a fixed size", _split_by_size),
    (torch, "split", "split into pieces of a fixed size", _split_by_size),
]


def _install() -> None:
    for name in CONVERSIONS:
        _originals[(torch.Tensor, name)] = torch.Tensor.__dict__.get(name) or getattr(
            torch.Tensor, name
        )
    for owner, name, _, _ in _SHAPE_USES:
        _originals[(owner, name)] = getattr(owner, name)
    for name, what in CONVERSIONS.items():
        setattr(torch.Tensor, name, _conversion(name, what))
    for owner, name, what, applies in _SHAPE_USES:
        setattr(owner, name, _shape_use(owner, name, what, applies))
    from torch.onnx._internal.torchscript_exporter import utils

    optimize = _originals[(utils, "_optimize_graph")] = utils._optimize_graph

    def optimize_stripped(graph: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "recorder", None) is not None:
            strip_sizes(graph)
        return optimize(graph, *args, **kwargs)

    utils._optimize_graph = optimize_stripped


def _uninstall() -> None:
    for (owner, name), original in _originals.items():
        if owner is torch.Tensor and name not in torch.Tensor.__dict__:
            continue
        if owner is torch.Tensor and original is getattr(torch._C.TensorBase, name, None):
            delattr(torch.Tensor, name)  # it was inherited from TensorBase: inherit it again
        else:
            setattr(owner, name, original)
    _originals.clear()


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    """The recording wrappers, installed while any thread traces (they pass straight through
    for threads that do not record)."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            _install()
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                _uninstall()


def checks_output(traced: list[torch.Tensor], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 vector of every checked value, the graph's last output.

    It is tied to the first input's data by a term that is always zero: ORT folds an output
    computed from sizes alone into a constant and then loses its producer in the gradient build.
    """
    values = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in traced])
    if inputs:
        first = inputs[0].detach().reshape(-1)[:1]
        values = values + (first != first).to(torch.int64).sum() * 0
    return values


def _integral(value: Any) -> bool:
    """Sizes are integers (bools are), and so is a float of a size (`math.sqrt(d // h)`); a
    fractional value (`x.size(1) / 2`) is left to per-shape graphs."""
    if isinstance(value, list):
        return all(_integral(v) for v in value)
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def take_checks() -> list[tuple[torch.Tensor, Check]]:
    """The checks recorded so far in this thread's trace (the export adds them as outputs)."""
    recorder: _Recorder | None = getattr(_state, "recorder", None)
    if recorder is None:
        return []
    checks, recorder.checks = recorder.checks, []
    return checks


@dataclass
class Findings:
    """What one trace froze."""

    hazards: list[Hazard]
    static: bool = False  # some hazard needs a graph per input shape


@contextlib.contextmanager
def recording() -> Iterator[Findings]:
    """Record this thread's trace hazards into the yielded list (filled when the block ends),
    and strip the traced sizes of this thread's exports (`strip_sizes`).

    Also swallows every warning of the export (TracerWarnings included) as the engine always did;
    a TracerWarning at a place no wrapper saw is kept as a SHAPE hazard, the conservative reading.
    """
    recorder = _Recorder()
    found = Findings([])
    previous = getattr(_state, "recorder", None)
    _state.recorder = recorder
    try:
        with _patched(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        _state.recorder = previous
    locations = {h.where for h in recorder.found.values()}
    for warning in caught:
        if issubclass(warning.category, torch.jit.TracerWarning):
            where = f"{warning.filename}:{warning.lineno}"
            text = str(warning.message)
            if where.startswith(_SKIPPED_DIRS):
                continue  # raised inside a recorded call (len(), iteration): already named
            if where not in locations and "registered as constants" not in text:
                recorder.add(SHAPE, f"traced Python value ({text.split('.')[0]})", where)
                recorder.static = True
    found.hazards.extend(recorder.found.values())
    found.static = recorder.static


def worst(found: list[Hazard]) -> str | None:
    """VALUE if any hazard depends on data, SHAPE if any on sizes, None for a clean trace."""
    kinds = {h.kind for h in found}
    return VALUE if VALUE in kinds else SHAPE if SHAPE in kinds else None


def strip_sizes(graph: Any) -> int:
    """Replace the sizes of every intermediate tensor type with unknowns (ranks stay)."""
    stripped = 0
    for node in graph.nodes():
        for block in node.blocks():
            stripped += strip_sizes(block)
        for out in node.outputs():
            kind = out.type()
            if isinstance(kind, torch._C.TensorType):
                sizes = kind.sizes()
                if sizes is not None:
                    out.setType(kind.with_sizes([None] * len(sizes)))
                    stripped += 1
    return stripped


def traced_constant(tensor: torch.Tensor) -> bool:
    """Whether the trace in progress computed `tensor` from no graph input (parameters and
    buffers are inputs too) and without drawing random numbers: the graph holds it as a
    constant, valid for every call the graph serves. False outside a trace, and for a tensor
    the tracer never saw."""
    value = _traced_value(tensor)
    if value is None:
        return False
    seen = {value.unique()}
    pending = [value]
    while pending:
        node = pending.pop().node()
        kind = node.kind()
        if kind == "prim::Param" or random_ops.aten(kind):
            return False  # fed by an input, or drawn anew on every call
        for source in node.inputs():
            if source.unique() not in seen:
                seen.add(source.unique())
                pending.append(source)
    return True


def traced_detached(tensor: torch.Tensor) -> bool:
    """Whether the trace in progress made `tensor` with `.detach()`: the graph's output for it
    is attached to ORT's autograd node, and eager's value was not. In aot_autograd's trace
    (the plain backend's: fake tensors, autograd live), any tensor that requires no grad:
    eager's value has none either."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(tensor, (FakeTensor, FunctionalTensor)):
        return not tensor.requires_grad
    value = _traced_value(tensor)
    return value is not None and bool(value.node().kind() == "aten::detach")


def _traced_value(tensor: torch.Tensor) -> Any:
    """The trace in progress's value for `tensor` (a `torch._C.Value`), or None."""
    if not torch._C._is_tracing():
        return None
    try:
        return torch._C._get_value_trace(tensor)  # type: ignore[attr-defined]
    except RuntimeError:
        return None
