"""A training graph tied into PyTorch's autograd, for every backend: one autograd Function,
its recomputing variant, one fast path into them, and the one place where a failed backward is
told to the engine.

A backend's training program hands `apply` a `DifferentiableGraph`: what its forward and
backward runs are (a TrainingAgent's two halves, two inference sessions) is its own business;
how they meet autograd is written once here. The feeds are the Function's inputs, so autograd
routes each gradient to its parameter or input; the graph object is the one non-tensor
argument (autograd handles every argument of every call: an input slot, a
`needs_input_grad` flag, a None gradient).

A backward that fails cannot fall back: its forward already ran in ONNX Runtime. The engine is
told (`RunHooks.backward_failed`), so that later training calls of the class run in PyTorch,
and the error reaches the user's `backward()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ort_autopatch.engine.backend import RunHooks
from ort_autopatch.engine.errors import ExecutionError, UnrepeatableDrawsError

Grads = Sequence[torch.Tensor | None]


class DifferentiableGraph(Protocol):
    """What a backend's training program supplies to the Functions below."""

    @property
    def hooks(self) -> RunHooks:
        """Told of a failed backward."""
        ...

    @property
    def redraws(self) -> bool:
        """Its forward has random operators seeded per session (`random_ops.per_session`),
        which no seed given to a run repeats."""
        ...

    def forward(self, ctx: Any, feeds: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run forward, save on `ctx` what backward needs; the user outputs."""
        ...

    def backward(self, ctx: Any, grads: Grads) -> Sequence[torch.Tensor | None]:
        """One gradient (or None) per feed."""
        ...

    def recomputing_forward(
        self, ctx: Any, feeds: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """Forward keeping nothing of the run but the feeds (and what replays it: seeds)."""
        ...

    def recomputing_backward(self, ctx: Any, grads: Grads) -> Sequence[torch.Tensor | None]:
        """Forward again on the saved feeds, as the first run was, then backward."""
        ...


def _told(
    ctx: Any, run: Callable[[Any, Grads], Sequence[torch.Tensor | None]], grads: Grads
) -> tuple[torch.Tensor | None, ...]:
    try:
        return (None, *run(ctx, grads))
    except ExecutionError as exc:
        told = ctx.graph.hooks.backward_failed
        if told is not None:
            told(exc)
        raise


class GraphFunction(torch.autograd.Function):
    """Forward and backward of one graph."""

    @staticmethod
    def forward(
        ctx: Any, graph: DifferentiableGraph, *feeds: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.graph = graph
        return graph.forward(ctx, feeds)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return _told(ctx, ctx.graph.backward, grads)


class RecomputingGraphFunction(torch.autograd.Function):
    """A training call that keeps nothing of its forward but the feeds: backward runs forward
    again on them (seeded as the first run was), then backward.

    For parameters whose memory is freed between forward and backward (FSDP2 reshards after
    forward and gathers again before backward, into new memory), and for a graph that draws
    (dropout) under activation checkpointing, whose own rerun of the call would draw another
    mask. Costs one more forward and holds no activations in between, as activation
    checkpointing does."""

    @staticmethod
    def forward(
        ctx: Any, graph: DifferentiableGraph, *feeds: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.graph = graph
        return graph.recomputing_forward(ctx, feeds)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return _told(ctx, ctx.graph.recomputing_backward, grads)


# `autograd.Function.apply` is a Python wrapper around the C method that does the work: it
# binds defaults for `setup_context` (these Functions define none), checks for functorch
# transforms and unwraps dead functorch wrappers in a generator over the arguments. In a
# training step, with ORT's kernels evicting the caches between calls, the wrapper cost 27 us a
# call of the bench MLP's 1.2 ms forward + backward. Outside functorch transforms the C method
# is called directly, with the same unwrapping; under them torch's own path runs (and refuses).
_C_APPLY: dict[type[torch.autograd.Function], Any] = {
    function: super(torch.autograd.Function, function).apply  # type: ignore[misc]
    for function in (GraphFunction, RecomputingGraphFunction)
}
_UNWRAP_IF_DEAD = torch._C._functorch.unwrap_if_dead
_SAVED_TENSOR_HOOKS = torch._C._autograd._top_saved_tensors_default_hooks
_TRANSFORMS_ACTIVE = torch._C._are_functorch_transforms_active


def apply(
    graph: DifferentiableGraph, feeds: Sequence[torch.Tensor], recompute: bool = False
) -> tuple[torch.Tensor, ...]:
    """One training call through autograd: `GraphFunction.apply(graph, *feeds)`, or the
    recomputing variant, without Function.apply's Python layer.

    A graph whose draws no run can repeat (`redraws`) is refused, before anything runs, where
    its forward would run again for this call: in the recomputing variant, and under
    saved-tensor hooks (activation checkpointing reruns the whole call in backward, as eager
    does with its generators restored)."""
    if graph.redraws and (recompute or _SAVED_TENSOR_HOOKS(False) is not None):
        why = "a recomputing forward" if recompute else "activation checkpointing"
        raise UnrepeatableDrawsError(
            graph.hooks.module_class,
            f"its graph draws from random operators ONNX Runtime seeds once per session, "
            f"and {why} would run it again for this call and draw other numbers than the "
            "first run",
            "It runs in PyTorch, which replays its draws; dropout (nn.Dropout, feature "
            "dropout) is seeded per run and replays in ONNX Runtime",
        )
    function = RecomputingGraphFunction if recompute else GraphFunction
    if _TRANSFORMS_ACTIVE():
        outputs: tuple[torch.Tensor, ...] = function.apply(graph, *feeds)
        return outputs
    outputs = _C_APPLY[function](graph, *map(_UNWRAP_IF_DEAD, feeds))
    return outputs
