"""Moving tensors in and out of ONNX Runtime (zero-copy DLPack) and tying its backward into
PyTorch's autograd."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ort_autopatch.engine import dlpack, rng, runtime
from ort_autopatch.engine.backends.ort_training.agent import InferenceProgram, TrainingProgram
from ort_autopatch.engine.backends.ort_training.torch_in_graph import nodes
from ort_autopatch.engine.errors import ExecutionError
from ort_autopatch.engine.session import ort_message


@dataclass
class BatchNormUpdate:
    """Where one BatchNorm's batch statistics land among the forward outputs."""

    module: weakref.ref[torch.nn.modules.batchnorm._BatchNorm]  # weak: it may be the root
    mean_index: int
    var_index: int  # the unbiased batch variance

    def apply(self, outputs: Sequence[torch.Tensor]) -> None:
        """PyTorch's running-stat rule, momentum=None (cumulative average) included."""
        bn = self.module()
        if bn is None:
            return
        tracked = bn.num_batches_tracked
        if tracked is not None:
            tracked.add_(1)
        if bn.momentum is None:
            factor = 1.0 / float(tracked) if tracked is not None else 0.0
        else:
            factor = bn.momentum
        if bn.running_mean is not None and bn.running_var is not None:
            bn.running_mean.lerp_(outputs[self.mean_index].to(bn.running_mean.dtype), factor)
            bn.running_var.lerp_(outputs[self.var_index].to(bn.running_var.dtype), factor)


@dataclass
class Step:
    """Everything one cached graph needs at call time besides the tensors."""

    module_class: str
    num_user_outputs: int
    batch_norms: list[BatchNormUpdate]
    seeds_dropout: bool
    # told of a backward that failed (the forward already ran here: no eager fallback for
    # this step), so later calls run in PyTorch and the report says why
    backward_failed: Callable[[ExecutionError], None] | None = None


def _seed_dropout() -> int:
    """Seed ORT's generator from the tool's stream (`rng`): torch.manual_seed makes dropout
    reproducible, and the user's generator is never drawn from."""
    seed = rng.next_seed()
    runtime.capi().set_seed(seed)
    return seed


def _post_forward(step: Step, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    if step.batch_norms:
        with torch.no_grad():
            for update in step.batch_norms:
                update.apply(outputs)
    return outputs[: step.num_user_outputs]


def run_inference(
    program: InferenceProgram,
    step: Step,
    feeds: Sequence[torch.Tensor],
    kept: dlpack.KeptValues | None = None,
) -> list[torch.Tensor]:
    if step.seeds_dropout:
        _seed_dropout()
    fetches = runtime.capi().OrtValueVector()
    try:
        with dlpack.on_stream(program.stream) as caller:
            program.session._sess.run_with_ortvaluevector(
                program.run_options,
                program.feed_names,
                dlpack.push(feeds, kept),
                program.fetch_names,
                fetches,
                program.fetch_devices,
            )
    except Exception as exc:
        raise _failure(step, "forward", exc) from nodes.take_error() or exc
    return _post_forward(step, dlpack.pull(fetches, caller))


class _RunState:
    __slots__ = ("__weakref__", "output_info", "state")

    def __init__(
        self, state: Any, output_info: list[tuple[torch.Size, torch.device, torch.dtype]]
    ) -> None:
        self.state = state
        self.output_info = output_info


def _failure(step: Step, phase: str, exc: BaseException) -> ExecutionError:
    """ORT's message, or the Python error a torch-calling node hit (ORT only saw its result)."""
    inner = nodes.peek_error()
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
    return ExecutionError(step.module_class, cause, remedy)


def _run_forward(
    program: TrainingProgram,
    step: Step,
    feeds: Sequence[torch.Tensor],
    kept: dlpack.KeptValues | None = None,
) -> tuple[Any, list[torch.Tensor], list[nodes.Context]]:
    """ORT's forward: its execution state (what backward needs), every output, and the contexts
    of its torch-calling nodes (their torch graphs, kept for backward)."""
    _, capi = runtime.load()
    state = capi.PartialGraphExecutionState()
    outputs_vector = capi.OrtValueVector()
    if not program.python_nodes and program.stream is None:
        # nothing to collect or order (the common CPU graph): the same run, a few us cheaper
        try:
            program.agent.run_forward(dlpack.push(feeds, kept), outputs_vector, state, None)
        except Exception as exc:
            raise _failure(step, "forward", exc) from exc
        return state, dlpack.pull(outputs_vector), []
    try:
        with nodes.collecting() as contexts, dlpack.on_stream(program.stream) as caller:
            program.agent.run_forward(dlpack.push(feeds, kept), outputs_vector, state, None)
    except Exception as exc:
        nodes.release(contexts)
        raise _failure(step, "forward", exc) from nodes.take_error() or exc
    return state, dlpack.pull(outputs_vector, caller), contexts


def _run_backward(
    program: TrainingProgram,
    step: Step,
    run: _RunState,
    grad_outputs: Sequence[torch.Tensor | None],
) -> list[torch.Tensor | None]:
    """ORT's backward from the state of its forward: one gradient (or None) per feed."""
    grads = []
    for k in range(program.num_outputs):
        if k in program.non_differentiable:
            continue
        grad = grad_outputs[k] if k < len(grad_outputs) else None
        if grad is None:
            shape, device, dtype = run.output_info[k]
            if k in program.full_shape_grads:
                grad = torch.zeros(shape, device=device, dtype=dtype)
            else:
                grad = torch.zeros((), device=device, dtype=dtype)
        grads.append(grad)
    results = runtime.capi().OrtValueVector()
    try:
        with dlpack.on_stream(program.stream) as caller:
            program.agent.run_backward(dlpack.push(grads), results, run.state)
    except Exception as exc:
        failure = _failure(step, "backward", exc)
        if step.backward_failed is not None:
            step.backward_failed(failure)
        raise failure from nodes.take_error() or exc
    finally:
        run.state = None
    tensors = dlpack.pull(results, caller)
    return [tensors[i] if i >= 0 else None for i in program.grad_index]


def _user_outputs(
    ctx: Any, program: TrainingProgram, step: Step, outputs: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    user = _post_forward(step, outputs)
    for k, out in enumerate(user):
        if k in program.non_differentiable or not out.is_floating_point():
            ctx.mark_non_differentiable(out)
    return tuple(user)


def _output_info(outputs: list[torch.Tensor]) -> list[tuple[torch.Size, torch.device, torch.dtype]]:
    return [(o.shape, o.device, o.dtype) for o in outputs]


@dataclass(frozen=True)
class TrainingGraph:
    """A training graph as its calls run it: everything the autograd Function needs besides
    the feeds, as its one non-tensor argument (autograd handles every argument of every
    call: an input slot, a `needs_input_grad` flag, a None gradient)."""

    program: TrainingProgram
    step: Step
    kept: dlpack.KeptValues | None = None


class TrainingCall(torch.autograd.Function):
    """Forward and backward of one graph; the feeds are the Function's inputs so autograd
    routes each gradient to its parameter or input."""

    @staticmethod
    def forward(ctx: Any, graph: TrainingGraph, *feeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        program, step = graph.program, graph.step
        if step.seeds_dropout:
            _seed_dropout()
        state, outputs, contexts = _run_forward(program, step, feeds, graph.kept)
        ctx.graph = graph
        ctx.run = _RunState(state, _output_info(outputs))
        if contexts:
            # torch-calling nodes keep their torch graph until backward; free it with the run
            # when backward never comes (an output nobody backpropagates)
            weakref.finalize(ctx.run, nodes.release, contexts)
        ctx.set_materialize_grads(False)
        user = _user_outputs(ctx, program, step, outputs)
        # Saved only for autograd's version check: the backward pass reads these buffers (ORT
        # shares them with PyTorch), so an in-place write to one of them before backward
        # raises eager's error instead of silently changing the gradients. Saved after the
        # BatchNorm statistics update, which writes buffers the graph read.
        ctx.save_for_backward(
            *[feeds[k] for k in program.backward_reads_feeds],
            *[user[k] for k in program.backward_reads_outputs],
        )
        return user

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        _ = ctx.saved_tensors
        graph: TrainingGraph = ctx.graph
        return (None, *_run_backward(graph.program, graph.step, ctx.run, grad_outputs))


class RecomputingTrainingCall(torch.autograd.Function):
    """A training call that keeps nothing of ORT's forward: backward runs forward again on the
    feeds as they are then, and backward right after.

    For parameters whose memory is freed between forward and backward (FSDP2 reshards after
    forward and gathers again before backward, into new memory): ORT's saved state would point
    at the freed memory. Costs one more forward; holds only the feeds (no activations) in
    between, as activation checkpointing does. Dropout and random torch-calling nodes replay
    the forward's seeds. The graph's kept values are not used: these parameters get new memory
    between calls.
    """

    @staticmethod
    def forward(ctx: Any, graph: TrainingGraph, *feeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        program, step = graph.program, graph.step
        seed = _seed_dropout() if step.seeds_dropout else None
        with nodes.recorded_seeds(None) as drawn:
            _, outputs, contexts = _run_forward(program, step, feeds)
        nodes.release(contexts)  # ORT's state is dropped here: no backward from it
        ctx.graph = graph
        ctx.seeds = (seed, drawn)
        ctx.set_materialize_grads(False)
        user = _user_outputs(ctx, program, step, outputs)
        ctx.save_for_backward(*feeds)  # after BatchNorm's running-stat update bumped versions
        return user

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        feeds = ctx.saved_tensors
        graph: TrainingGraph = ctx.graph
        program, step = graph.program, graph.step
        seed, drawn = ctx.seeds
        if seed is not None:
            runtime.capi().set_seed(seed)
        with nodes.recorded_seeds(drawn):
            state, outputs, contexts = _run_forward(program, step, feeds)
        try:
            run = _RunState(state, _output_info(outputs))
            grads = _run_backward(program, step, run, grad_outputs)
        finally:
            nodes.release(contexts)
        return (None, *grads)


# `autograd.Function.apply` is a Python wrapper around the C method that does the work: it
# binds defaults for `setup_context` (these Functions define none), checks for functorch
# transforms and unwraps dead functorch wrappers in a generator over the arguments. In a
# training step, with ORT's kernels evicting the caches between calls, the wrapper cost 27 us a
# call of the bench MLP's 1.2 ms forward + backward. Outside functorch transforms the C method
# is called directly, with the same unwrapping; under them torch's own path runs (and refuses).
_C_APPLY: dict[type[torch.autograd.Function], Any] = {
    function: super(torch.autograd.Function, function).apply  # type: ignore[misc]
    for function in (TrainingCall, RecomputingTrainingCall)
}
_UNWRAP_IF_DEAD = torch._C._functorch.unwrap_if_dead
_TRANSFORMS_ACTIVE = torch._C._are_functorch_transforms_active


def train(
    graph: TrainingGraph, feeds: Sequence[torch.Tensor], recompute: bool = False
) -> tuple[torch.Tensor, ...]:
    """One training call through autograd: `TrainingCall.apply(graph, *feeds)`, or the
    recomputing variant (`RecomputingTrainingCall`), without Function.apply's Python layer."""
    function = RecomputingTrainingCall if recompute else TrainingCall
    if _TRANSFORMS_ACTIVE():
        outputs: tuple[torch.Tensor, ...] = function.apply(graph, *feeds)
        return outputs
    outputs = _C_APPLY[function](graph, *map(_UNWRAP_IF_DEAD, feeds))
    return outputs
