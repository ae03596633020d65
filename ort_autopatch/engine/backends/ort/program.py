"""Running a captured call: a forward and a backward InferenceSession tied into autograd.

The two FX graphs of a capture become ONNX graphs (`lowering`) and sessions; values cross in
both directions through DLPack without copies (the engine's `dlpack` plumbing, its kept values
of the module's tensors included). Inputs a graph merely passes through (parameters the
backward reads, a gradient equal to its cotangent) are served on the torch side rather than
sent through ORT. A call's Function saves what the partitioner chose for the backward with
`save_for_backward`, so autograd's version check guards it as eager's saved tensors, and copies
the new values of the buffers forward updated (BatchNorm's statistics) into the module's
buffers, as eager's in-place update does. A backward run in stages (`stages`) is handed the
values forward made that nothing else holds instead (`OrtProgram.handed`): it lets go of each
after the last stage that reads it, unless the backward keeps the graph (`retain_graph`), and
a backward after one that let go raises autograd's own error. Dropout draws from ORT's
generator, seeded before each forward from the tool's own stream (`rng`): torch's generator is
never drawn from.

A recomputing call (`OrtProgram.recomputing_forward`) saves the feeds alone and runs the
forward session again in backward, with the forward's seed, before the backward session: for
parameters freed between forward and backward (FSDP2's `reshard_after_forward`), and for a
graph with dropout under activation checkpointing, whose own rerun of the call would draw
another mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine import dlpack, graph_function, rng, session
from ort_autopatch.engine.backend import RunHooks
from ort_autopatch.engine.backends.ort import stages
from ort_autopatch.engine.backends.ort.lowered import GraphFacts, Lowered
from ort_autopatch.engine.backends.ort.torch_nodes import Split
from ort_autopatch.engine.errors import ExecutionError


@dataclass
class _Session:
    """One graph's session, what feeds it among the values its caller holds, and where each
    graph output comes from."""

    runnable: session.RunnableSession | None  # None: nothing to compute (`_session_for`)
    feeds: list[int]  # per session input: index into the values the caller holds
    #: per graph output: ("onnx", fetch index), ("in", index into the caller's values) or
    #: ("none", -1)
    outputs: list[tuple[str, int]]
    draws: bool  # a run reads ORT's generator (dropout): seed it first
    #: the runnable lets go of each feed once it has read it (`stages`): `run` hands the
    #: caller's values over
    consumes: bool = False
    #: fetch index -> the shape its tensor is given back (`GraphFacts.viewed`)
    viewed: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: fetch index -> the fetches of the rows and values added into it (`GraphFacts.added`)
    added: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # whether the fetches are the outputs as they are (no input passed through, none
        # missing): read once, not per run
        self._as_fetched = self.outputs == [("onnx", k) for k in range(len(self.outputs))]
        passed = {k for kind, k in self.outputs if kind == "in"}
        self._handed = [k for k in self.feeds if k not in passed] if self.consumes else []
        # the first fetch only torch's finishing reads (`added`): it and those after go
        self._finishing = min((k for parts in self.added.values() for k in parts), default=0)

    def run(
        self,
        cls: str,
        phase: str,
        values: Sequence[torch.Tensor],
        kept: Any,
        seed: int | None = None,
    ) -> list[Any]:
        """The graph's outputs; a graph that draws is seeded with `seed`, else with the
        stream's next seed."""
        if self.runnable is None:
            return [values[k] if kind == "in" else None for kind, k in self.outputs]
        if self.draws:
            rng.seed_runs(seed)
        feeds = [values[k] for k in self.feeds]
        if self._handed:  # held by the runnable alone from here (`values` is the caller's own)
            assert isinstance(values, list)
            for k in self._handed:
                values[k] = None
        try:
            got = self.runnable.run(feeds, kept)
        except Exception as exc:
            raise session.execution_error(cls, phase, exc) from exc
        for k, shape in self.viewed.items():
            got[k] = _reshaped(got[k], shape)
        if self.added:
            for k, (rows, added) in self.added.items():
                got[k].index_add_(0, got[rows], got[added])
            del got[self._finishing :]
        if self._as_fetched:
            return got
        return [
            got[k] if kind == "onnx" else values[k] if kind == "in" else None
            for kind, k in self.outputs
        ]


def _reshaped(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor`'s memory as a new contiguous tensor of `shape`: a graph output ONNX Runtime
    returned unreshaped (`onnx_passes.reshapes_into_outputs_left_to_torch`). Not a view
    (`Tensor.view`): eager's output has no `_base`, and autograd would treat writes into a
    view of a Function's output as writes into the output it viewed."""
    made = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    offset = int(tensor.storage_offset())
    return made.set_(tensor.untyped_storage(), offset, shape)  # type: ignore[call-overload]


_KEEP_DROPOUT = ("EliminateDropout",)


def _session_for(
    model: bytes,
    facts: GraphFacts,
    outputs: list[tuple[str, int]],
    cls: str,
    device: torch.device,
    settings: session.SessionSettings,
    role: str = "",
    cut: Split | None = None,
    staging: stages.Staging | None = None,
) -> _Session:
    """`cut`: the graph cut at its torch nodes (`Lowered.splits`), run segment by segment;
    `staging`: a backward run in stages (`stages`), letting go of each input after its
    last."""
    if not any(kind == "onnx" for kind, _ in outputs):
        # Every output is an input passed through, made on the torch side, or None (a model
        # returning its input): no operator is left to run, and no session is made
        return _Session(None, [], outputs, False)
    inputs = {name: k for k, name in enumerate(facts.inputs)}
    if cut is not None:
        split = _SplitRunnable(cut, cls, role, device, settings)
        feeds = [inputs[name] for name in split.feed_names]
        return _Session(split, feeds, outputs, False)  # type: ignore[arg-type]
    stream = session.compute_stream(device)
    if staging is not None:
        runs = []
        for stage in staging.stages:
            sess, _ = session.create(
                stage.model,
                device,
                settings,
                cls,
                False,
                stream=stream,
                disabled_optimizers=_KEEP_DROPOUT,
            )
            runs.append(session.RunnableSession.of(sess, device, stream, stage.outputs))
        staged = stages.StagedRunnable(staging, runs, facts.inputs)
        feeds = list(range(len(facts.inputs)))
        return _Session(
            staged,  # type: ignore[arg-type]
            feeds,
            outputs,
            False,
            consumes=True,
            viewed=facts.viewed,
            added=facts.added,
        )
    # ORT's EliminateDropout removes Dropout nodes whose training flag is a Constant node
    # (what the exporter writes) as if they were inference no-ops: dropout silently off.
    sess, _ = session.create(
        model, device, settings, cls, False, stream=stream, disabled_optimizers=_KEEP_DROPOUT
    )
    runnable = session.RunnableSession.of(sess, device, stream)
    return _Session(
        runnable=runnable,
        feeds=[inputs[name] for name in runnable.feed_names],
        outputs=outputs,
        draws=facts.draws,
        viewed=facts.viewed,
        added=facts.added,
    )


class _SegmentRun(torch.nn.Module):
    """One ONNX segment of a cut graph, called by the top-level graph as its submodule was."""

    def __init__(self, run: _Session, cls: str, phase: str, single: bool) -> None:
        super().__init__()
        self.run, self.cls, self.phase, self.single = run, cls, phase, single

    def forward(self, *values: torch.Tensor) -> Any:
        got = self.run.run(self.cls, self.phase, values, None)
        return got[0] if self.single else tuple(got)


class _SplitRunnable:
    """A cut graph (`torch_nodes.Split`) run as one session is (`session.RunnableSession`'s
    `feed_names` and `run`): its segments' sessions, the torch nodes between them."""

    def __init__(
        self,
        cut: Split,
        cls: str,
        phase: str,
        device: torch.device,
        settings: session.SessionSettings,
    ) -> None:
        self.feed_names = cut.inputs
        modules: dict[str, Any] = dict(cut.modules)
        for k, segment in enumerate(cut.segments):
            facts = GraphFacts(segment.inputs, False)
            run = _session_for(
                segment.model, facts, segment.outputs, cls, device, settings, f"{phase}.{k}"
            )
            modules[segment.name] = _SegmentRun(run, cls, phase, segment.single)
        self.module = torch.fx.GraphModule(modules, cut.graph)

    def run(self, feeds: Sequence[torch.Tensor], kept: Any = None) -> list[torch.Tensor]:
        """The graph's outputs (`kept` is for whole-graph sessions: segments keep none)."""
        return list(self.module(*feeds))


@dataclass
class OrtProgram:
    """A lowered call with its sessions: what a call through the cache runs (the engine's
    `backend.Program`), and, for a training call, the graph `graph_function`'s autograd
    Functions run (`DifferentiableGraph`)."""

    hooks: RunHooks
    feed_names: list[str]  # the forward graph's inputs, in order: what `run` takes
    lowered: Lowered
    forward_session: _Session
    backward_session: _Session | None
    kept: Any  # dlpack.KeptValues of the module's tensors among forward's feeds
    backward_kept: Any  # and among backward's (the parameters it reads)
    saves_mutated: frozenset[int]  # feeds backward reads that forward also writes
    mutated: frozenset[int]  # every feed forward writes (buffers and inputs, by feed index)
    #: the slots (`Captured.slots`) the training Function returns, in order: all but the
    #: user outputs made on the torch side
    returned: list[int]
    #: slot -> its position among the Function's outputs
    tangent_position: dict[int, int]
    #: slots with a cotangent whose output the Function does not return (an output returned
    #: twice, views of an input aot gave a cotangent): their gradient reaches the base through
    #: autograd, the graph's cotangent for them is zeros
    tangent_zeros: frozenset[int]
    #: Function outputs (by position) that have no gradient: inputs' new values without one
    non_differentiable: frozenset[int]

    torch_nodes: dict[str, int] = field(default_factory=dict)  # none: no torch-calling node
    #: saved values (positions among those backward reads) a staged backward lets go of
    #: after their last stage (`_handed`): forward keeps them for it outside autograd
    handed: frozenset[int] = frozenset()
    #: forward draws from random operators seeded once per session (`Recipe.redraws`)
    redraws: bool = False

    @property
    def cls(self) -> str:
        return self.hooks.module_class

    @property
    def saved_graphs(self) -> dict[str, bytes]:
        graphs: dict[str, bytes] = self.lowered.graphs()
        return graphs

    def undo_point(self, feeds: Sequence[torch.Tensor]) -> Callable[[], None]:
        """The feeds forward writes (buffers, the caller's inputs) as they are now."""
        saved = [(feeds[k], feeds[k].detach().clone()) for k in self.mutated]

        def undo() -> None:
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)

        return undo

    def run(self, feeds: Sequence[torch.Tensor], recompute: bool = False) -> list[torch.Tensor]:
        """One call: through autograd when it needs gradients, else forward alone.
        `recompute`: keep nothing of the forward but its feeds (`recomputing_forward`)."""
        lowered = self.lowered
        if lowered.input_mutations:
            _check_writable(lowered, feeds)
        if self.backward_session is not None and torch.is_grad_enabled():
            # Saved-tensor hooks (activation checkpointing) rerun the whole call to get back
            # what it saved: a graph with dropout would draw another mask there, so it keeps
            # its feeds and seed and reruns itself.
            if not recompute and self.forward_session.draws:
                recompute = _SAVED_TENSOR_HOOKS(False) is not None
            outputs = graph_function.apply(self, feeds, recompute)
            if not lowered.regenerated and not lowered.input_mutations and not lowered.bases:
                return list(outputs)
            slots: list[Any] = [None] * len(lowered.slots)
            for slot, value in zip(self.returned, outputs, strict=True):
                slots[slot] = value
        else:
            slots, _, _ = _forward(self, feeds)
            if not lowered.regenerated and not lowered.input_mutations:
                return slots[: len(lowered.user_outputs)]  # nothing to finish (the hot path)
        return _finish(lowered, feeds, slots)

    # -- graph_function.DifferentiableGraph ---------------------------------------------------
    def forward(self, ctx: Any, feeds: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        slots, outputs, before = _forward(self, feeds)
        returned = _returned(ctx, self, slots)
        ctx.zeros = _zeros(self, feeds, slots)
        saved = []
        for kind, k in self.lowered.backward_inputs:
            if kind == "out":
                saved.append(outputs[k])
            elif kind == "feed":
                saved.append(before.get(k, feeds[k]))
        handed = self.handed
        # Saved-tensor hooks (offloading, checkpointing) must see every saved tensor: then
        # nothing is handed over outside autograd
        ctx.handing = bool(handed) and _SAVED_TENSOR_HOOKS(False) is None
        if ctx.handing:
            ctx.handed = [v for position, v in enumerate(saved) if position in handed]
            saved = [v for position, v in enumerate(saved) if position not in handed]
        # the feeds and outputs backward reads through a view of them: saved for the
        # version check only
        ctx.save_for_backward(
            *saved,
            *[feeds[k] for k in self.lowered.viewed_feeds],
            *[slots[k] for k in self.lowered.viewed_outputs],
        )
        return tuple(returned)

    def backward(self, ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[Any]:
        kept = ctx.saved_tensors  # checks every version, the viewed feeds' too
        if not ctx.handing:
            return _backward(self, ctx, list(kept), grads)
        handed = ctx.handed
        if handed is None:
            raise RuntimeError(_FREED)
        if not _KEEP_GRAPH():  # the call's graph is freed after this backward, as eager's
            ctx.handed = None
        saved: list[torch.Tensor] = []
        taken, held = iter(handed), iter(kept)
        for position in range(len(handed) + len(kept)):
            saved.append(next(taken) if position in self.handed else next(held))
        del taken, held, handed
        return _backward(self, ctx, saved, grads)

    def recomputing_forward(
        self, ctx: Any, feeds: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """Keeps nothing of forward but the feeds (the buffers it updates as it read them)
        and its seed. The rerun in backward writes no buffer: the statistics were updated
        once, by this forward."""
        seed = rng.next_seed() if self.forward_session.draws else None
        slots, _, before = _forward(self, feeds, seed, self.mutated)
        returned = _returned(ctx, self, slots)
        ctx.zeros = _zeros(self, feeds, slots)
        ctx.seed = seed
        # after the buffer updates bumped their versions: a later in-place write to a feed
        # raises in backward, as eager's saved tensors do
        ctx.save_for_backward(*[before.get(k, feed) for k, feed in enumerate(feeds)])
        return tuple(returned)

    def recomputing_backward(self, ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[Any]:
        feeds = ctx.saved_tensors
        # not through the kept values: the saved copies of updated buffers would displace
        # the buffers' own
        outputs = self.forward_session.run(self.cls, "forward", feeds, None, ctx.seed)
        saved = [
            outputs[k] if kind == "out" else feeds[k]
            for kind, k in self.lowered.backward_inputs
            if kind != "tangent"
        ]
        del outputs
        return _backward(self, ctx, saved, grads)


def _check_writable(lowered: Lowered, feeds: Sequence[torch.Tensor]) -> None:
    """Eager's refusal of forward's write into a leaf that requires grad (or a view of one),
    before anything runs."""
    if not torch.is_grad_enabled():
        return
    for k, feed in lowered.input_mutations.items():
        if k in lowered.hidden_mutations:
            continue
        tensor = feeds[feed]
        if tensor.requires_grad and tensor.is_leaf:
            raise RuntimeError(
                "a leaf Variable that requires grad is being used in an in-place operation."
            )
        base = tensor._base
        if base is not None and base.requires_grad and base.is_leaf:
            raise RuntimeError(
                "a view of a leaf Variable that requires grad is being used in an in-place "
                "operation."
            )


def _finish(lowered: Lowered, feeds: Sequence[torch.Tensor], slots: list[Any]) -> list[Any]:
    """The user outputs from the program's slots: forward's writes into the caller's inputs
    applied (`copy_`, seen by autograd as eager's in-place write is, unless forward made it
    under no_grad), and the outputs the torch side makes from their base (`aliasing`)."""
    first_write = len(lowered.user_outputs) + len(lowered.bases)
    grad = torch.is_grad_enabled()
    for j, (k, feed) in enumerate(lowered.input_mutations.items()):
        with torch.set_grad_enabled(grad and k not in lowered.hidden_mutations):
            feeds[feed].copy_(slots[first_write + j])
    pending = dict(lowered.regenerated)
    while pending:
        ready = [
            (k, replay)
            for k, replay in pending.items()
            if replay.source == "feed" or replay.index not in pending
        ]
        if not ready:
            raise ExecutionError("", "outputs alias each other in a cycle", "Report the model")
        for k, replay in ready:
            base = feeds[replay.index] if replay.source == "feed" else slots[replay.index]
            with torch.set_grad_enabled(grad and replay.requires_grad):
                slots[k] = replay.run(base, feeds)
            del pending[k]
    return slots[: len(lowered.user_outputs)]


def instantiate(
    lowered: Lowered,
    hooks: RunHooks,
    device: torch.device,
    settings: session.SessionSettings,
    redraws: bool = False,
) -> OrtProgram:
    """Sessions for both graphs (`redraws`: forward draws what no run can repeat,
    `Recipe.redraws`)."""
    cls = hooks.module_class
    dlpack.use_inference_dlpack()
    facts = lowered.facts
    cuts = lowered.splits
    forward = _session_for(
        lowered.forward,
        facts["forward"],
        lowered.forward_outputs,
        cls,
        device,
        settings,
        "forward",
        cuts.get("forward"),
    )
    backward = None
    if lowered.backward is not None:
        staging = lowered.staging if "backward" not in cuts else None
        backward = _session_for(
            lowered.backward,
            facts["backward"],
            lowered.backward_outputs,
            cls,
            device,
            settings,
            "backward",
            cuts.get("backward"),
            staging,
        )
    written = set(lowered.mutations.values()) | set(lowered.input_mutations.values())
    saved_feeds = {k for kind, k in lowered.backward_inputs if kind == "feed"}
    saves_mutated = saved_feeds & written
    module_feeds = {k for k, f in enumerate(lowered.feeds) if f.kind != "input"}
    # Backward reads the module's tensors as forward saw them (saved feeds, or forward outputs
    # that pass a feed through): the same memory from call to call, so kept as forward's are.
    # A buffer forward updates is left out: it is saved as a fresh copy.
    fixed = module_feeds - set(lowered.mutations.values())
    read_module: set[int] = set()
    for k, (kind, index) in enumerate(lowered.backward_inputs):
        if kind == "out":
            kind, index = lowered.forward_outputs[index]
        if kind in ("feed", "in") and index in fixed:
            read_module.add(k)
    returned = [k for k in range(len(lowered.slots)) if k not in lowered.regenerated]
    position = {slot: k for k, slot in enumerate(returned)}
    tangents = {k for kind, k in lowered.backward_inputs if kind == "tangent"}
    zeros = frozenset(tangents - set(position))
    first_write = len(lowered.user_outputs) + len(lowered.bases)
    return OrtProgram(
        hooks=hooks,
        redraws=redraws,
        feed_names=facts["forward"].inputs,
        lowered=lowered,
        forward_session=forward,
        backward_session=backward,
        kept=_kept(forward, module_feeds),
        backward_kept=_kept(backward, read_module) if backward is not None else None,
        saves_mutated=frozenset(saves_mutated),
        mutated=frozenset(written),
        returned=returned,
        tangent_position=position,
        tangent_zeros=zeros,
        non_differentiable=frozenset(
            position[slot]
            for slot in range(first_write, len(lowered.slots))
            if slot not in tangents
        ),
        torch_nodes=lowered.torch_nodes,
        handed=_handed(lowered) if backward is not None and backward.consumes else frozenset(),
    )


def _handed(lowered: Lowered) -> frozenset[int]:
    """The saved values (by position among those backward reads) that forward's Function
    hands over to a staged backward rather than saving them (`Staging.handed`, chosen by
    `capture`)."""
    assert lowered.staging is not None
    handed = set(lowered.staging.handed)
    names = lowered.facts["backward"].inputs  # one per backward input, in order
    reads = zip(lowered.backward_inputs, names, strict=True)
    saved = [name for (kind, _), name in reads if kind != "tangent"]
    return frozenset(position for position, name in enumerate(saved) if name in handed)


def _kept(session: _Session, values: set[int]) -> dlpack.KeptValues:
    """Kept ORT values for the session's feeds that come from `values` (indices into what
    its caller holds)."""
    return dlpack.KeptValues([j for j, k in enumerate(session.feeds) if k in values])


def _forward(
    program: OrtProgram,
    feeds: Sequence[torch.Tensor],
    seed: int | None = None,
    keep: frozenset[int] | None = None,
) -> tuple[list[Any], list[Any], dict[int, torch.Tensor]]:
    """Run forward (seeded with `seed` when it draws) and update the buffers: the slots
    (`Captured.slots`; None for a user output the torch side makes), all of forward's
    outputs and, by feed index, the written feeds in `keep` (default: those backward reads)
    as forward saw them. Writes into the caller's inputs are left to `_finish`."""
    lowered = program.lowered
    outputs = program.forward_session.run(program.cls, "forward", feeds, program.kept, seed)
    before: dict[int, torch.Tensor] = {}
    if lowered.mutations or lowered.input_mutations:
        keep = program.saves_mutated if keep is None else keep
        with torch.no_grad():
            for feed in keep:
                before[feed] = feeds[feed].clone()
            for k, feed in lowered.mutations.items():
                feeds[feed].copy_(outputs[k])
    return [outputs[k] for k in lowered.slots], outputs, before


def _zeros(
    program: OrtProgram, feeds: Sequence[torch.Tensor], slots: list[Any]
) -> dict[int, tuple[Any, torch.dtype, torch.device]]:
    """Shape, type and device of the zero cotangents (`Program.tangent_zeros`): their outputs
    made from their bases here, without autograd, for the shapes alone."""
    found: dict[int, tuple[Any, torch.dtype, torch.device]] = {}
    if not program.tangent_zeros:
        return found
    values = list(slots)
    with torch.no_grad():
        pending = dict(program.lowered.regenerated)
        while pending:
            for k, replay in list(pending.items()):
                if replay.source == "slot" and replay.index in pending:
                    continue
                base = feeds[replay.index] if replay.source == "feed" else values[replay.index]
                values[k] = replay.run(base.detach(), feeds)
                del pending[k]
    for k in program.tangent_zeros:
        found[k] = (values[k].shape, values[k].dtype, values[k].device)
    return found


def _returned(ctx: Any, program: OrtProgram, slots: list[Any]) -> list[Any]:
    """The outputs a training Function returns, its context told about them: user outputs
    the torch side makes are not among them (`_finish`), an integer output and an input's new
    value without a gradient have none."""
    returned = [slots[k] for k in program.returned]
    ctx.output_info = [(o.shape, o.dtype, o.device) for o in returned]
    ctx.set_materialize_grads(False)
    for position, out in enumerate(returned):
        if not out.is_floating_point() or position in program.non_differentiable:
            ctx.mark_non_differentiable(out)
    return returned


def _backward(
    program: OrtProgram,
    ctx: Any,
    saved: list[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
) -> list[Any]:
    """The backward session on the cotangents and `saved` (forward's values backward reads,
    in `backward_inputs` order; emptied, so that a staged backward holds them alone): one
    gradient (or None) per feed."""
    assert program.backward_session is not None
    saved.reverse()
    values: list[torch.Tensor] = []
    for kind, k in program.lowered.backward_inputs:
        if kind == "tangent":
            position = program.tangent_position.get(k)
            grad = grad_outputs[position] if position is not None else None
            if grad is None:
                shape, dtype, device = (
                    ctx.output_info[position] if position is not None else ctx.zeros[k]
                )
                grad = torch.zeros(shape, dtype=dtype, device=device)
            values.append(grad)
        else:
            values.append(saved.pop())
    grads: list[Any] = program.backward_session.run(
        program.cls, "backward", values, program.backward_kept
    )
    return grads


#: the innermost saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`), or None
_SAVED_TENSOR_HOOKS = torch._C._autograd._top_saved_tensors_default_hooks
#: whether the backward running now keeps the graph (`retain_graph`, `create_graph`)
_KEEP_GRAPH = torch._C._autograd._get_current_graph_task_keep_graph
#: a second backward through a call whose first let go of what it saved: autograd's words
_FREED = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time or if you need to access saved tensors after "
    "calling backward."
)
