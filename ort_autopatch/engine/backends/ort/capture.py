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
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine import budget, calls, tracing
from ort_autopatch.engine.backends.ort import draws, recurrent
from ort_autopatch.engine.errors import BuildOverBudget, ExportError, UnsupportedModelError


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
        result = self._call(self.m, *args, **kwargs)
        self.output_spec, outputs = calls.OutputSpec.of(result)
        return tuple(outputs)


def _math_attention() -> contextlib.AbstractContextManager[Any]:
    """Attention as matmuls and a softmax. Traced with the CPU flash kernel eager picks (whose
    backward `decompositions` has), OPT's zoo entry got gradients 3.4x off eager's: until that
    is understood, the math kernel (a graph that differs from eager on fully masked rows is
    refused by the first-call check, a refusal rather than a wrong number)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


_capturing = threading.local()


@contextlib.contextmanager
def _libraries_tracing() -> Iterator[None]:
    """`torch.compiler.is_compiling()` is True in the capturing thread, as torch.export's
    non-strict trace sets it: libraries then skip their data-dependent shortcuts (transformers
    returns no mask when `torch.all(mask == 1)`, a bool of tensor data, which a trace on fake
    tensors cannot read) for the general computation of the same values. Other threads keep
    the real answer (torch.export sets a process-wide flag: their patched calls would take
    the compiled path meanwhile); the patcher holds the original function."""
    original = torch.compiler.is_compiling

    def is_compiling() -> bool:
        return bool(getattr(_capturing, "active", False)) or original()

    _capturing.active = True
    try:
        with tracing._swapped(torch.compiler, "is_compiling", is_compiling):
            yield
    finally:
        _capturing.active = False


def _no_causal_hint(mask: Any, is_causal: bool | None = None, size: Any = None) -> bool:
    return is_causal is True


def _masks_as_given() -> contextlib.AbstractContextManager[None]:
    """`nn.TransformerEncoder`/`Decoder` given a mask and no `is_causal` compare the mask
    with a causal one (a bool of tensor data, which a trace on fake tensors cannot read) to
    pass attention a hint. The hint only picks between two computations of the same values
    (a causal attention, or the mask itself), so for the trace the mask is used as given."""
    from torch.nn.modules import transformer

    return tracing._swapped(transformer, "_detect_is_causal_mask", _no_causal_hint)


@contextlib.contextmanager
def _generic_recurrent_kernels() -> Iterator[None]:
    """LSTMs as their gates' matmuls and activations, step by step: on CPU they otherwise
    trace to oneDNN's fused layer (`mkldnn_rnn_layer`), which has no ONNX form. torch's
    switch is process-wide: an eager call in another thread meanwhile takes the generic
    kernels too, with the same values. (`torch.backends.mkldnn.flags` would warn about TF32.)"""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def _relisted_rnn_weights() -> Iterator[None]:
    """Recurrent modules (LSTM, GRU) run on a list of their weights, re-listed in forward
    when the parameters are other objects than those listed, as they are while aot traces (its
    stand-ins). That re-listing is a write of forward (`_flat_weight_refs`, refused as a side
    effect a graph cannot replay) which would leave the module pointing at the stand-ins. For
    the trace, the list alone is replaced, unseen by the side-effect recorder, and put back."""
    relisted: list[tuple[torch.nn.RNNBase, Any]] = []

    def relist(self: torch.nn.RNNBase) -> None:
        if self._weights_have_changed():
            relisted.append((self, vars(self)["_flat_weights"]))
            vars(self)["_flat_weights"] = [
                getattr(self, name, None) for name in self._flat_weights_names
            ]

    try:
        with tracing._swapped(torch.nn.RNNBase, "_update_flat_weights", relist):
            yield
    finally:
        for module, weights in reversed(relisted):
            vars(module)["_flat_weights"] = weights


@contextlib.contextmanager
def _traceable_batch_norms(module: torch.nn.Module) -> Iterator[None]:
    """BatchNorms with `momentum=None` (a cumulative average) compute their update factor with
    `float(num_batches_tracked)`, which a trace on fake tensors cannot read. For the trace,
    such a module in training runs eager's arithmetic with the factor as a tensor: the same
    normalisation, and the same running statistics (updated in place, so they become the
    graph's buffer updates)."""
    swapped = []
    for sub in module.modules():
        if (
            isinstance(sub, torch.nn.modules.batchnorm._BatchNorm)
            and sub.momentum is None
            and sub.training
            and sub.track_running_stats
            and "forward" not in sub.__dict__
        ):
            sub.__dict__["forward"] = functools.partial(_cumulative_batch_norm, sub)
            swapped.append(sub)
    try:
        yield
    finally:
        for sub in swapped:
            del sub.__dict__["forward"]


def _cumulative_batch_norm(
    bn: torch.nn.modules.batchnorm._BatchNorm, x: torch.Tensor
) -> torch.Tensor:
    assert bn.num_batches_tracked is not None
    assert bn.running_mean is not None and bn.running_var is not None
    bn._check_input_dim(x)
    bn.num_batches_tracked.add_(1)
    factor = 1.0 / bn.num_batches_tracked
    out = torch.nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    with torch.no_grad():
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x, dims, correction=1)
        bn.running_mean.lerp_(mean, factor)
        bn.running_var.lerp_(var, factor)
    return out


@contextlib.contextmanager
def real_constants_allowed() -> Iterator[None]:
    """Tensors forward reads that are neither the call's inputs nor the module's parameters
    and buffers (a plain tensor attribute: a cached mask, a carried-over hidden state) are
    constants of the graph, as the training build's trace bakes them: fake tensor modes in
    this thread (the trace's, and the exporter's type promotion pass) take them as they are.
    The call key guards each attribute by identity and version, so a new tensor or an
    in-place change selects another graph."""
    from torch._subclasses.fake_tensor import fake_tensor_tls

    previous = fake_tensor_tls.allow_non_fake_inputs_override
    fake_tensor_tls.allow_non_fake_inputs_override = True
    try:
        yield
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = previous


@contextlib.contextmanager
def composites_replaced(decompositions: Mapping[Any, Callable[..., Any]]) -> Iterator[None]:
    """The table's entries marked `before_autograd` (composite operators, whose ATen kernel
    runs above autograd, where no decomposition table is read) as the operators' Python
    composite kernels, as torch registers its own (`py_impl(CompositeImplicitAutograd)`):
    aot_autograd traces under the Python dispatcher, which takes them in place of ATen's,
    and autograd differentiates what they call. Process-wide while it lasts, but read only
    where the Python dispatcher is on (a trace; torch.compile in another thread meanwhile
    would trace the same values); callers hold `calls.EXPORT_LOCK`. Put back as found."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    replaced = [
        (op, kernel)
        for op, kernel in decompositions.items()
        if getattr(kernel, "before_autograd", False)
    ]
    before = [(op, op.py_kernels.get(key)) for op, _ in replaced]
    try:
        for op, kernel in replaced:
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
        yield
    finally:
        for op, kernel in before:
            if kernel is None:
                op.py_kernels.pop(key, None)
            else:
                op.py_kernels[key] = kernel
            op._dispatch_cache.clear()


def load_tracer() -> None:
    """Import aot_autograd and its partitioner (most of a fresh process's first trace), so
    that a caller can do so while other work (`offload`) runs."""
    from torch._functorch import aot_autograd, partitioners

    del aot_autograd, partitioners


def capture(
    module: torch.nn.Module,
    forward: Callable[..., Any],
    spec: calls.CallSpec,
    tensors: Sequence[torch.Tensor],
    cls: str,
    decompositions: dict[Any, Callable[..., Any]],
) -> Captured:
    """Trace and partition one call. Nothing of the module changes: the trace runs on fake
    tensors (BatchNorm's statistics are updated only by running the graph)."""
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd import descriptors as d
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import is_fake

    flat = _Flat(module, forward, spec)
    try:
        with (
            calls.EXPORT_LOCK,  # the rewrites below rebind process-wide state
            calls.preserved_state(module),  # forward's Python RNG draws, a failed trace's writes
            contextlib.ExitStack() as stack,  # aot's tracing modes: left before the state check
            calls.stepping_aside(),
            tracing.export_rewrites(),
            _math_attention(),
            _traceable_batch_norms(module),
            _relisted_rnn_weights(),
            _generic_recurrent_kernels(),
            recurrent.scanned_lstms(),
            _masks_as_given(),
            _libraries_tracing(),
            real_constants_allowed(),
        ):
            if not any(map(is_fake, tensors)):  # a symbolic trace's are
                # the trace's first run of forward, in its context: its reads are guards
                budget.count_run(lambda: flat(*tensors))
            with (
                budget.enforced_fx(),
                draws.decided() as decisions,
                composites_replaced(decompositions),
            ):
                joint = aot_export_joint_with_descriptors(
                    stack, flat, tuple(tensors), decompositions=decompositions
                )
            gm = joint.graph_module
            if decisions.any:  # LayerDrop's draws: read by the branch alone
                draws.drop_unread_draws(gm)
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
                    raise _refuse(cls, f"an input of kind {desc!r}")
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
                    raise _refuse(cls, f"an output of kind {desc!r}")
            produced = [*user_outputs, *mutations, *input_mutations, *bases]
            if num_forward != len(produced) or any(k >= num_forward for k in produced):
                raise _refuse(cls, "forward outputs after gradients")
            slots = [*user_outputs, *bases, *input_mutations]
            slot_of = {out_descs[k]: slot for slot, k in enumerate(slots)}
            tangents: dict[str, int] = {}
            for name, of in tangent_of.items():
                if of not in slot_of:
                    raise _refuse(cls, f"an input of kind TangentAOTInput(output={of!r})")
                tangents[name] = slot_of[of]
            hidden = _input_mutations(cls, joint, input_mutations)
            regenerated = _regenerated(cls, joint, gm, feeds, user_outputs, bases)
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
        raise ExportError(
            cls,
            f"torch could not trace the call's forward and backward: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
            "Run this class eagerly (the default fallback policy does)",
        ) from exc
    assert flat.output_spec is not None
    for graph in (forward_gm, backward_gm):
        if graph is not None:
            _real_constants(cls, graph)
    captured = Captured(
        forward=forward_gm,
        backward=backward_gm,
        feeds=feeds,
        output_spec=flat.output_spec,
        num_user_outputs=len(user_outputs),
        mutations=mutations,
        user_outputs=user_outputs,
        input_mutations=input_mutations,
        hidden_mutations=hidden,
        bases=bases,
        regenerated=regenerated,
    )
    if backward_gm is not None:
        _link(captured, forward_gm, backward_gm, tangents, num_forward)
        _pass_feeds_through(forward_gm, num_forward)
    _drop_regenerated(forward_gm, [user_outputs[k] for k in regenerated])
    for graph in (forward_gm, backward_gm):
        if graph is not None:
            _sums_without_kept_dims(graph)
            _int64_indices(graph)
    return captured


def _permutation(node: torch.fx.Node, rank: int) -> list[int] | None:
    """The dimensions of `node`'s input each of its output dimensions is, or None."""
    if node.op != "call_function":
        return None
    dims = list(range(rank))
    args: Any = node.args
    if node.target is _aten.t.default:
        return dims[::-1]
    if node.target is _aten.transpose.int:
        a, b = (int(d) % rank if rank else 0 for d in args[1:3])
        dims[a], dims[b] = dims[b], dims[a]
        return dims
    if node.target is _aten.permute.default:
        return [int(d) % rank for d in args[1]]
    return None


def _unpermuted(node: Any) -> torch.fx.Node | None:
    """The forward input `node` is, dimension for dimension, through transposes that undo
    each other (`t(t(w))`), or None."""
    if not isinstance(node, torch.fx.Node) or node.op == "placeholder":
        return None
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    order = list(range(value.dim()))  # output dim i is dim order[i] of the current node
    while (perm := _permutation(node, len(order))) is not None:
        order = [perm[i] for i in order]
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return None
    if node.op != "placeholder" or order != list(range(len(order))):
        return None
    return node


def _pass_feeds_through(forward: torch.fx.GraphModule, num_forward: int) -> None:
    """A saved value that is a forward input itself, transposed back and forth (the MLP's
    `t(t(fc2.weight))`, which the partitioner saves for the input gradient), is saved as that
    input: the program then hands the parameter to backward from the torch side (kept as its
    ORT value from call to call) instead of ORT copying it into a new output every call
    (an `Identity` node, 25 us of the MLP's 430 us forward run)."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    dropped = []
    for k in range(num_forward, len(outs)):
        source = _unpermuted(outs[k])
        if source is not None:
            dropped.append(outs[k])
            outs[k] = source
    if not dropped:
        return
    output.args = (tuple(outs),)
    while dropped:  # the transposes nothing reads any more
        node = dropped.pop()
        if node.op == "call_function" and not node.users:
            dropped.extend(n for n in node.all_input_nodes if n not in dropped)
            forward.graph.erase_node(node)
    forward.recompile()


def _real_constants(cls: str, gm: torch.fx.GraphModule) -> None:
    """Tensors forward made from data (`torch.tensor(1.0)`, transformers' masks and empty
    caches) are the graph's constants, held as the trace's fake tensors: each is replaced by
    the real value the fake one carries (the translator reads it from the node's `val`).
    Tensors forward read from attributes are constants as they are (`real_constants_allowed`);
    one that requires grad is refused in grad mode: eager would give it a gradient, and a
    constant has none."""
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        if isinstance(value, FakeTensor):
            if value.constant is None:
                raise _refuse(cls, f"a constant tensor of {tuple(value.shape)} made in forward")
            value = value.constant
            setattr(gm, node.target, value)
        elif isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
            raise UnsupportedModelError(
                cls,
                f"forward reads a tensor of {tuple(value.shape)} that requires grad and is "
                "neither an input nor a parameter: a graph would hold it as a constant, "
                "without its gradient",
                "It runs in PyTorch; make it an nn.Parameter or pass it as an argument",
            )
        if isinstance(value, torch.Tensor):
            node.meta["val"] = value  # what the exporter's translator reads


def _input_mutations(cls: str, joint: Any, input_mutations: dict[int, int]) -> list[int]:
    """Forward writes into the caller's tensors: each a data write (a metadata change, such
    as `t_()` or `resize_`, is refused); those autograd does not see (a write under
    no_grad) are returned, by forward output index."""
    infos = joint._aot_state.fw_metadata.input_info
    hidden = []
    for k, feed in input_mutations.items():
        info = infos[feed]
        if info.mutates_metadata or info.mutates_storage_metadata:
            raise _refuse(cls, f"a write changing the shape or storage of input {feed}")
        if info.mutations_hidden_from_autograd or info.mutations_under_no_grad_or_inference_mode:
            hidden.append(k)
    return hidden


def _regenerated(
    cls: str,
    joint: Any,
    gm: torch.fx.GraphModule,
    feeds: list[Feed],
    user_outputs: list[int],
    bases: list[int],
) -> dict[int, Any]:
    """The user outputs made on the torch side from their base, by aot's analysis of the
    outputs (`aliasing`): inputs returned as they are, views of inputs, parameters,
    intermediates or other outputs, and an output returned twice."""
    from torch._functorch._aot_autograd.schemas import OutputType

    from ort_autopatch.engine.backends.ort import aliasing

    infos = joint._aot_state.fw_metadata.output_info
    if len(infos) != len(user_outputs):
        raise _refuse(cls, f"{len(infos)} outputs by aot's count, {len(user_outputs)} by ours")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][: len(feeds)]
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    own = (OutputType.non_alias, OutputType.unsafe_view_alias, OutputType.custom_function_view)
    first: dict[Any, int] = {}  # a graph value -> the first user output that is it
    regenerated: dict[int, Any] = {}
    for k, info in enumerate(infos):
        node, kind = outs[user_outputs[k]], info.output_type
        if kind in own:
            root = _viewed_input(node, placeholders)
            if root is not None:  # views of an input aot hides from autograd (x.chunk(3))
                source, index, base = "feed", placeholders.index(root), root
            elif node not in first:
                first[node] = k
                continue
            else:
                source, index, base = "slot", first[node], node  # returned twice: one tensor
        elif kind in (OutputType.is_input, OutputType.alias_of_input):
            source, index, base = "feed", info.base_idx, placeholders[info.base_idx]
        elif kind in (
            OutputType.alias_of_intermediate,
            OutputType.alias_of_intermediate_save_as_output,
        ):
            slot = len(user_outputs) + info.base_idx
            source, index, base = "slot", slot, outs[bases[info.base_idx]]
        elif kind is OutputType.alias_of_intermediate_base_is_user_output:
            source, index, base = "slot", info.base_idx, outs[user_outputs[info.base_idx]]
        else:
            raise _refuse(cls, f"output {k} that aliases other memory ({kind.name})")
        try:
            steps = aliasing.chain(base, node, placeholders)
        except aliasing.NotAView as exc:
            raise _refuse(
                cls, f"output {k} that aliases other memory ({kind.name}) through {exc}"
            ) from exc
        regenerated[k] = aliasing.Replay(source, int(index), steps, bool(info.requires_grad))
    return regenerated


def _viewed_input(node: Any, placeholders: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The input `node` is a view of, through views and their items alone, or None.
    aot's analysis calls multi-output views of an input (`x.chunk(3)`, `x.unbind()`) outputs
    of their own, which eager returns as views of the input."""
    from ort_autopatch.engine.backends.ort import aliasing

    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if aliasing._name(node.target) is None or not node.args:
            return None
        node = node.args[0]
    if node is not None and node in placeholders and node.meta.get("val") is not None:
        return node
    return None


def _drop_regenerated(forward: torch.fx.GraphModule, outputs: list[int]) -> None:
    """The forward graph's outputs the torch side makes (`Captured.regenerated`) are None
    in it: ONNX Runtime neither computes nor copies them; the views only they read go."""
    from ort_autopatch.engine.backends.ort import aliasing

    if not outputs:
        return
    output = next(n for n in forward.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    dropped = []
    for k in outputs:
        if isinstance(outs[k], torch.fx.Node) and outs[k].op != "placeholder":
            dropped.append(outs[k])
        outs[k] = None
    output.args = (tuple(outs),)
    while dropped:
        node = dropped.pop()
        if node.op == "call_function" and not node.users and aliasing._name(node.target):
            dropped.extend(n for n in node.all_input_nodes if n not in dropped)
            forward.graph.erase_node(node)
    forward.recompile()


_aten = torch.ops.aten
#: operators whose output is a view of their first input (eager saves the input's memory)
_VIEWS = frozenset(
    {
        _aten.t.default,
        _aten.transpose.int,
        _aten.permute.default,
        _aten.view.default,
        _aten._unsafe_view.default,
        _aten.reshape.default,
        _aten.expand.default,
        _aten.unsqueeze.default,
        _aten.squeeze.dim,
        _aten.squeeze.dims,
        _aten.detach.default,
        _aten.alias.default,
        _aten.slice.Tensor,
        _aten.select.int,
    }
)


def _qualified(target: str) -> str:
    """The user module's name for a tensor of the wrapper (`m.layer.weight`)."""
    return target[2:] if target.startswith("m.") else target


def _refuse(cls: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        cls,
        f"the call's autograd graph has {what}, which the plain backend does not map",
        "Run this class eagerly (the default fallback policy does) and report the model",
    )


def _link(
    captured: Captured,
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    tangents: dict[str, int],
    num_forward: int,
) -> None:
    """Name what the backward reads, by the partitioner's naming (a saved value keeps the
    name of the forward node that made it). Backward's outputs need no map: the partitioner
    gives it one per joint input, in order (None for an input without a gradient)."""
    forward_inputs = {n.name: k for k, n in enumerate(forward.graph.nodes) if n.op == "placeholder"}
    forward_outputs = {
        getattr(node, "name", None): k
        for k, node in enumerate(next(n for n in forward.graph.nodes if n.op == "output").args[0])
    }
    reads: list[tuple[str, int]] = []
    for node in backward.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in tangents:
            reads.append(("tangent", tangents[node.name]))
        elif node.name in forward_outputs and forward_outputs[node.name] >= num_forward:
            reads.append(("out", forward_outputs[node.name]))
        elif node.name in forward_inputs:
            reads.append(("feed", forward_inputs[node.name]))
        else:
            raise ExportError(
                "",
                f"the backward graph reads {node.name!r}, which forward does not provide",
                "Report the model",
            )
    captured.backward_inputs = reads
    producers = {n.name: n for n in forward.graph.nodes}
    outputs_in_order = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    user_nodes: dict[Any, int] = {}
    for n, k in enumerate(captured.slots):
        user_nodes.setdefault(outputs_in_order[k], n)
    viewed: set[int] = set()
    viewed_outputs: set[int] = set()
    for kind, k in reads:
        if kind != "out":
            continue
        node = outputs_in_order[k]
        while node is not None and node.op == "call_function" and node.target in _VIEWS:
            if node in user_nodes:
                viewed_outputs.add(user_nodes[node])
            node = node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
        if node is not None and node in user_nodes:
            viewed_outputs.add(user_nodes[node])
        if node is not None and node.op == "placeholder" and node.name in producers:
            viewed.add(forward_inputs[node.name])
    captured.viewed_feeds = sorted(viewed - set(captured.input_mutations.values()))
    captured.viewed_outputs = sorted(viewed_outputs - set(captured.regenerated))
    outputs = next(n for n in backward.graph.nodes if n.op == "output").args[0]
    if len(outputs) != len(captured.feeds):
        raise ExportError(
            "",
            f"the backward graph has {len(outputs)} outputs for {len(captured.feeds)} inputs",
            "Report the model",
        )


_RESHAPES = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default})


def _sums_without_kept_dims(gm: torch.fx.GraphModule) -> None:
    """`sum(x, dims, keepdim=True)` read only by a view dropping those dims (a bias's
    gradient, as the partitioner writes it) becomes `sum(x, dims)`: one ReduceSum without
    the Reshape behind it, the same numbers. Runs after `_link`: outputs keep their places."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _aten.sum.dim_IntList:
            continue
        if len(node.args) < 3 or node.args[2] is not True or len(node.users) != 1:
            continue
        (view,) = node.users
        value, viewed = node.meta.get("val"), view.meta.get("val")
        if view.target not in _RESHAPES or view.args[0] is not node:
            continue
        if not isinstance(value, torch.Tensor) or not isinstance(viewed, torch.Tensor):
            continue
        rank = value.dim()
        dims = {d % rank for d in node.args[1]} if node.args[1] else set(range(rank))
        kept = [size for k, size in enumerate(value.shape) if k not in dims]
        if len(kept) != viewed.dim() or not all(
            statically_known_true(a == b) for a, b in zip(kept, viewed.shape, strict=True)
        ):
            continue
        with gm.graph.inserting_after(node):
            summed = gm.graph.call_function(
                _aten.sum.dim_IntList, (node.args[0], node.args[1], False), dict(node.kwargs)
            )
        summed.meta = dict(view.meta)
        view.replace_all_uses_with(summed)
        gm.graph.erase_node(view)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


#: operators taking a list of index tensors, which ONNX (GatherND, ScatterND) reads as int64
_INDEXING = frozenset(
    {
        _aten.index.Tensor,
        _aten._unsafe_index.Tensor,
        _aten.index_put.default,
        _aten._unsafe_index_put.default,
    }
)


def _int64_indices(gm: torch.fx.GraphModule) -> None:
    """Index tensors of type int32 (torch's own `unfold_backward` decomposition indexes
    with an int32 `arange`; eager takes either type) become int64: ONNX's GatherND and
    ScatterND take int64 indices alone, and ONNX Runtime refused the graph ("Type
    'tensor(int32)' of input parameter ... of operator (ScatterND)")."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _INDEXING:
            continue
        indices = list(node.args[1])
        for k, index in enumerate(indices):
            value = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int32:
                continue
            with gm.graph.inserting_before(node):
                wide = gm.graph.call_function(
                    _aten._to_copy.default, (index,), {"dtype": torch.int64}
                )
            wide.meta = dict(index.meta)
            wide.meta["val"] = value.to(torch.int64)
            indices[k] = wide
            changed = True
        node.args = (node.args[0], indices, *node.args[2:])
    if changed:
        gm.recompile()
