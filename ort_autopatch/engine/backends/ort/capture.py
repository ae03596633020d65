"""One call of a module as a forward and a backward FX graph, from torch's autograd.

aot_autograd traces the joint forward + backward graph of the call with fake tensors
(`aot_export_joint_with_descriptors`: no torch.compile, no dynamo guards, no runtime
wrappers), functionalised (in-place buffer updates become extra outputs) and decomposed by the
backend's table, and the min-cut partitioner splits it: the forward returns, after the module's
outputs, what the backward needs (activations, or inputs and parameters it reads). Every
input and output carries a descriptor, so each is mapped to its meaning here (a user input, a
parameter or buffer by qualified name, a buffer's new value, the gradient of a feed) and a
descriptor this backend does not know refuses the call instead of guessing.

Graphs are traced for the shapes of the tensors given: real tensors trace the call's shapes,
fake tensors with symbolic sizes (`symbolic.fake_inputs`) a graph for every size its guards
admit.

One job, the trace itself: the call as a flat module (`_Flat`), aot's trace and partition, and
the descriptors read into a `Captured`. What it enters while it traces (process-wide rewrites
that make a call traceable) is `trace_context`; the passes over the graphs it made are declared
in `passes` (the rewrites themselves are `fx_passes`; what each value the backward reads is,
`linking`; outputs that are views, `aliasing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine import budget, calls, sandbox, tracing
from ort_autopatch.engine.backends.ort import (
    aliasing,
    draws,
    linking,
    passes,
    recurrent,
    stages,
    trace_context,
)
from ort_autopatch.engine.errors import BuildOverBudget, ExportError, UnsupportedModelError
from ort_autopatch.engine.passes import apply as apply_passes


@dataclass(frozen=True)
class Feed:
    """Where one graph input comes from: a user input (flat index) or a module tensor."""

    kind: str  # "input", "param", "buffer"
    where: int | str  # flat input index, or qualified name in the module


@dataclass
class Captured:
    """The partitioned graphs of one call and the meaning of their inputs and outputs."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None  # None: nothing needs a gradient
    feeds: list[Feed]  # per joint input (the forward graph's placeholders, in order)
    output_spec: calls.OutputSpec
    num_user_outputs: int
    #: forward outputs that are a buffer's new value: output index -> qualified buffer name
    mutations: dict[int, str]
    #: forward outputs that are user outputs, in order: output index per user output
    user_outputs: list[int]
    #: what backward reads, in its placeholder order: ("out", forward output index) or
    #: ("feed", feed index) for a value forward passes through unchanged, or ("tangent", k)
    #: for the gradient of user output k
    backward_inputs: list[tuple[str, int]] = field(default_factory=list)
    #: feeds whose memory a value backward reads shares (a view of a parameter, such as its
    #: transpose): saved too, only so autograd's version check sees an in-place change
    viewed_feeds: list[int] = field(default_factory=list)
    #: user outputs whose memory a value backward reads shares (softmax's output, saved as a
    #: detached alias, is a graph output of its own): saved too, so an in-place change of
    #: the output raises autograd's error, as eager's saved output does
    viewed_outputs: list[int] = field(default_factory=list)
    #: forward outputs that are an input's new value (forward wrote into the caller's
    #: tensor): output index -> feed index
    input_mutations: dict[int, int] = field(default_factory=dict)
    #: input mutations that happen where autograd does not see them (under no_grad)
    hidden_mutations: list[int] = field(default_factory=list)
    #: forward outputs that are the base of outputs returned as its views (aot's
    #: intermediate bases): returned by the training Function, never to the user
    bases: list[int] = field(default_factory=list)
    #: user outputs made on the torch side from their base (`aliasing`): an input itself, a
    #: view of an input, of a parameter, of an intermediate base or of another output, or
    #: another output's very tensor. Their gradient reaches the base through autograd,
    #: never through the graphs (which have no cotangent for them), as in eager.
    #: user output -> `aliasing.Replay`
    regenerated: dict[int, Any] = field(default_factory=dict)
    #: feeds that are an earlier feed's very tensor (a weight two modules hold, such as
    #: GPT-2's embedding and output projection): feed index -> the first such feed's index
    tied: dict[int, int] = field(default_factory=dict)

    @property
    def slots(self) -> list[int]:
        """What the program hands back, by slot: the user outputs, the intermediate bases,
        the inputs' new values (forward output index of each); tangents are by slot."""
        return [*self.user_outputs, *self.bases, *self.input_mutations]


class _Flat(torch.nn.Module):
    """The call as a module of flat tensors in, flat tensors out (the user's module as `m`).

    Calling it runs `forward` alone: through `nn.Module.__call__`, the user's global module
    hooks would fire on this wrapper while the trace runs (backward hooks during its joint
    backward), calls the user never made."""

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(*tensors)

    def __init__(
        self, module: torch.nn.Module, forward: Callable[..., Any], spec: calls.CallSpec
    ) -> None:
        super().__init__()
        self.m = module
        self._call = forward
        self._spec = spec
        self.output_spec: calls.OutputSpec | None = None
        #: what each run of the user's forward runs inside (`_watched`)
        self.around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        if remove_duplicate or not recurse:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return self._each_module_once("_parameters", prefix)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if remove_duplicate or not recurse:
            return super().named_buffers(prefix, recurse, remove_duplicate)
        return self._each_module_once("_buffers", prefix)

    def _each_module_once(self, table: str, prefix: str) -> Iterator[tuple[str, Any]]:
        """aot lists the tensors to swap for its stand-ins with `remove_duplicate=False`, so
        a tied weight held by two modules is an input under both names. A module reached by
        two paths (T5's shared embedding is also `encoder.embed_tokens`) would then be swapped
        once per path and restored in the same order, which leaves a stand-in in the module
        after the trace: such a module is listed by its first path alone."""
        for path, module in self.named_modules(prefix=prefix):
            for name, tensor in getattr(module, table).items():
                if tensor is not None:
                    yield (f"{path}.{name}" if path else name), tensor

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = self._spec.rebuild(tensors)
        with self.around():
            result = self._call(self.m, *args, **kwargs)
        self.output_spec, outputs = calls.OutputSpec.of(result)
        return tuple(outputs)


def load_tracer() -> None:
    """Import aot_autograd and its partitioner (most of a fresh process's first trace), so
    that a caller can do so while other work (`offload`) runs."""
    from torch._functorch import aot_autograd, partitioners

    del aot_autograd, partitioners


@contextlib.contextmanager
def _tracing(module: torch.nn.Module) -> Iterator[None]:
    """What a trace of `module`'s call, and its count run, run inside: process-wide rewrites
    that make a call traceable (under the export lock), the module's state kept."""
    with (
        calls.EXPORT_LOCK,  # the rewrites below rebind process-wide state
        calls.preserved_state(module),  # forward's Python RNG draws, a failed trace's writes
        calls.stepping_aside(),
        tracing.export_rewrites(),
        trace_context.traceable_batch_norms(module),
        trace_context.relisted_rnn_weights(),
        trace_context.generic_recurrent_kernels(),
        recurrent.scanned_lstms(),
        trace_context.masks_as_given(),
        trace_context.libraries_tracing(),
        trace_context.real_constants_allowed(),
    ):
        yield


@contextlib.contextmanager
def _watched(flat: _Flat, decisions: draws.Decisions) -> Iterator[None]:
    """While the block traces, each run of the user's forward (aot runs it twice: once to
    learn its outputs, once recording) inside the build's limits (`budget.enforced_fx`) and
    the decisions of branches on draws (`draws`). Both are torch function modes, which see
    every torch function called in Python while they are entered: around aot's whole trace
    they saw ResNet-50's 600 operators among 42000 calls of aot's own (tensor attributes read
    in its fake-tensor and functionalization code, most in the traced backward), 0.1-0.2 s of
    its 1.7 s trace."""

    @contextlib.contextmanager
    def around() -> Iterator[None]:
        with budget.enforced_fx(), decisions.deciding():
            yield

    flat.around = around
    try:
        yield
    finally:
        flat.around = contextlib.nullcontext


def count_operators(
    module: torch.nn.Module,
    forward: Callable[..., Any],
    spec: calls.CallSpec,
    tensors: Sequence[torch.Tensor],
) -> None:
    """The count run `capture` makes first (`budget.count_run`, under the build's limits),
    for a process forked to make it while this one traces (`offload`)."""
    flat = _Flat(module, forward, spec)
    with _tracing(module):
        budget.count_run(lambda: flat(*tensors))


def capture(
    module: torch.nn.Module,
    forward: Callable[..., Any],
    spec: calls.CallSpec,
    tensors: Sequence[torch.Tensor],
    cls: str,
    decompositions: dict[Any, Callable[..., Any]],
    counted: Callable[[bool], None] | None = None,
) -> Captured:
    """Trace and partition one call. Nothing of the module changes: the trace runs on fake
    tensors (BatchNorm's statistics are updated only by running the graph). The call's
    operators are counted against the node limit first (`budget.count_run`), unless another
    process counts them (`count_operators`) and `counted` says its verdict
    (`budget.counted_aside`)."""
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd import descriptors as d
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import is_fake

    sandbox.autograd_forkable()  # before aot's backward on fake tensors
    flat = _Flat(module, forward, spec)
    symbolic = any(map(is_fake, tensors))  # symbolic sizes: `symbolic.fake_inputs`
    try:
        with (
            _lazy_code(),
            _tracing(module),
            contextlib.ExitStack() as stack,  # aot's tracing modes: left before the state check
        ):
            if not symbolic and counted is None:  # a symbolic trace's inputs are fake
                # the trace's first run of forward, in its context: its reads are guards
                budget.count_run(lambda: flat(*tensors))
            decisions = draws.Decisions()
            with (
                budget.counted_aside(counted),
                _watched(flat, decisions),
                trace_context.composites_replaced(decompositions),
            ):
                joint = aot_export_joint_with_descriptors(
                    stack, flat, tuple(tensors), decompositions=decompositions
                )
            gm = joint.graph_module
            apply_passes(passes.JOINT, passes.JointGraph(gm, decisions.any))
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            output = next(n for n in gm.graph.nodes if n.op == "output")
            out_descs = list(output.meta["desc"])
            feeds: list[Feed] = []
            tangent_of: dict[str, Any] = {}
            for node in placeholders:
                desc = node.meta["desc"]
                if isinstance(desc, d.PlainAOTInput):
                    feeds.append(Feed("input", desc.idx))
                elif isinstance(desc, d.ParamAOTInput):
                    feeds.append(Feed("param", _qualified(desc.target)))
                elif isinstance(desc, d.BufferAOTInput):
                    feeds.append(Feed("buffer", _qualified(desc.target)))
                elif isinstance(desc, d.TangentAOTInput):
                    tangent_of[node.name] = desc.output  # by slot, once the outputs are read
                else:
                    raise linking.refuse(cls, f"an input of kind {desc!r}")
            mutations: dict[int, str] = {}
            input_mutations: dict[int, int] = {}
            user_outputs: list[int] = []
            bases: list[int] = []
            num_forward = 0
            position = {feed: k for k, feed in enumerate(feeds)}
            for k, desc in enumerate(out_descs):
                if isinstance(desc, d.GradAOTOutput) or desc is None:
                    continue
                num_forward += 1
                if isinstance(desc, d.PlainAOTOutput):
                    user_outputs.append(k)
                elif isinstance(desc, d.InputMutationAOTOutput) and isinstance(
                    desc.mutated_input, d.BufferAOTInput
                ):
                    mutations[k] = _qualified(desc.mutated_input.target)
                elif isinstance(desc, d.InputMutationAOTOutput) and isinstance(
                    desc.mutated_input, d.PlainAOTInput
                ):
                    input_mutations[k] = position[Feed("input", desc.mutated_input.idx)]
                elif isinstance(desc, d.IntermediateBaseAOTOutput):
                    bases.append(k)
                else:
                    raise linking.refuse(cls, f"an output of kind {desc!r}")
            produced = [*user_outputs, *mutations, *input_mutations, *bases]
            if num_forward != len(produced) or any(k >= num_forward for k in produced):
                raise linking.refuse(cls, "forward outputs after gradients")
            slots = [*user_outputs, *bases, *input_mutations]
            slot_of = {out_descs[k]: slot for slot, k in enumerate(slots)}
            tangents: dict[str, int] = {}
            for name, of in tangent_of.items():
                if of not in slot_of:
                    raise linking.refuse(cls, f"an input of kind TangentAOTInput(output={of!r})")
                tangents[name] = slot_of[of]
            hidden = linking.input_mutations(cls, joint, input_mutations)
            regenerated = aliasing.regenerated(cls, joint, gm, feeds, user_outputs, bases)
            if not tangents:
                forward_gm, backward_gm = gm, None
            else:
                # Without the partitioner's common-subexpression pass, which imports torch's
                # inductor (0.8 s CPU of a fresh process's first build): ONNX Runtime merges
                # a graph's duplicate nodes as it loads it. A transformer layer's and an MLP's
                # graphs came out the same; a CNN's 5 nodes longer (a window reshape twice),
                # its steps within noise.
                with functorch_config.patch(cse=False):
                    forward_gm, backward_gm = min_cut_rematerialization_partition(
                        gm, None, num_fwd_outputs=num_forward
                    )
            budget.check_size(len(forward_gm.graph.nodes), "in the complete trace")
    except (ExportError, UnsupportedModelError, BuildOverBudget):
        raise
    except Exception as exc:
        raise untraceable(cls, exc) from exc
    assert flat.output_spec is not None
    captured = Captured(
        forward=_lazy(forward_gm),
        backward=None if backward_gm is None else _lazy(backward_gm),
        feeds=feeds,
        output_spec=flat.output_spec,
        num_user_outputs=len(user_outputs),
        mutations=mutations,
        user_outputs=user_outputs,
        input_mutations=input_mutations,
        hidden_mutations=hidden,
        bases=bases,
        regenerated=regenerated,
        tied=_tied(module, feeds),
    )
    with _lazy_code():
        apply_passes(
            passes.PARTITIONED,
            passes.PartitionedGraphs(cls, captured, tangents, num_forward, symbolic),
        )
    if captured.backward is not None:
        captured.backward.meta[stages.HANDED] = _handed(captured)
    return captured


def _tied(module: torch.nn.Module, feeds: list[Feed]) -> dict[int, int]:
    """Feeds that are an earlier feed's tensor, by index (`Captured.tied`). aot lists a
    weight held by two modules once per module, so the graph has an input and a gradient
    for each; the module's state holds it once, and every call checks that it still does
    (`ModuleState`): a weight untied later is a new graph."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    first: dict[int, int] = {}
    tied = {}
    for k, feed in enumerate(feeds):
        tensor = tensors.get(str(feed.where)) if feed.kind != "input" else None
        if tensor is None:
            continue
        if id(tensor) in first:
            tied[k] = first[id(tensor)]
        else:
            first[id(tensor)] = k
    return tied


def _handed(captured: Captured) -> frozenset[str]:
    """The backward's inputs the call's Function may hand over to a staged backward
    (`stages`) rather than save: values forward makes that share no memory with an output
    of the call or an input (a view of one, or one's base, may be the same buffer: ORT's
    Reshape returns its input's). The caller's tensors, the module's and the call's outputs
    stay saved, where autograd's version check guards them as eager's saved tensors; and
    letting go of memory something else holds frees nothing (GPT-2's saved transposes of
    its weights, views of the parameters)."""
    assert captured.backward is not None
    outputs = next(n for n in captured.forward.graph.nodes if n.op == "output").args[0]
    seen = {_base(outputs[k]) for k in (*captured.slots, *captured.mutations)}
    names = [n.name for n in captured.backward.graph.nodes if n.op == "placeholder"]
    handed = []
    for name, (kind, k) in zip(names, captured.backward_inputs, strict=True):
        base = _base(outputs[k]) if kind == "out" else None
        if isinstance(base, torch.fx.Node) and base.op != "placeholder" and base not in seen:
            handed.append(name)
    return frozenset(handed)


def _base(value: Any) -> Any:
    """The node whose memory `value` views (itself when it is no view)."""
    while (
        isinstance(value, torch.fx.Node)
        and value.op == "call_function"
        and value.target in linking.VIEWS
    ):
        value = value.args[0]
    return value


def _lazy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` as a graph module that makes its code when first read or run (`_lazy_code`; the
    partitioner makes its graphs eagerly, and the passes rewrite them)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return gm
    return _LazyGraphModule.from_graphmodule(gm)


def _lazy_code() -> contextlib.AbstractContextManager[None]:
    """Graph modules made meanwhile generate their Python code only when it is first read or
    run (torch's `_LazyGraphModule`, as inductor makes them): aot_autograd, the partitioner
    and the passes here make and rewrite graph modules a dozen times over, each one
    generating and compiling the code of the whole graph (0.8 s of BERT-base's first call),
    and the graphs are lowered from their nodes, never run."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # an older or newer torch without it: code made at once
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def describe(exc: BaseException) -> str:
    """An exception as one line: its type and the start of its message."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def untraceable(cls: str, cause: BaseException | str) -> ExportError:
    """The refusal of a call torch could not trace (`cause`: the exception, or its
    `describe` made in another process)."""
    return ExportError(
        cls,
        "torch could not trace the call's forward and backward: "
        + (cause if isinstance(cause, str) else describe(cause)),
        "Run this class eagerly (the default fallback policy does)",
    )


def _qualified(target: str) -> str:
    """The user module's name for a tensor of the wrapper (`m.layer.weight`)."""
    return target[2:] if target.startswith("m.") else target
