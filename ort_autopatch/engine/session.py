"""ONNX Runtime sessions as every backend makes them: options (threads, spinning, arena,
determinism), providers and devices, the CUDA stream a session runs on, the shared CPU arena,
and ORT's error messages made readable. What a backend builds on top (a TrainingAgent, a pair
of inference sessions) lives in its own package."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ort_autopatch.engine import dlpack, heap, rng, runtime
from ort_autopatch.engine.errors import (
    ExecutionError,
    SessionError,
    UnsupportedDeviceError,
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


#: ORT's constant folding turns a node that reads only constants into an initializer the session
#: keeps for its lifetime. A gradient scattered into zeros (an embedding's, GPT-2 small's of
#: 147 MiB) became a 147 MiB initializer held beside every step, and each run copied it. Above
#: this size a constant is made when the graph runs (a fill, into a buffer the heap keeps):
#: masks and shapes stay folded. onnxruntime 1.19.2 (the training build) has no such limit.
FOLDING_LIMIT = 1 << 20
FOLDING_LIMIT_KEY = "optimization.constant_folding_max_output_size_in_bytes"

_live: weakref.WeakSet[Any] = weakref.WeakSet()
#: sessions of graphs built for one input shape, on CPU where the heap keeps freed buffers:
#: their runs take every block from the heap (`run_scope`)
_heap_served: weakref.WeakSet[Any] = weakref.WeakSet()


def run_scope(session: Any) -> contextlib.AbstractContextManager[Any]:
    """What each run of `session` runs inside (`heap.WHOLE_HEAP` for a graph built for one
    input shape, where glibc keeps freed buffers: its large buffers stay for its next run)."""
    return heap.run_scope() if session in _heap_served else heap.NO_SCOPE


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
    # GiB a step with 1 GiB inputs). Plain allocations are freed when the step's tensors are,
    # into a heap that keeps them for the next step (`heap.keep_freed_memory`, set by the
    # first graph that serves one input shape); without glibc such graphs use the shared
    # arena instead (`shared_arena`).
    options.enable_cpu_mem_arena = False
    # Same seed, same numbers: ORT's kernels take their deterministic path, whatever
    # torch.use_deterministic_algorithms says (PyTorch's CPU kernels already are).
    options.use_deterministic_compute = True
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.add_session_config_entry(FOLDING_LIMIT_KEY, str(FOLDING_LIMIT))
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
    """Register, once per process, the CPU arena that sessions built with `arena` share where
    the process's heap cannot keep freed buffers (`heap.keep_freed_memory`: a C library other
    than glibc); False when ONNX Runtime refuses it (those sessions then allocate plainly).

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
        runtime.gpu_remedy(),
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
    (`dlpack.on_stream`).
    """
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def create(
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
    from_heap = settings.arena and device.type == "cpu" and heap.keep_freed_memory()
    if settings.arena and device.type == "cpu" and not from_heap and shared_arena():
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
        if from_heap:
            _heap_served.add(session)
        captured = None
        if target is not None and os.path.exists(target):
            with open(target, "rb") as handle:
                captured = handle.read()
    return session, captured


_Runnable = TypeVar("_Runnable", bound="RunnableSession")


@dataclass
class RunnableSession:
    """A session with everything one run passes it: what every backend's graph runs through."""

    session: Any
    feed_names: list[str]
    fetch_names: list[str]
    fetch_devices: list[Any]
    run_options: Any
    #: ORT's OrtValueVector type, for each run's fetches (read once: every call runs this)
    new_vector: Any
    stream: Any = None  # the CUDA stream the session runs on (`compute_stream`), None on CPU
    #: what each run runs inside (`run_scope`)
    scope: contextlib.AbstractContextManager[Any] = heap.NO_SCOPE

    @classmethod
    def of(
        cls: type[_Runnable],
        session: Any,
        device: torch.device,
        stream: Any,
        fetch_names: list[str] | None = None,
    ) -> _Runnable:
        """`session`'s inputs in its own order, and `fetch_names` (default: its outputs)."""
        fetches = fetch_names or [o.name for o in session.get_outputs()]
        return cls(
            session=session,
            feed_names=[i.name for i in session.get_inputs()],
            fetch_names=fetches,
            fetch_devices=[ort_device(device)] * len(fetches),
            run_options=runtime.capi().RunOptions(),
            stream=stream,
            new_vector=runtime.capi().OrtValueVector,
            scope=run_scope(session),
        )

    def run(
        self, feeds: Sequence[torch.Tensor], kept: dlpack.KeptValues | None = None
    ) -> list[torch.Tensor]:
        """The fetches of one run over `feeds` (ORT's own exception on failure: the caller
        names the phase, `execution_error`)."""
        fetches = self.new_vector()
        with self.scope, dlpack.on_stream(self.stream) as caller:  # no-ops on CUDA
            self.session._sess.run_with_ortvaluevector(
                self.run_options,
                self.feed_names,
                dlpack.push(feeds, kept),
                self.fetch_names,
                fetches,
                self.fetch_devices,
            )
        return dlpack.pull(fetches, caller)


def execution_error(
    module_class: str, phase: str, exc: BaseException, inner: BaseException | None = None
) -> ExecutionError:
    """The error a failed run raises, for every backend: ORT's message, or the Python error
    a torch-calling node hit (`inner`: ORT only saw its result). An `ExecutionError` already
    (a segment of a cut graph, `backends/ort/torch_nodes`, named its own failure) stands as
    it is: wrapped again, its message said the class and the phase twice."""
    if isinstance(exc, ExecutionError):
        return exc
    cause = (
        f"a torch-calling node failed in {phase}: {type(inner).__name__}: {inner}"
        if inner is not None
        else f"ONNX Runtime {phase} failed: {ort_message(exc)}"
    )
    remedy = (
        "Its forward ran in ONNX Runtime, so this backward cannot run in PyTorch instead; the "
        "class's later training calls run in PyTorch. Exclude the class "
        "(ORT_AUTOPATCH_EXCLUDE) to run it in PyTorch from the start, and report the model"
        if phase == "backward"
        else "Run eagerly"
    )
    return ExecutionError(module_class, cause, remedy)


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
