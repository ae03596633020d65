"""Exporting one call of a module to an ONNX graph, without leaving a trace on the module.

The module is wrapped so that the exported graph takes a flat tuple of tensors (user inputs,
then parameters and buffers as graph inputs fed by reference) and returns a flat tuple of
tensors. Non-tensor leaves of the inputs are baked into the graph and belong to the cache key.

Global effect: for the length of an export, process-wide state is rebound, all of it under the
one `EXPORT_LOCK`, so exports in several threads run one after the other and every rebinding is
undone in the order it was made: torch's ONNX symbolic registry (`symbolics.registered`),
`torch.onnx`'s `setup_onnx_logging` (`_quiet_exporter`), file descriptor 2 (`chatter`), the
exporter's `_run_symbolic_function` (`_watching_conversions`), `CheckpointFunction.apply`,
transformers' mask helpers and torch's attention fast-path switch (`tracing.export_rewrites`),
and the `__class__` of the exported
module's objects while their attribute reads are recorded (`ort_autopatch.recording`), and the
trace-hazard recorders (`hazards.recording`: torch.Tensor's conversions to Python values,
`split`/`unbind`/iteration, and the exporter's `_optimize_graph`, which strips traced sizes).
Calls made
in other threads meanwhile see those rebindings; patched calls in this thread step aside
(`is_exporting`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine import budget, calls, chatter, hazards
from ort_autopatch.engine.calls import EXPORT_LOCK, BufferUpdates, CallSpec, OutputSpec
from ort_autopatch.engine.errors import (
    BuildOverBudget,
    ExportError,
    InputWriteError,
    OutputAliasError,
    UnsupportedModelError,
)

log = logging.getLogger("ort_autopatch")


class _OutputIdentity(torch.autograd.Function):
    """Marks each graph output with an Identity node.

    Without it an input returned unchanged would be both a graph input and a graph output,
    which ONNX Runtime's gradient builder rejects.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad

    @staticmethod
    def symbolic(g: Any, x: Any) -> Any:
        return g.op("Identity", x)


def _storage(t: torch.Tensor) -> int:
    """Where a tensor's memory starts; 0 for one without storage of its own (a functorch
    wrapper: the transform's own path takes such a call)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (NotImplementedError, RuntimeError):
        return 0


class _FlatModule(torch.nn.Module):
    """Takes and returns flat tensor tuples around the user's module (registered as `m`)."""

    def __init__(
        self, module: torch.nn.Module, forward: Callable[..., Any], call_spec: CallSpec
    ) -> None:
        super().__init__()
        self.m = module
        self._forward = forward
        self._call_spec = call_spec
        self.output_spec: OutputSpec | None = None
        self.checks: list[hazards.Check] = []
        self.with_checks = True  # a static export has nothing to check

    def _refuse_what_a_graph_gets_wrong(
        self, result: Any, inputs: list[tuple[torch.Tensor, int]]
    ) -> None:
        """The training build's graph takes its inputs by value and returns fresh tensors.
        A write into an input would never reach the caller's tensor, and an output sharing
        memory with an input, a parameter or a buffer would come back as a copy that a later
        write (through the output, into the input, an optimizer step) leaves stale: both
        give values other than eager's, so such a call is refused."""
        cls = type(self.m).__qualname__
        written = [k for k, (t, version) in enumerate(inputs) if t._version != version]
        if written:
            raise InputWriteError(
                cls,
                f"forward writes into its input tensor(s) {written} in place, which the "
                "training build's graph cannot write back into the caller's tensors",
                "It runs in PyTorch; the plain backend (--backend ort) applies such writes, "
                "or write into a copy inside forward",
            )
        owners = {_storage(t): f"input {k}" for k, (t, _) in enumerate(inputs)}
        for name, t in (*self.m.named_parameters(), *self.m.named_buffers()):
            owners.setdefault(_storage(t), name)
        owners.pop(0, None)  # tensors without storage share nothing
        _, outputs = OutputSpec.of(result)
        for k, out in enumerate(outputs):
            owner = owners.get(_storage(out))
            if owner is not None:
                raise OutputAliasError(
                    cls,
                    f"output {k} shares memory with {owner} (a view of it, or it itself), "
                    "which the training build returns as a copy",
                    "It runs in PyTorch; the plain backend (--backend ort) returns such "
                    "outputs as views, or return a copy (.clone()) from forward",
                )

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The exporter finds parameters through `state_dict()`: the user's state_dict hooks
        must not run there (FSDP2's pre-hook reshards the parameters the trace is about to use,
        FSDP1's post-hook renames them)."""
        tables = [m.__dict__ for m in self.modules()]  # not setattr: a patched one counts writes
        saved = [(t["_state_dict_pre_hooks"], t["_state_dict_hooks"]) for t in tables]
        try:
            for table in tables:
                table["_state_dict_pre_hooks"], table["_state_dict_hooks"] = {}, {}
            return super().state_dict(*args, **kwargs)
        finally:
            for table, (pre, post) in zip(tables, saved, strict=True):
                table["_state_dict_pre_hooks"], table["_state_dict_hooks"] = pre, post

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = self._call_spec.rebuild(tensors)
        before = calls.buffer_versions(self.m)
        inputs = [(t, t._version) for t in tensors]
        result = self._forward(*args, **kwargs)
        self._refuse_what_a_graph_gets_wrong(result, inputs)
        updated = {
            name: buffer for name, (buffer, version) in before.items() if buffer._version != version
        }
        if updated:  # forward updates buffers in place: the graph returns their new values
            result = BufferUpdates(result, updated)
        self.output_spec, outputs = OutputSpec.of(result)
        # Values the trace took from sizes, recomputed by the graph as its last outputs.
        checks = hazards.take_checks() if self.with_checks else []
        if checks:
            outputs.append(hazards.checks_output([traced for traced, _ in checks], tensors))
        self.checks = [check for _, check in checks]
        return tuple(_OutputIdentity.apply(t) for t in outputs)


@dataclass
class ExportedGraph:
    """An exported graph and what is needed to feed it and rebuild its outputs."""

    model_bytes: bytes
    user_input_names: list[str]
    output_spec: OutputSpec
    # graph input name -> name of the parameter or buffer relative to the user's module
    state_names: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # ATen operator -> ONNX operator types its symbolic emitted (to route a failing one to torch)
    provenance: dict[str, set[str]] = field(default_factory=dict)
    routed: frozenset[str] = frozenset()  # ATen operators that became torch-calling nodes
    findings: hazards.Findings = field(default_factory=lambda: hazards.Findings([]))
    checks: list[hazards.Check] = field(default_factory=list)  # the last graph outputs


class UnexportableOperator(ExportError):
    """One ATen operator has no usable ONNX symbolic (it may be routed to torch)."""

    def __init__(self, module_class: str, cause: str, remedy: str, operator: str) -> None:
        super().__init__(module_class, cause, remedy)
        self.operator = operator


#: How many operators one export may route to torch after their export failed.
MAX_ROUTED_RETRIES = 16


@dataclass
class _Conversions:
    """What the exporter converted: the ONNX operator types each ATen operator produced."""

    provenance: dict[str, set[str]] = field(default_factory=dict)


def _failed_operator(exc: BaseException) -> str | None:
    """The ATen operator the exporter was converting when it failed (innermost first)."""
    from torch.onnx._internal.torchscript_exporter import utils

    code = utils._run_symbolic_function.__code__
    found = None
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                node = tb.tb_frame.f_locals.get("node")
                if node is not None:
                    found = node.kind()
            tb = tb.tb_next
        if found is not None:
            return found
        error = error.__cause__ or error.__context__
    return None


def operator_name(kind: str) -> str:
    """The name the exporter looks symbolics up by: `aten::relu_` -> `aten::relu` (in-place
    ops convert as their out-of-place form; `aten::__or__` becomes `aten::__or_` likewise)."""
    return kind[:-1] if kind.endswith("_") else kind


@contextlib.contextmanager
def _watching_conversions(record: _Conversions) -> Iterator[None]:
    from torch.onnx._internal.torchscript_exporter import utils

    original = utils._run_symbolic_function

    # No exception handling in here: a frame of ours re-raising the exporter's error made
    # the interpreter crash at exit (it holds the exporter's graph objects); the failing node
    # is read from the traceback instead (`_failed_operator`).
    def watched(*args: Any) -> Any:
        budget.check("while converting the trace to ONNX")
        new_nodes, node = args[6], args[2]
        start = len(new_nodes)
        result = original(*args)
        kind = node.kind()
        if kind.startswith("aten::"):
            made = record.provenance.setdefault(operator_name(kind), set())
            made.update(n.kind().split("::", 1)[-1] for n in new_nodes[start:])
        return result

    # Only under EXPORT_LOCK, which serialises the engine's exports.
    utils._run_symbolic_function = watched  # type: ignore[assignment]
    try:
        yield
    finally:
        utils._run_symbolic_function = original


PARAM_PREFIX = "m."


def export_call(
    module: torch.nn.Module,
    forward: Callable[..., Any],
    call_spec: CallSpec,
    tensors: Sequence[torch.Tensor],
    *,
    opset: int,
    dynamic: bool = True,
    routed: frozenset[str] = frozenset(),
    may_route: Callable[[str], bool] = lambda name: False,
) -> ExportedGraph:
    """Trace `forward(*args, **kwargs)` once and return the ONNX graph.

    Custom autograd Functions and the ATen operators named in `routed` become torch-calling
    nodes (`torch_in_graph/nodes.py`). An ATen operator whose export fails is routed too when
    `may_route(name)` allows it, and the export is tried again.
    Parameters, buffers and RNG states are exactly as before when this returns, also on failure.
    Holds `EXPORT_LOCK` throughout (see the module docstring).
    """
    chosen = set(routed)
    while True:
        try:
            return _export_once(
                module, forward, call_spec, tensors, opset, dynamic, frozenset(chosen)
            )
        except UnexportableOperator as exc:
            name = exc.operator
            if name in chosen or len(chosen) >= MAX_ROUTED_RETRIES or not may_route(name):
                raise
            log.debug("%s: %s becomes a torch-calling node", exc.module_class, name)
            chosen.add(name)


def _export_once(
    module: torch.nn.Module,
    forward: Callable[..., Any],
    call_spec: CallSpec,
    tensors: Sequence[torch.Tensor],
    opset: int,
    dynamic: bool,
    routed: frozenset[str],
) -> ExportedGraph:
    cls = type(module).__qualname__
    conversions = _Conversions()
    wrapper = _FlatModule(module, forward, call_spec)
    wrapper.with_checks = dynamic
    input_names = [f"input_{i}" for i in range(len(tensors))]
    dynamic_axes: dict[str, dict[int, str]] = {}
    if dynamic:
        dynamic_axes = {
            name: {d: f"{name}_dim{d}" for d in range(t.dim())}
            for name, t in zip(input_names, tensors, strict=True)
        }
    buffer = io.BytesIO()
    start = time.perf_counter()
    from ort_autopatch.engine import tracing
    from ort_autopatch.engine.backends.ort_training import symbolics

    try:
        with (
            EXPORT_LOCK,
            calls.preserved_state(module),
            calls.exporting(),
            _quiet_exporter(),
            chatter.captured(),
            _watching_conversions(conversions),
            symbolics.registered(
                opset,
                _symbolics_for(routed),
            ),
            tracing.export_rewrites(),
            torch.no_grad(),
            hazards.recording() as found,
            budget.enforced(),
        ):
            torch.onnx.export(
                wrapper,
                _trace_inputs(tensors),
                buffer,  # type: ignore[arg-type]  # BytesIO is accepted at run time
                dynamo=False,
                opset_version=opset,
                training=torch.onnx.TrainingMode.PRESERVE,
                do_constant_folding=False,
                export_params=False,
                keep_initializers_as_inputs=True,
                autograd_inlining=False,  # Functions reach our prim::PythonOp symbolic
                input_names=input_names,
                dynamic_axes=dynamic_axes or None,
            )
    except (UnsupportedModelError, BuildOverBudget):
        raise
    except Exception as exc:
        failed = _failed_operator(exc)
        # The traceback's frames hold the exporter's TorchScript graph and nodes; an error kept
        # for a report would keep them alive past torch's own teardown.
        traceback.clear_frames(exc.__traceback__)
        if failed is not None and failed.startswith("aten::"):
            name = operator_name(failed)
            raise UnexportableOperator(
                cls,
                f"torch.onnx.export failed at {name}: {type(exc).__name__}: {_first_line(exc)}",
                f"Allow {name} to run as a torch-calling node, exclude this class "
                "(ORT_AUTOPATCH_EXCLUDE) or keep the default fallback policy, which runs it "
                "eagerly",
                name,
            ) from exc
        raise ExportError(
            cls,
            f"torch.onnx.export failed: {type(exc).__name__}: {_first_line(exc)}",
            "Exclude this class (ORT_AUTOPATCH_EXCLUDE) or keep the default fallback policy, "
            "which runs it eagerly",
        ) from exc
    if wrapper.output_spec is None:  # pragma: no cover - forward always runs when export succeeds
        raise ExportError(cls, "the export never ran forward", "Report this as a bug")
    state_names = {
        name: name[len(PARAM_PREFIX) :]
        for name, _ in (*wrapper.named_parameters(), *wrapper.named_buffers())
    }
    return ExportedGraph(
        model_bytes=buffer.getvalue(),
        user_input_names=input_names,
        output_spec=wrapper.output_spec,
        state_names=state_names,
        seconds=time.perf_counter() - start,
        provenance=conversions.provenance,
        routed=routed,
        findings=found,
        checks=wrapper.checks,
    )


def _symbolics_for(routed: frozenset[str] = frozenset()) -> dict[str, Callable[..., Any]]:
    """Every symbolic one export needs: ours, custom autograd Functions as torch-calling nodes,
    and the ATen operators in `routed` (e.g. "aten::cummax") as torch-calling nodes."""
    from ort_autopatch.engine.backends.ort_training import symbolics
    from ort_autopatch.engine.backends.ort_training.torch_in_graph import routing

    found: dict[str, Callable[..., Any]] = dict(symbolics.SYMBOLICS)
    found["prim::PythonOp"] = routing.autograd_function
    for name in routed:
        found[name] = routing.aten_symbolic(name)
    return found


def _trace_inputs(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Copies of the call's tensors for the trace: a forward writing into its inputs must not
    write the caller's tensors (it is refused, and eager then writes them once). Normal
    tensors, also under inference mode, so that the copies count their writes."""
    with torch.inference_mode(False):
        return tuple(t.detach().clone() for t in tensors)


_quiet_lock = threading.Lock()


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Keep torch's ONNX log off during our exports, and as the user had it afterwards.

    torch 2.13's `setup_onnx_logging` tests the function object instead of its result, so every
    export switches ONNX logging on for good, and a failed export dumps the whole TorchScript
    graph on stderr: noise in a training job's log for an export the user never asked for.
    """
    from torch.onnx._internal.torchscript_exporter import utils

    was_enabled = torch._C._jit_is_onnx_log_enabled()
    with _quiet_lock:
        original = utils.setup_onnx_logging
        utils.setup_onnx_logging = lambda verbose: contextlib.nullcontext()  # type: ignore[assignment,return-value]
        try:
            yield
        finally:
            utils.setup_onnx_logging = original
            torch._C._jit_set_onnx_log_enabled(was_enabled)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
