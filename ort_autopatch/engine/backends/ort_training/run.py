"""The training build's graphs as calls run them: a TrainingAgent's forward and backward as a
`graph_function.DifferentiableGraph`, an inference session for calls without gradients, and
what a run changes besides its outputs (`RunEffects`: BatchNorm statistics, dropout seeds).

The autograd Functions, the session run and the DLPack transport are the engine's, shared with
every backend (`graph_function`, `session.RunnableSession`, `dlpack`); what is here is only
what a TrainingAgent and the training build's exported graphs need: ORT's partial execution
state between forward and backward, torch-calling nodes' contexts and errors, the gradient
graph's output conventions, and BatchNorm's statistics handed out as extra outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ort_autopatch.engine import dlpack, graph_function, rng, runtime, session
from ort_autopatch.engine.backend import RunHooks
from ort_autopatch.engine.backends.ort_training import agent
from ort_autopatch.engine.backends.ort_training.agent import InferenceProgram, TrainingProgram
from ort_autopatch.engine.backends.ort_training.torch_in_graph import nodes
from ort_autopatch.engine.errors import ExecutionError
from ort_autopatch.engine.recipe import Recipe
from ort_autopatch.engine.session import execution_error
from ort_autopatch.engine.state import ModuleState

log = logging.getLogger("ort_autopatch")


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
class RunEffects:
    """What one of the training build's graphs changes at call time besides its outputs."""

    num_user_outputs: int
    batch_norms: list[BatchNormUpdate]
    seeds_dropout: bool
    redraws: bool = False  # random operators seeded per session (`random_ops.per_session`)

    def undo_point(self) -> Callable[[], None]:
        """The RNG state and BatchNorm statistics now; the result puts them back."""
        rng_state = torch.random.get_rng_state() if self.seeds_dropout else None
        buffers = [
            (b, b.detach().clone())
            for update in self.batch_norms
            if (bn := update.module()) is not None
            for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
            if b is not None
        ]

        def undo() -> None:
            if rng_state is not None:
                torch.random.set_rng_state(rng_state)
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)

        return undo

    def after_forward(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The BatchNorm statistics applied; the user outputs."""
        if self.batch_norms:
            with torch.no_grad():
                for update in self.batch_norms:
                    update.apply(outputs)
        return outputs[: self.num_user_outputs]


def _failure(cls: str, phase: str, exc: BaseException) -> ExecutionError:
    """ORT's message, or the Python error a torch-calling node hit (ORT only saw its result)."""
    return execution_error(cls, phase, exc, nodes.peek_error())


def run_inference(
    program: InferenceProgram,
    effects: RunEffects,
    hooks: RunHooks,
    feeds: Sequence[torch.Tensor],
    kept: dlpack.KeptValues | None = None,
) -> list[torch.Tensor]:
    if effects.seeds_dropout:
        rng.seed_runs()
    try:
        outputs = program.run(feeds, kept)
    except Exception as exc:
        raise _failure(hooks.module_class, "forward", exc) from nodes.take_error() or exc
    return effects.after_forward(outputs)


class _RunState:
    __slots__ = ("__weakref__", "output_info", "state")

    def __init__(
        self, state: Any, output_info: list[tuple[torch.Size, torch.device, torch.dtype]]
    ) -> None:
        self.state = state
        self.output_info = output_info


def _output_info(outputs: list[torch.Tensor]) -> list[tuple[torch.Size, torch.device, torch.dtype]]:
    return [(o.shape, o.device, o.dtype) for o in outputs]


@dataclass(frozen=True)
class TrainingGraph:
    """A TrainingAgent's graph as `graph_function`'s Functions run it."""

    program: TrainingProgram
    effects: RunEffects
    hooks: RunHooks
    kept: dlpack.KeptValues | None = None

    @property
    def redraws(self) -> bool:
        return self.effects.redraws

    def forward(self, ctx: Any, feeds: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        program = self.program
        if self.effects.seeds_dropout:
            rng.seed_runs()
        state, outputs, contexts = self._run_forward(feeds, self.kept)
        ctx.run = _RunState(state, _output_info(outputs))
        if contexts:
            # torch-calling nodes keep their torch graph until backward; free it with the run
            # when backward never comes (an output nobody backpropagates)
            weakref.finalize(ctx.run, nodes.release, contexts)
        ctx.set_materialize_grads(False)
        user = self._user_outputs(ctx, outputs)
        # Saved only for autograd's version check: the backward pass reads these buffers (ORT
        # shares them with PyTorch), so an in-place write to one of them before backward
        # raises eager's error instead of silently changing the gradients. Saved after the
        # BatchNorm statistics update, which writes buffers the graph read.
        ctx.save_for_backward(
            *[feeds[k] for k in program.backward_reads_feeds],
            *[user[k] for k in program.backward_reads_outputs],
        )
        return user

    def backward(self, ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        _ = ctx.saved_tensors  # autograd's version check
        return self._run_backward(ctx.run, grads)

    def recomputing_forward(
        self, ctx: Any, feeds: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """ORT's state is dropped after forward: parameters whose memory is freed before
        backward (FSDP2) would leave it pointing at freed memory. Dropout and random
        torch-calling nodes replay the forward's seeds in backward; the graph's kept values
        are not used (these parameters get new memory between calls)."""
        seed = rng.seed_runs() if self.effects.seeds_dropout else None
        with nodes.recorded_seeds(None) as drawn:
            _, outputs, contexts = self._run_forward(feeds)
        nodes.release(contexts)  # no backward from this run's state
        ctx.seeds = (seed, drawn)
        ctx.set_materialize_grads(False)
        user = self._user_outputs(ctx, outputs)
        ctx.save_for_backward(*feeds)  # after BatchNorm's running-stat update bumped versions
        return user

    def recomputing_backward(
        self, ctx: Any, grads: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        feeds = ctx.saved_tensors
        seed, drawn = ctx.seeds
        if seed is not None:
            rng.seed_runs(seed)
        with nodes.recorded_seeds(drawn):
            state, outputs, contexts = self._run_forward(feeds)
        try:
            return self._run_backward(_RunState(state, _output_info(outputs)), grads)
        finally:
            nodes.release(contexts)

    def _user_outputs(self, ctx: Any, outputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        user = self.effects.after_forward(outputs)
        for k, out in enumerate(user):
            if k in self.program.non_differentiable or not out.is_floating_point():
                ctx.mark_non_differentiable(out)
        return tuple(user)

    def _run_forward(
        self, feeds: Sequence[torch.Tensor], kept: dlpack.KeptValues | None = None
    ) -> tuple[Any, list[torch.Tensor], list[nodes.Context]]:
        """ORT's forward: its execution state (what backward needs), every output, and the
        contexts of its torch-calling nodes (their torch graphs, kept for backward)."""
        program = self.program
        _, capi = runtime.load()
        state = capi.PartialGraphExecutionState()
        outputs_vector = capi.OrtValueVector()
        if not program.python_nodes and program.stream is None:
            # nothing to collect or order (the common CPU graph): the same run, a few us cheaper
            try:
                with program.scope:
                    program.agent.run_forward(dlpack.push(feeds, kept), outputs_vector, state, None)
            except Exception as exc:
                raise _failure(self.hooks.module_class, "forward", exc) from exc
            return state, dlpack.pull(outputs_vector), []
        try:
            with (
                nodes.collecting() as contexts,
                program.scope,
                dlpack.on_stream(program.stream) as caller,
            ):
                program.agent.run_forward(dlpack.push(feeds, kept), outputs_vector, state, None)
        except Exception as exc:
            nodes.release(contexts)
            failure = _failure(self.hooks.module_class, "forward", exc)
            raise failure from nodes.take_error() or exc
        return state, dlpack.pull(outputs_vector, caller), contexts

    def _run_backward(
        self, run: _RunState, grad_outputs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """ORT's backward from the state of its forward: one gradient (or None) per feed."""
        program = self.program
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
            with program.scope, dlpack.on_stream(program.stream) as caller:
                program.agent.run_backward(dlpack.push(grads), results, run.state)
        except Exception as exc:
            failure = _failure(self.hooks.module_class, "backward", exc)
            raise failure from nodes.take_error() or exc
        finally:
            run.state = None
        tensors = dlpack.pull(results, caller)
        return [tensors[i] if i >= 0 else None for i in program.grad_index]


def run_effects(recipe: Recipe, state: ModuleState) -> RunEffects:
    """What the recipe's runs change besides their outputs, bound to the module's BatchNorms."""
    batch_norms = []
    for name, mean_index, var_index in recipe.batch_norms:
        bn = state.module_named(name)
        if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm):
            batch_norms.append(BatchNormUpdate(weakref.ref(bn), mean_index, var_index))
    return RunEffects(recipe.num_user_outputs, batch_norms, recipe.seeds_dropout, recipe.redraws)


def program_feeds_kept(recipe: Recipe, feed_names: Sequence[str]) -> dlpack.KeptValues:
    """ORT's values of the feeds that are the module's tensors, kept from call to call."""
    return dlpack.KeptValues(
        [k for k, name in enumerate(feed_names) if recipe.feed_sources[name][0] != "input"]
    )


class AgentProgram:
    """A training program: forward and backward through the agent, tied into autograd.

    Built while the ATen executor was still compiling (`upgrade`), it runs ORT's or Python's
    gradient nodes until the compiler is done, then makes its session again with the executor
    at the start of a call (the graph is not exported or differentiated again); a call still
    between its forward and backward finishes on the graph it started with."""

    def __init__(
        self,
        program: agent.TrainingProgram,
        effects: RunEffects,
        hooks: RunHooks,
        kept: dlpack.KeptValues,
        torch_nodes: dict[str, int],
        saved_graphs: dict[str, bytes],
        upgrade: ExecutorUpgrade | None = None,
    ) -> None:
        self.program = program
        self.feed_names: Sequence[str] = program.feed_names
        self.torch_nodes = torch_nodes
        self.saved_graphs = saved_graphs
        self.graph = TrainingGraph(program, effects, hooks, kept)
        self._upgrade = upgrade

    def run(self, feeds: list[torch.Tensor], recompute: bool) -> Sequence[torch.Tensor]:
        if self._upgrade is not None and self._upgrade.due():
            self._take_upgrade()
        return graph_function.apply(self.graph, feeds, recompute)

    def undo_point(self, feeds: Sequence[torch.Tensor]) -> Callable[[], None]:
        return self.graph.effects.undo_point()

    def _take_upgrade(self) -> None:
        upgrade, self._upgrade = self._upgrade, None  # one try, by whichever thread comes
        assert upgrade is not None
        made = upgrade.make()
        if made is None:
            return
        program, model = made
        from ort_autopatch.engine.backends.ort_training import graph

        if list(program.feed_names) != list(self.feed_names):  # the entry's feeds follow these
            log.debug("%s: the executor's graph takes other feeds; kept ORT's", upgrade.cls)
            return
        self.program = program
        kept = program_feeds_kept(upgrade.recipe, program.feed_names)
        self.graph = dataclasses.replace(self.graph, program=program, kept=kept)

        self.torch_nodes = nodes.Inventory.of(graph.load(model)).counts
        self.saved_graphs = {"gradient": model}
        log.info("%s: the ATen executor is ready; its gradient nodes now call torch", upgrade.cls)


@dataclass
class ExecutorUpgrade:
    """How a training program built while the executor compiled makes its session again."""

    cls: str
    recipe: Recipe
    make_graph: Any  # () -> the gradient graph with the executor's nodes, or None
    device: torch.device
    settings: session.SessionSettings

    @staticmethod
    def due() -> bool:
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

        return aten_executor.compiled()

    def make(self) -> tuple[agent.TrainingProgram, bytes] | None:
        """The new session and the graph it runs; None when nothing is better than before."""
        try:
            swapped = self.make_graph()
            if swapped is None:
                return None
            program = agent.build_training(swapped, self.device, self.settings, self.cls)
        except Exception as exc:  # whatever fails, the program it had goes on
            log.debug("%s: no graph with the ATen executor (%s)", self.cls, exc)
            return None
        return program, swapped.model


class SessionProgram:
    """An inference program: one session over the forward graph."""

    def __init__(
        self,
        program: agent.InferenceProgram,
        effects: RunEffects,
        hooks: RunHooks,
        kept: dlpack.KeptValues,
        torch_nodes: dict[str, int],
    ) -> None:
        self.program = program
        self.effects = effects
        self.hooks = hooks
        self.kept = kept
        self.feed_names: Sequence[str] = program.feed_names
        self.torch_nodes = torch_nodes
        self.saved_graphs: dict[str, bytes] = {}

    def run(self, feeds: list[torch.Tensor], recompute: bool) -> Sequence[torch.Tensor]:
        return run_inference(self.program, self.effects, self.hooks, feeds, self.kept)

    def undo_point(self, feeds: Sequence[torch.Tensor]) -> Callable[[], None]:
        return self.effects.undo_point()
