"""Turning an exported graph into something ONNX Runtime can run: a gradient graph and a
TrainingAgent for training calls, a plain InferenceSession for calls that need no gradients."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine import rng, runtime, sandbox
from ort_autopatch.engine.errors import (
    GradientBuildError,
    RuntimeUnavailableError,
    SessionError,
    UnsupportedDeviceError,
    UnsupportedInputError,
)

log = logging.getLogger("ort_autopatch")


@dataclass(frozen=True)
class SessionSettings:
    """How sessions are created; threads None means torch.get_num_threads().

    The defaults are what measured fastest for training steps interleaved with PyTorch
    (`benchmarks/bench_profile.py` measures each alternative); the other fields exist so that
    benchmark can build the alternatives, and for profiling.
    """

    threads: int | None = None
    spinning: bool = False  # intra-op threads spin between ORT's parallel sections
    parallel: bool = False  # ORT_PARALLEL execution mode (independent nodes concurrently)
    optimization: str = "all"  # graph optimisation level: disable, basic, extended, all
    arena: bool = False  # allocate CPU memory from the process's shared arena (`shared_arena`)
    profile_prefix: str | None = None  # write ORT's per-node profile (JSON) with this prefix


_live: weakref.WeakSet[Any] = weakref.WeakSet()


def live_sessions() -> int:
    """ONNX Runtime sessions this process still holds (for leak checks and reports)."""
    return len(_live)


def end_profiles() -> list[str]:
    """Stop ORT's profiler in every live session built with `profile_prefix`; the JSON files
    (a session whose profile was ended before writes none: ORT answers an empty name)."""
    ended = (s.end_profiling() for s in list(_live) if s.get_session_options().enable_profiling)
    return [path for path in ended if path]


def _session_options(settings: SessionSettings, training: bool) -> Any:
    ort, _ = runtime.load(training=False)
    options = ort.SessionOptions()
    if training:
        # Forward outputs handed to PyTorch live in ORT's buffers; with memory reuse on, the
        # backward pass would overwrite a loss or logits the user still holds.
        options.enable_mem_pattern = False
        options.enable_mem_reuse = False
    # A session's own CPU arena never gives memory back: tensors handed to PyTorch return to
    # it when PyTorch frees them, and with inputs of varying size it grows step after step (3
    # GiB a step with 1 GiB inputs). Plain allocations are freed when the step's tensors are;
    # graphs that serve one input shape use the shared arena instead (`shared_arena`).
    options.enable_cpu_mem_arena = False
    # Same seed, same numbers: ORT's kernels take their deterministic path, whatever
    # torch.use_deterministic_algorithms says (PyTorch's CPU kernels already are).
    options.use_deterministic_compute = True
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.intra_op_num_threads = settings.threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 4  # errors reach users through the tool's messages
    # Spinning threads would burn the cores PyTorch needs between ORT calls.
    spin = "1" if settings.spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    if settings.parallel:
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        options.inter_op_num_threads = options.intra_op_num_threads
    options.graph_optimization_level = _OPTIMIZATION_LEVELS[settings.optimization](ort)
    if settings.profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = settings.profile_prefix
    return options


_arena_lock = threading.Lock()
_arena: bool | None = None
_SAME_AS_REQUESTED = 1  # OrtArenaCfg's arena_extend_strategy: extend by the request's size


def shared_arena() -> bool:
    """Register, once per process, the CPU arena that sessions built with `arena` share;
    False when ONNX Runtime refuses it (those sessions then allocate plainly).

    Why: freed plainly, a step's buffers go back to glibc, which returns the top of its heap
    to the system, so the next step page-faults every buffer in again (about 2,000 faults, 6
    ms of a 70 ms nanoGPT step here). An arena keeps them for the next step. It is one arena
    for all such sessions, so it holds the largest set of buffers alive at once, not a sum
    over graphs; it keeps that memory for the process's lifetime, and extends by exactly
    what is requested (not ORT's default doubling). Only graphs that serve one input shape
    use it: their steps request the same sizes each time, which an arena reuses exactly.
    """
    global _arena
    with _arena_lock:
        if _arena is None:
            ort, _ = runtime.load(training=False)
            info = ort.OrtMemoryInfo(
                "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            try:
                ort.create_and_register_allocator(
                    info, ort.OrtArenaCfg({"arena_extend_strategy": _SAME_AS_REQUESTED})
                )
                _arena = True
            except Exception as exc:  # one registered already (by the user's own code)
                log.debug("no shared CPU arena: %s", ort_message(exc))
                _arena = False
        return _arena


_OPTIMIZATION_LEVELS: dict[str, Callable[[Any], Any]] = {
    "disable": lambda ort: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": lambda ort: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": lambda ort: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": lambda ort: ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def _providers(device: torch.device, stream: Any = None) -> list[Any]:
    ort, _ = runtime.load(training=False)
    available = ort.get_available_providers()
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in available:
        cuda: dict[str, Any] = {"device_id": device.index or 0}
        if stream is not None:
            cuda["user_compute_stream"] = str(stream.cuda_stream)
        return [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    raise UnsupportedDeviceError(
        "",
        f"tensors on {device} but this onnxruntime build offers only {', '.join(available)}",
        "Install onnxruntime-training (the CUDA build) for GPU tensors, or run on CPU",
    )


_NVIDIA = 0x10DE  # the PCI vendor id ONNX Runtime's CUDA allocators are keyed by


def ort_device(device: torch.device) -> Any:
    """ORT's name for `device`: where a run puts its outputs (fetch devices).

    ONNX Runtime 1.2x keys its allocators by vendor as well (its own `OrtDevice.make("cuda")`
    passes NVIDIA's id); a CUDA device without it names no allocator of the CUDA provider. The
    training build's 1.19.2 has no vendor argument."""
    _, capi = runtime.load(training=False)
    memory, index = capi.OrtDevice.default_memory(), device.index or 0
    if device.type != "cuda":
        return capi.OrtDevice(capi.OrtDevice.cpu(), memory, index)
    try:
        return capi.OrtDevice(capi.OrtDevice.cuda(), memory, _NVIDIA, index)
    except TypeError:  # 1.19.2: (type, memory, index) only
        return capi.OrtDevice(capi.OrtDevice.cuda(), memory, index)


def compute_stream(device: torch.device) -> Any:
    """The CUDA stream a session on `device` runs on (None on CPU).

    ORT 1.19.2 runs CUDA kernels on a stream of its own, created non-blocking, so it never
    waits for PyTorch's default stream; it synchronises that stream only at the end of a run.
    A torch-calling node inside the graph would then launch torch kernels on PyTorch's current
    stream, unordered with the ORT kernels that produce its inputs and read its outputs. So
    each session gets a dedicated torch stream as ORT's `user_compute_stream` (torch's default
    stream has the handle 0, which ORT reads as "none"), every run makes it wait for the
    caller's current stream, runs with it as torch's current stream (torch-calling nodes launch
    on it, in order with ORT's kernels) and makes the caller's stream wait for it afterwards
    (`bridge.on_stream`).
    """
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def _session(
    model_bytes: bytes,
    device: torch.device,
    settings: SessionSettings,
    cls: str,
    training: bool,
    optimized: bool = False,
    capture: bool = False,
    stream: Any = None,
    disabled_optimizers: Sequence[str] = (),
) -> tuple[Any, bytes | None]:
    """A session, and with `capture` ORT's optimised form of the graph.

    Graph optimisation is most of a session's start-up (30 ms of 35 ms for a transformer
    layer); a graph optimised before (`optimized`) starts with optimisation off. The optimised
    form is specific to this machine's CPU features, which the persistent cache key covers.
    """
    ort, _ = runtime.load(training=False)
    providers = _providers(device, stream)
    options = _session_options(settings, training)
    if settings.arena and device.type == "cpu" and shared_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    if optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with contextlib.ExitStack() as stack:
        target = None
        if capture:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ort_autopatch-"))
            target = os.path.join(folder, "optimized.onnx")
            options.optimized_model_filepath = target
        # Random kernels other than dropout seed their generator as the session starts.
        rng.seed_runtime(runtime.capi(), "session")
        try:
            session = ort.InferenceSession(
                model_bytes, options, providers, disabled_optimizers=list(disabled_optimizers)
            )
        except Exception as exc:
            raise SessionError(
                cls,
                f"ONNX Runtime rejected the graph: {ort_message(exc)}",
                "Run this class eagerly (the default fallback policy does) and report the model",
            ) from exc
        _live.add(session)
        captured = None
        if target is not None and os.path.exists(target):
            with open(target, "rb") as handle:
                captured = handle.read()
    return session, captured


@dataclass
class InferenceProgram:
    """Forward only: eval mode, or train mode with gradients off."""

    session: Any
    feed_names: list[str]
    fetch_names: list[str]
    fetch_devices: list[Any]
    run_options: Any = field(default=None)
    optimized: bytes | None = None  # ORT's optimised graph, when asked to capture it
    stream: Any = None  # the CUDA stream the session runs on (`compute_stream`), None on CPU


def build_inference(
    model_bytes: bytes,
    device: torch.device,
    settings: SessionSettings,
    cls: str,
    optimized: bool = False,
    capture: bool = False,
) -> InferenceProgram:
    import onnx

    _, capi = runtime.load(training=False)
    graph = onnx.load_from_string(model_bytes).graph
    stream = compute_stream(device)
    session, captured = _session(
        model_bytes, device, settings, cls, False, optimized, capture, stream
    )
    feeds = [i.name for i in session.get_inputs()]
    fetches = [o.name for o in graph.output]
    return InferenceProgram(
        session=session,
        feed_names=feeds,
        fetch_names=fetches,
        fetch_devices=[ort_device(device)] * len(fetches),
        run_options=capi.RunOptions(),
        optimized=captured,
        stream=stream,
    )


@dataclass
class GradientGraph:
    """A built gradient graph and what its agent needs to know: plain data, so the persistent
    cache can store it as ONNX bytes plus JSON."""

    model: bytes
    num_forward_outputs: int  # user outputs + extra (BatchNorm) outputs handed out by the YieldOp
    num_outputs: int  # user outputs
    non_differentiable: list[int]
    full_shape_grads: list[int]
    grad_of: dict[str, str]  # feed name -> its gradient's name


@dataclass
class TrainingProgram:
    """Forward and backward through a TrainingAgent over the gradient graph."""

    agent: Any
    session: Any  # kept alive with the agent, which borrows it
    feed_names: list[str]
    num_outputs: int
    non_differentiable: frozenset[int]
    full_shape_grads: frozenset[int]
    # for each feed, the index of its gradient among backward outputs, or -1
    grad_index: list[int]
    # feeds and user outputs whose buffers the backward pass reads (directly or through an
    # aliasing view): autograd checks their versions as it checks eager's saved tensors
    backward_reads_feeds: tuple[int, ...] = ()
    backward_reads_outputs: tuple[int, ...] = ()
    optimized: bytes | None = None  # ORT's optimised graph, when asked to capture it
    stream: Any = None  # the CUDA stream the session runs on (`compute_stream`), None on CPU
    # the graph has PythonOp nodes (whose contexts a forward collects); ATen nodes keep none
    python_nodes: bool = False


def build_gradient(
    model_bytes: bytes,
    *,
    feed_names: Sequence[str],
    trainable: Sequence[str],
    inputs_requiring_grad: Sequence[str],
    user_inputs: Sequence[str],
    extra_outputs: Sequence[str],
    cls: str,
    propagate_casts: bool = True,
    meanwhile: Callable[[], None] | None = None,
    while_waiting: Callable[[], bool] | None = None,
) -> GradientGraph:
    """Differentiate the exported graph with ORT's OrtModuleGraphBuilder.

    `extra_outputs` are graph outputs (BatchNorm statistics) returned by forward after the user
    outputs but kept out of differentiation (the gradient passes, `passes.GRADIENT`, hand them
    out of the gradient graph). `propagate_casts` lets ORT move and merge Casts (ORTModule's
    default); a graph traced under autocast keeps its casts as traced.
    `meanwhile()`, then `while_waiting()` until the child answers, run in this process while
    the forked child builds (`sandbox.run`). ONNX
    Runtime is imported here first, so the child inherits it instead of importing it again.
    """
    import onnx

    model = onnx.load_from_string(model_bytes)
    _refuse_dtypes(model, cls)
    if extra_outputs:
        kept = [o for o in model.graph.output if o.name not in set(extra_outputs)]
        del model.graph.output[:]
        model.graph.output.extend(kept)
        model_bytes = model.SerializeToString()

    build = _Differentiation(
        model_bytes,
        [n for n in feed_names if n not in set(user_inputs)],
        [n for n in trainable if n not in set(user_inputs)],
        list(inputs_requiring_grad),
        propagate_casts,
    )

    remedy = (
        "An operator has no gradient in ONNX Runtime 1.19.2; run this class eagerly "
        "(the default fallback policy does) or exclude it"
    )
    try:
        # In a forked child: ORT's gradient builder aborts the process on some graphs
        # (`torch.diagonal`'s export: a failed libstdc++ assertion), which no fallback catches.
        runtime.load()  # raises RuntimeUnavailableError with its reason, before forking
        gradient_model, info = sandbox.run(build, meanwhile=meanwhile, while_waiting=while_waiting)
    except RuntimeUnavailableError:
        raise
    except sandbox.Crashed as exc:
        raise GradientBuildError(
            cls,
            f"ONNX Runtime's gradient builder crashed on this graph ({exc})",
            "Run this class eagerly (the default fallback policy does) and report the model",
        ) from None
    except sandbox.ChildError as exc:
        raise GradientBuildError(cls, f"no gradient graph ({ort_message(exc)})", remedy) from None
    except Exception as exc:
        raise GradientBuildError(cls, f"no gradient graph ({ort_message(exc)})", remedy) from exc
    num_forward_outputs = len(info.user_output_names) + len(info.frontier_node_arg_map)
    grad_of = dict(info.user_input_grad_names)
    grad_of.update(
        zip(info.initializer_names_to_train, info.initializer_grad_names_to_train, strict=True)
    )
    return GradientGraph(
        model=gradient_model,
        num_forward_outputs=num_forward_outputs,
        num_outputs=len(info.user_output_names),
        non_differentiable=list(info.output_grad_indices_non_differentiable),
        full_shape_grads=list(info.output_grad_indices_require_full_shape),
        grad_of=grad_of,
    )


@dataclass(frozen=True)
class _Differentiation:
    """One call of ORT's gradient builder, as plain data (run in a forked child)."""

    model_bytes: bytes
    initializer_names: list[str]
    initializer_names_to_train: list[str]
    input_names_require_grad: list[str]
    propagate_casts: bool

    def __call__(self) -> tuple[bytes, _GraphInfo]:
        _, capi = runtime.load()
        config = capi.OrtModuleGraphBuilderConfiguration()
        config.initializer_names = self.initializer_names
        config.initializer_names_to_train = self.initializer_names_to_train
        config.input_names_require_grad = self.input_names_require_grad
        config.build_gradient_graph = True
        config.enable_caching = False
        config.use_memory_efficient_gradient = False
        config.loglevel = capi.Severity.FATAL
        transformer = capi.TrainingGraphTransformerConfiguration()
        cast = capi.PropagateCastOpsConfiguration()
        cast.level = 1
        cast.strategy = capi.PropagateCastOpsStrategy.FLOOD_FILL
        if self.propagate_casts:
            transformer.propagate_cast_ops_config = cast
        transformer.enable_compute_optimizer = True
        builder = capi.OrtModuleGraphBuilder()
        builder.initialize(self.model_bytes, config)
        builder.build(transformer)
        return builder.get_gradient_model(), _GraphInfo.of(builder.get_graph_info())


@dataclass
class _GraphInfo:
    """The part of ORT's graph info the engine uses, as plain data (it crosses a pipe)."""

    user_output_names: list[str]
    frontier_node_arg_map: dict[str, str]
    user_input_grad_names: dict[str, str]
    initializer_names_to_train: list[str]
    initializer_grad_names_to_train: list[str]
    output_grad_indices_non_differentiable: list[int]
    output_grad_indices_require_full_shape: list[int]

    @classmethod
    def of(cls, info: Any) -> _GraphInfo:
        return cls(
            list(info.user_output_names),
            dict(info.frontier_node_arg_map),
            dict(info.user_input_grad_names),
            list(info.initializer_names_to_train),
            list(info.initializer_grad_names_to_train),
            list(info.output_grad_indices_non_differentiable),
            list(info.output_grad_indices_require_full_shape),
        )


#: ONNX element types ORT 1.19.2 has too few gradient kernels for: double (SplitTraining,
#: ReluGrad, ... fail at the first backward) and the complex types.
_UNTRAINABLE_TYPES = {11: "float64", 14: "complex64", 15: "complex128"}


def _refuse_dtypes(model: Any, cls: str) -> None:
    """Refuse, before any build, a training graph whose parameters, inputs or outputs have a
    dtype ORT cannot differentiate. Internal float64 scalars (transformers' attention scaling
    constants) and inputs only cast to float32 are fine."""
    found: dict[str, list[str]] = {}
    consumers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def cast_away(value: str) -> bool:
        """Only cast to a trainable type (a float32 model fed float64 inputs)."""
        return all(
            n.op_type == "Cast" and not any(a.i in _UNTRAINABLE_TYPES for a in n.attribute)
            for n in consumers.get(value, [])
        )

    inputs = [v for v in model.graph.input if not cast_away(v.name)]
    for value in [*inputs, *model.graph.output]:
        name = _UNTRAINABLE_TYPES.get(value.type.tensor_type.elem_type)
        if name is not None:
            found.setdefault(name, []).append(value.name)
    if found:
        raise untrainable(cls, found)


def untrainable(cls: str, found: dict[str, list[str]]) -> UnsupportedInputError:
    """The refusal of a training build with dtypes ORT cannot differentiate (`found`: dtype ->
    the names that have it), whether found in the exported graph or before exporting."""
    what = "; ".join(
        f"{dtype} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
        for dtype, names in found.items()
    )
    return UnsupportedInputError(
        cls,
        f"training with {what}: ONNX Runtime 1.19.2 lacks {'/'.join(found)} gradient "
        "kernels for common operators (Concat's SplitTraining, ReluGrad)",
        "Train in float32, or keep the default fallback policy (PyTorch runs this dtype)",
    )


def build_training(
    gradient: GradientGraph,
    device: torch.device,
    settings: SessionSettings,
    cls: str,
    optimized: bytes | None = None,
    capture: bool = False,
) -> TrainingProgram:
    """A session and a TrainingAgent over a gradient graph (or ORT's optimised form of it)."""
    import onnx

    _, capi = runtime.load()
    model = optimized or gradient.model
    proto = onnx.load_from_string(model)
    stream = compute_stream(device)
    session, captured = _session(
        model, device, settings, cls, True, optimized is not None, capture, stream
    )
    fw_feeds = [i.name for i in proto.graph.input]
    bw_fetches = [o.name for o in proto.graph.output]
    dev = ort_device(device)
    try:
        agent = capi.TrainingAgent(
            session._sess,
            fw_feeds,
            [dev] * gradient.num_forward_outputs,
            bw_fetches,
            [dev] * len(bw_fetches),
            0,
        )
    except Exception as exc:
        raise SessionError(
            cls, f"TrainingAgent failed: {ort_message(exc)}", "Report the model"
        ) from exc
    position = {name: k for k, name in enumerate(bw_fetches)}
    grad_index = [position.get(gradient.grad_of.get(name, ""), -1) for name in fw_feeds]
    read = backward_reads(proto.graph)
    yielded = next((list(n.input) for n in proto.graph.node if n.op_type == "YieldOp"), [])
    return TrainingProgram(
        agent=agent,
        session=session,
        feed_names=fw_feeds,
        num_outputs=gradient.num_outputs,
        non_differentiable=frozenset(gradient.non_differentiable),
        full_shape_grads=frozenset(gradient.full_shape_grads),
        grad_index=grad_index,
        backward_reads_feeds=tuple(k for k, name in enumerate(fw_feeds) if read(name)),
        backward_reads_outputs=tuple(
            k for k, name in enumerate(yielded[: gradient.num_outputs]) if read(name)
        ),
        optimized=captured,
        stream=stream,
        python_nodes=any(n.op_type == "PythonOp" for n in proto.graph.node),
    )


#: Operators whose output ONNX Runtime's CPU kernels may place in their input's buffer.
_ALIASING_OPS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def backward_reads(graph: Any) -> Callable[[str], bool]:
    """Whether the backward half of a gradient graph reads a value's buffer.

    The forward half is every node the `YieldOp` depends on; every other node runs in
    backward. A value counts as read when it, or a value sharing its buffer through an
    aliasing operator, is an input of a backward node.
    """
    from ort_autopatch.engine.backends.ort_training.graph import node_reads

    nodes = list(graph.node)
    producer = {out: k for k, node in enumerate(nodes) for out in node.output}
    yield_at = next((k for k, n in enumerate(nodes) if n.op_type == "YieldOp"), None)
    if yield_at is None:
        return lambda name: False
    forward: set[int] = set()
    pending = list(nodes[yield_at].input)
    while pending:
        k = producer.get(pending.pop(), -1)
        if k >= 0 and k not in forward:
            forward.add(k)
            pending.extend(node_reads(nodes[k]))
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    for node in nodes:
        if node.op_type in _ALIASING_OPS and node.input and node.output:
            parent[root(node.output[0])] = root(node.input[0])
    read = {
        root(name)
        for k, node in enumerate(nodes)
        if k != yield_at and k not in forward
        for name in node_reads(node)
    }
    return lambda name: root(name) in read


def ort_message(exc: BaseException) -> str:
    """ORT's message without its C++ source location and signature noise."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    missing = re.search(r"gradient builder has not been registered: (\S+) for node (\S+)", text)
    if missing:
        return f"ONNX Runtime has no gradient for operator {missing[1]} (node {missing[2]})"
    if " was false. " in text:
        text = text.split(" was false. ", 1)[1]
    text = re.sub(r"/onnxruntime_src/\S+:\d+ ", "", text)
    return (text or type(exc).__name__)[:400]
