"""Torch inside the graph: `com.microsoft::PythonOp` nodes whose forward and backward call PyTorch.

ONNX Runtime's training build runs a `PythonOp` by calling a registered *runner* with DLPack
tensors, and its gradient `PythonOpGrad` by calling a second runner with the context the first
one returned. ORT 1.19.2 takes the runners as addresses of C++ functions
(`std::vector<PyObject*> runner(const char*, void*, const std::vector<int64_t>&, ...)`);
ORTModule compiles a torch C++ extension for them. Here they are ctypes callbacks that follow the
x86-64 System V calling convention of that signature (the returned vector comes back through a
hidden pointer; vectors are three pointers, the library's `operator new` allocates), so nothing
is compiled on the user's machine.

Every node gets its own registered name, mapped here to a `NodeSpec`: the torch callable, the
non-tensor arguments in place (kept in Python, so floats are not rounded to float32 as ORT's
scalar attributes would be) and how outputs travel. Forward runs the callable under autograd
(training graphs) and keeps its torch graph in the context object; backward runs
`torch.autograd.grad` over that graph, so a custom `autograd.Function` sees its own
`save_for_backward`, `needs_input_grad`, `mark_non_differentiable` and `materialize_grads`
semantics, and an ATen operator gets torch's own derivative.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import itertools
import json
import logging
import platform
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import dlpack

from ort_autopatch.engine import rng
from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor, stored
from ort_autopatch.engine.backends.ort_training.torch_in_graph.stored import TENSOR
from ort_autopatch.engine.dlpack import dense

log = logging.getLogger("ort_autopatch")

DOMAIN = "com.microsoft"
OP_TYPE = "PythonOp"
GRAD_OP_TYPE = "PythonOpGrad"
NAME_PREFIX = "ort_autopatch."


@dataclass
class NodeSpec:
    """What one PythonOp node calls and how its values travel."""

    name: str  # the node's func_name, unique in the process
    label: str  # what reports show: "aten::cummax", "Function mypkg.STE"
    kind: str  # "function" or "aten"
    call: Callable[..., Any]
    template: list[Any]  # arguments with constants in place, TENSOR where a tensor goes
    bool_inputs: list[bool]  # tensor inputs that are bool (ORT hands them over as uint8)
    bool_outputs: list[bool]  # outputs that are bool (travel as uint8, cast back in the graph)
    num_outputs: int
    random: bool = False  # draws random numbers: runs on a fork of the RNG, seeded by the tool
    output_dtypes: list[torch.dtype] = field(default_factory=list)
    clone_inputs: bool = False  # until the first run shows it never writes its inputs
    #: the node as the persistent cache stores it (`stored.restore`), None for a Function's
    stored: dict[str, Any] | None = None


@dataclass(frozen=True)
class Callee:
    """What a node calls, as the exporter knows it before the node's values are typed (the
    fields `NodeSpec` starts from; `new_spec` adds the dtypes)."""

    label: str
    kind: str
    call: Callable[..., Any]
    template: list[Any]
    random: bool = False
    clone_inputs: bool = False
    #: an ATen node's callable as data (`stored.describe`): named by it, and storable
    described: dict[str, Any] | None = None


_specs: dict[str, NodeSpec] = {}
_counter = itertools.count()
_lock = threading.Lock()


def supported_platform() -> str | None:
    """None where the ctypes runners work, else why not."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            f"torch-calling nodes need x86-64 Linux (the runner calling convention), "
            f"not {sys.platform}/{platform.machine()}"
        )
    return None


def new_spec(
    callee: Callee,
    bool_inputs: list[bool],
    bool_outputs: list[bool],
    output_dtypes: Sequence[torch.dtype] = (),
) -> NodeSpec:
    """Register a node's callable under a fresh name (ORT holds the name for the process).

    A described node (`Callee.described`) is named by its description and typed values, the
    same name in every process (`stored`): the one spec of that name serves every node that
    calls the same thing, registered once."""
    ensure_runners()
    stored = None
    if callee.described is not None:
        stored = {
            **callee.described,
            "bool_inputs": list(bool_inputs),
            "bool_outputs": list(bool_outputs),
            "output_dtypes": [str(d).removeprefix("torch.") for d in output_dtypes],
        }
    with _lock:
        if stored is None:
            name = f"{NAME_PREFIX}{callee.kind}.{next(_counter)}"
        else:
            text = json.dumps(stored, sort_keys=True)
            name = f"{NAME_PREFIX}{callee.kind}.{hashlib.sha256(text.encode()).hexdigest()[:24]}"
            if name in _specs:
                return _specs[name]
        spec = NodeSpec(
            name,
            callee.label,
            callee.kind,
            callee.call,
            callee.template,
            bool_inputs,
            bool_outputs,
            len(bool_outputs),
            random=callee.random,
            clone_inputs=callee.clone_inputs,
            output_dtypes=list(output_dtypes),
            stored=stored,
        )
        _specs[name] = spec
    _, capi = _ort()
    capi.register_torch_autograd_function(name, _Registered)
    return spec


class _Registered(torch.autograd.Function):
    """What ORT's function pool stores per name (it insists on an autograd.Function); our
    runners ignore it and find the node's NodeSpec by name."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:  # pragma: no cover - never called by our runners
        raise RuntimeError("called outside ort_autopatch's runners")

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - never called by our runners
        raise RuntimeError("called outside ort_autopatch's runners")


# -- the context a forward hands to ORT and gets back in backward ------------------------------
class Context:
    """Holds one forward's torch graph until ORT's PythonOpGrad asks for gradients.

    ORT keeps one reference in its context pool (released after backward); `_live` keeps a
    second one, which `release` drops for forwards whose backward never comes.
    """

    __slots__ = ("__weakref__", "input_meta", "leaves", "outputs", "spec")

    def __init__(
        self,
        spec: NodeSpec,
        leaves: list[torch.Tensor | None],
        outputs: list[torch.Tensor],
        input_meta: list[tuple[torch.Size, torch.dtype, torch.device]],
    ) -> None:
        self.spec = spec
        self.leaves = leaves
        self.outputs = outputs
        self.input_meta = input_meta

    def clear(self) -> None:
        self.leaves = []
        self.outputs = []


_live: dict[int, Context] = {}
_live_lock = threading.Lock()
_errors = threading.local()


def take_error() -> BaseException | None:
    """The Python exception a runner hit in this thread (ORT only sees an empty result)."""
    error = getattr(_errors, "value", None)
    _errors.value = None
    return error


def peek_error() -> BaseException | None:
    return getattr(_errors, "value", None)


def live_contexts() -> int:
    return len(_live)


# -- forward and backward in Python -------------------------------------------------------------
def _from_capsule(capsule: Any, as_bool: bool) -> torch.Tensor:
    tensor = dlpack.from_dlpack(capsule)
    if as_bool and tensor.dtype is not torch.bool:
        tensor = tensor.view(torch.bool) if tensor.dtype is torch.uint8 else tensor.bool()
    return tensor


def _to_capsule(t: torch.Tensor, as_uint8: bool) -> Any:
    t = t.detach()
    if as_uint8 or t.dtype is torch.bool:
        t = t.to(torch.uint8)
    return dlpack.to_dlpack(dense(t))


def _fill(template: list[Any], feed: Any) -> list[Any]:
    """The template with every TENSOR (or scalar marker) replaced by `feed(marker)`."""
    values: list[Any] = []
    for item in template:
        if item is TENSOR or _is_marker(item):
            values.append(feed(item))
        elif isinstance(item, list) and any(i is TENSOR or _is_marker(i) for i in item):
            values.append(_fill(item, feed))
        else:
            values.append(item)
    return values


def _is_marker(item: Any) -> bool:
    return hasattr(item, "convert") and hasattr(item, "kind")


def run_forward(
    spec: NodeSpec, training: bool, requires_grad: Sequence[int], args: Sequence[Any]
) -> tuple[Any, list[Any]]:
    """Returns (context or None, DLPack capsules of the outputs)."""
    leaves: list[torch.Tensor | None] = []
    meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
    inputs: list[torch.Tensor] = []
    borrowed: set[int] = set()  # storages of ORT's buffers handed to this node
    position = iter(range(len(args)))
    clone = spec.clone_inputs and training

    def feed(marker: Any) -> Any:
        k = next(position)
        capsule = args[k]
        if capsule is None:
            leaves.append(None)
            meta.append((torch.Size(), torch.float32, torch.device("cpu")))
            return None
        tensor = _from_capsule(capsule, spec.bool_inputs[k])
        if tensor.numel():
            borrowed.add(tensor.untyped_storage().data_ptr())
        meta.append((tensor.shape, tensor.dtype, tensor.device))
        if marker is not TENSOR:
            leaves.append(None)
            return marker.convert(tensor)
        if training and requires_grad[k] and (tensor.is_floating_point() or tensor.is_complex()):
            leaf = tensor.detach().requires_grad_(True)
            leaves.append(leaf)
            tensor = leaf
        else:
            leaves.append(None)
        if clone:
            # A Function may write its inputs in place (mark_dirty); ORT's buffers must not
            # change, and autograd refuses in-place writes to leaves.
            with torch.enable_grad():
                tensor = tensor.clone()
        inputs.append(tensor)
        return tensor

    values = _fill(spec.template, feed)
    versions = [t._version for t in inputs]
    keep = _owned(borrowed) if training else contextlib.nullcontext()
    with torch.enable_grad() if training else torch.no_grad(), keep:
        if spec.random:
            result = _seeded(spec.call, values, inputs)
        else:
            result = spec.call(*values)
    if clone and all(t._version == v for t, v in zip(inputs, versions, strict=True)):
        spec.clone_inputs = False  # it never writes its inputs: no copies from now on
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    if spec.kind == "function" and len(outputs) == spec.num_outputs:
        # a Python number returned beside tensors was traced as a tensor (e.g. a size)
        outputs = [
            o if isinstance(o, torch.Tensor) else torch.as_tensor(o, dtype=dtype)
            for o, dtype in zip(outputs, spec.output_dtypes, strict=True)
        ]
    if len(outputs) != spec.num_outputs or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise RuntimeError(
            f"{spec.label} returned {len(outputs)} values, the graph expects "
            f"{spec.num_outputs} tensors"
        )
    storages = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    capsules = []
    for out, as_bool in zip(outputs, spec.bool_outputs, strict=True):
        handed = out.detach()
        if handed.numel() and handed.untyped_storage().data_ptr() in storages:
            handed = handed.clone()  # ORT may reuse an input's buffer once it is consumed
        capsules.append(_to_capsule(handed, as_bool))
    if not training:
        return None, capsules
    ctx = Context(spec, leaves, outputs, meta)
    with _live_lock:
        _live[id(ctx)] = ctx
    collected = getattr(_collecting, "contexts", None)
    if collected is not None:
        collected.append(ctx)
    return ctx, capsules


def _owned(borrowed: set[int]) -> Any:
    """Saved-tensor hooks that copy what backward keeps of ORT's input buffers.

    ORT hands a node its inputs without keeping them for the node's backward (PythonOpGrad
    reads only the context and the output gradients), so their memory is free to be reused
    once the forward moves on: nn.MultiheadAttention's gradients through a routed
    `scaled_dot_product_attention` came out NaN from q, k and v overwritten by then. A tensor
    autograd saves (the operator's own saves, a Function's `save_for_backward`) that lies in
    such a buffer is copied when saved; everything else is saved detached (see `pack`).
    """

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() and tensor.untyped_storage().data_ptr() in borrowed:
            return tensor.detach().clone()
        # detached: a saved output kept as itself holds its own grad_fn, a cycle through
        # C++ that Python's collector cannot see, so a forward whose backward never ran kept
        # its whole torch graph (a routed attention's weights: 1.1 MB a call)
        return tensor.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


_collecting = threading.local()


@contextlib.contextmanager
def collecting() -> Iterator[list[Context]]:
    """The contexts the torch-calling nodes of one ORT forward create in this thread; pass them
    to `release` when that forward's backward will never run."""
    previous = getattr(_collecting, "contexts", None)
    found: list[Context] = []
    _collecting.contexts = found
    try:
        yield found
    finally:
        _collecting.contexts = previous


def release(contexts: Sequence[Context]) -> None:
    """Free the torch graphs of forwards whose backward never ran (ORT keeps a tiny shell)."""
    with _live_lock:
        for ctx in contexts:
            _live.pop(id(ctx), None)
    for ctx in contexts:
        ctx.clear()


_seeds = threading.local()


@contextlib.contextmanager
def recorded_seeds(replay: list[int] | None = None) -> Iterator[list[int]]:
    """Record the seeds this thread's random nodes draw during one forward, or hand them the
    recorded ones again (a recomputed forward must make the same draws). Thread-local: other
    threads' calls keep drawing from the tool's stream."""
    outer = getattr(_seeds, "current", None)
    drawn: list[int] = []
    _seeds.current = (drawn, iter(replay) if replay is not None else None)
    try:
        yield drawn
    finally:
        _seeds.current = outer


def _next_seed() -> int:
    """A seed from the tool's own stream (`rng`): random ops in graphs are reproducible under
    `torch.manual_seed` and leave the user's stream alone."""
    current = getattr(_seeds, "current", None)
    again = current[1] if current is not None else None
    seed = next(again, None) if again is not None else None
    if seed is None:
        seed = rng.next_seed("torch")
    if current is not None:
        current[0].append(seed)
    return seed


def _seeded(call: Callable[..., Any], values: list[Any], inputs: list[torch.Tensor]) -> Any:
    """Run a random operator on a forked RNG seeded from the tool's generator."""
    seed = _next_seed()
    cuda = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        return call(*values)


def run_backward(ctx: Context, grads: Sequence[Any]) -> list[Any]:
    """Gradients for every tensor input of the forward (zeros where torch has none)."""
    with _live_lock:
        _live.pop(id(ctx), None)
    try:
        pairs = [
            (out, _from_capsule(g, False))
            for out, g in zip(ctx.outputs, grads, strict=False)
            if g is not None and isinstance(out, torch.Tensor) and out.requires_grad
        ]
        wanted = [leaf for leaf in ctx.leaves if leaf is not None]
        found: Sequence[torch.Tensor | None] = [None] * len(wanted)
        if pairs and wanted:
            outs, grad_outs = zip(*pairs, strict=True)
            found = torch.autograd.grad(
                outs, wanted, grad_outs, allow_unused=True, materialize_grads=False
            )
        by_leaf = iter(found)
        result: list[Any] = []
        for leaf, (shape, dtype, device) in zip(ctx.leaves, ctx.input_meta, strict=True):
            if leaf is None:
                result.append(None)
                continue
            grad = next(by_leaf)
            if grad is None:
                grad = torch.zeros(shape, dtype=dtype, device=device)
            result.append(_to_capsule(grad, False))
        return result
    finally:
        ctx.clear()


# -- the C++ calling convention, from ctypes ---------------------------------------------------
# std::vector<PyObject*> runner(const char* func_name, void* callback,
#     const std::vector<int64_t>& requires_grads, const std::vector<int64_t>& tensor_flags,
#     bool is_training_mode, const std::vector<int64_t>& inplace_map, const char* invoke_id,
#     bool safe_run_mode, const std::vector<PyObject*>& args)
# The vector is not trivially copyable, so the caller passes where to build it (first, hidden
# argument) and expects that address back.
_RUNNER = ctypes.CFUNCTYPE(
    ctypes.c_void_p,  # the sret pointer, returned
    ctypes.c_void_p,  # sret
    ctypes.c_char_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_bool,
    ctypes.c_void_p,
    ctypes.c_char_p,
    ctypes.c_bool,
    ctypes.c_void_p,
)
_WORD = ctypes.sizeof(ctypes.c_void_p)


def _vector_words(address: int, kind: Any = ctypes.c_int64) -> list[int]:
    begin = ctypes.c_size_t.from_address(address).value
    end = ctypes.c_size_t.from_address(address + _WORD).value
    count = (end - begin) // _WORD
    if count == 0:
        return []
    return list((kind * count).from_address(begin))


def _objects(address: int) -> list[Any]:
    return [
        ctypes.cast(ctypes.c_void_p(pointer), ctypes.py_object).value
        for pointer in _vector_words(address, ctypes.c_uint64)
    ]


_operator_new: Any = None
_incref = ctypes.pythonapi.Py_IncRef
_incref.argtypes = [ctypes.py_object]
_incref.restype = None


def _write_vector(sret: int, objects: Sequence[Any]) -> None:
    """Build std::vector<PyObject*> at `sret`, each element owning one reference."""
    words = ctypes.c_size_t * 3
    header = words.from_address(sret)
    if not objects:
        header[0] = header[1] = header[2] = 0
        return
    size = len(objects) * _WORD
    data = _operator_new(size)
    array = (ctypes.c_void_p * len(objects)).from_address(data)
    for k, obj in enumerate(objects):
        _incref(obj)
        array[k] = id(obj)
    header[0] = data
    header[1] = header[2] = data + size


def _runner(forward: bool) -> Any:
    def run(
        sret: int,
        func_name: bytes,
        callback: int,
        requires_grads: int,
        tensor_flags: int,
        training: bool,
        inplace_map: int,
        invoke_id: bytes,
        safe_run: bool,
        args: int,
    ) -> int:
        results: list[Any] = []
        try:
            name = func_name.decode()
            spec = _specs.get(name)
            if spec is None:
                raise RuntimeError(f"no torch-calling node named {name!r} in this process")
            values = _objects(args)
            if forward:
                flags = _vector_words(requires_grads)
                ctx, capsules = run_forward(spec, bool(training), flags, values)
                results = [ctx, *capsules]
            else:
                ctx = values[0]
                results = run_backward(ctx, values[1:])
        except BaseException as exc:
            _errors.value = exc
            log.debug("torch-calling node failed", exc_info=True)
            results = []  # ORT then fails the run with its own message
        _write_vector(sret, results)
        return sret

    return _RUNNER(run)


_runners: tuple[Any, Any] | None = None


def _ort() -> tuple[Any, Any]:
    from ort_autopatch.engine import runtime

    return runtime.load()


def ensure_runners() -> None:
    """Hand ORT our forward and backward runners, once per process."""
    global _runners, _operator_new
    if _runners is not None:
        return
    with _lock:
        if _runners is not None:
            return
        reason = supported_platform()
        if reason is not None:
            raise RuntimeError(reason)
        _, capi = _ort()
        libstdcxx = ctypes.CDLL("libstdc++.so.6")
        new = libstdcxx._Znwm  # operator new(size_t): what ORT's vector destructor frees
        new.argtypes = [ctypes.c_size_t]
        new.restype = ctypes.c_void_p
        _operator_new = new
        forward, backward = _runner(True), _runner(False)
        capi.register_forward_runner(ctypes.cast(forward, ctypes.c_void_p).value)
        capi.register_backward_runner(ctypes.cast(backward, ctypes.c_void_p).value)
        _runners = (forward, backward)  # the callbacks must outlive every session
        # ORT's function pool holds Python objects in C++ statics; released after the
        # interpreter is gone they crash the process at exit. Release them while it lives.
        atexit.register(capi.unregister_python_functions)


@dataclass
class NodeRecord:
    """One torch-calling node in a graph, for reports."""

    name: str
    label: str
    kind: str


def _func_name(node: Any) -> str:
    return next((a.s.decode() for a in node.attribute if a.name == "func_name"), "")


def _python_op_names(model: Any) -> list[str]:
    """The registered names the PythonOp nodes of an ONNX model call."""
    return [_func_name(n) for n in model.graph.node if n.op_type == OP_TYPE and n.domain == DOMAIN]


def nodes_in(model: Any) -> list[NodeRecord]:
    """The torch-calling nodes of an ONNX model (forward nodes only), `ATen` nodes included."""
    found = []
    for node in model.graph.node:
        if node.op_type == OP_TYPE and node.domain == DOMAIN:
            name = _func_name(node)
            spec = _specs.get(name)
            if spec is not None:
                found.append(NodeRecord(name, spec.label, spec.kind))
        elif node.op_type == aten_executor.OP_TYPE and node.domain == aten_executor.DOMAIN:
            operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), "")
            found.append(NodeRecord(node.name, operator, "aten"))
    return found


def described_only(model: Any) -> bool:
    """Whether every PythonOp node of `model` is named by what it calls (`NodeSpec.stored`):
    the same name in every process (ATen executor nodes name their operator anyway)."""
    return all(
        spec is not None and spec.stored is not None
        for spec in map(_specs.get, _python_op_names(model))
    )


@dataclass
class Inventory:
    """How many nodes of a graph run through torch, by label."""

    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, model: Any) -> Inventory:
        counts: dict[str, int] = {}
        for record in nodes_in(model):
            counts[record.label] = counts.get(record.label, 0) + 1
        return cls(counts)


def restore(name: str, node: dict[str, Any]) -> None:
    """Register a stored node (`NodeSpec.stored`) under `name`, unless this process has
    it (`new_spec` derives the same name from the same description). Raises ValueError
    where this torch lacks its operator or the description is of another format or another
    node: the caller then builds the graph again."""
    if name in _specs:
        return
    if node.get("format") != stored.FORMAT:
        raise ValueError(f"a torch-calling node stored in format {node.get('format')!r}")
    try:
        overload = stored.overload(str(node["operator"]))
    except AttributeError as exc:
        raise ValueError(f"this torch has no {node['operator']}") from exc
    described = {k: node[k] for k in stored.DESCRIBED}
    callee = Callee(
        str(node["label"]),
        "aten",
        stored.aten_call(overload, list(node["names"])),
        stored.decode(node["template"]),
        random=bool(node["random"]),
        clone_inputs=bool(node["clone_inputs"]),
        described=described,
    )
    new_spec(
        callee,
        [bool(b) for b in node["bool_inputs"]],
        [bool(b) for b in node["bool_outputs"]],
        [stored.decode({"dtype": d}) for d in node["output_dtypes"]],
    )
    if name not in _specs:
        raise ValueError(f"the stored node {name} describes another node")


def stored_nodes(model: Any) -> dict[str, dict[str, Any]] | None:
    """Each torch-calling node of `model` (an ONNX ModelProto) by name, as `restore` takes it;
    None when one has no description (a custom Function's) or is an ATen executor node."""
    found: dict[str, dict[str, Any]] = {}
    for record in nodes_in(model):
        found_spec = _specs.get(record.name)
        if found_spec is None or found_spec.stored is None:
            return None
        found[record.name] = found_spec.stored
    return found
