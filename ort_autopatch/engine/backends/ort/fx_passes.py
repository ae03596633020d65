"""The rewrites of a capture's partitioned FX graphs, each a function of one graph.

One job: turn the forward and backward graphs aot_autograd's partitioner made into graphs that
ONNX Runtime runs, and runs fast, with the same numbers: constants made real, int32 indices
widened, reductions without a reshape behind them, saved parameters handed over instead of
copied, saved views made again in backward, an activation its gradient alone reads saved as its
mask, a gradient's masks multiplied once, values scattered into zeros and added to a sum
scattered into the sum, a cross entropy's two gradients made one. They run after the trace, in
the order `passes` declares (after the linking of the graphs' inputs and outputs, `linking`),
on graphs nothing else holds yet; each is tested on its own graphs
(tests/test_plain_backend.py, and the activations' in tests/test_plain_activations.py, the
cross entropy's in tests/test_plain_losses.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ort_autopatch.engine.backends.ort import activations, losses
from ort_autopatch.engine.backends.ort.linking import refuse
from ort_autopatch.engine.errors import UnsupportedModelError

_aten = torch.ops.aten


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


def pass_feeds_through(forward: torch.fx.GraphModule, num_forward: int) -> None:
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


#: copies and aliases: forward need not write them out for backward, where ONNX Runtime
#: drops them (an Identity between two nodes)
_COPIES = frozenset({_aten.clone.default, _aten.detach.default, _aten.alias.default})


def _replayable(node: torch.fx.Node) -> bool:
    """`node` is a view backward can make again from its input alone: a reshape to static
    sizes, a transposition, an expansion to the size it has, or a copy."""
    args: Any = node.args
    if node.target in _RESHAPES:
        sizes = args[1] if len(args) > 1 else None
        return isinstance(sizes, (list, tuple)) and all(type(size) is int for size in sizes)
    if node.target is _aten.expand.default:  # to its own size (attention's batched products)
        value, source = node.meta.get("val"), getattr(args[0], "meta", {}).get("val")
        return (
            isinstance(value, torch.Tensor)
            and isinstance(source, torch.Tensor)
            and (value.shape == source.shape and all(type(size) is int for size in args[1]))
        )
    return node.target in _TRANSPOSES or node.target in _COPIES


def _written(node: Any) -> bool:
    """ONNX Runtime writes `node`'s value into a buffer of its own: no feed, and no view it
    would copy to hand it out (a Reshape, a same-size Expand, an Identity)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    return not _replayable(node) or node.target in _TRANSPOSES


def _view_chain(
    node: Any, outs: list[Any], unwritten: frozenset[torch.fx.Node] = frozenset()
) -> list[torch.fx.Node] | None:
    """The views from a value forward writes to the saved value `node`, the saved one first,
    or None when `node` is not such a chain. The chain ends at a transposition that forward
    makes anyway (read by another of its nodes): backward would write it again. A chain may
    also start at a feed in `unwritten` (a parameter: no run writes into it)."""
    if outs.count(node) != 1:
        return None  # also a user's output: forward makes it anyway
    chain: list[torch.fx.Node] = []
    shared = False  # a view of the chain so far is read by forward too
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and _replayable(node):
        if node.target in _TRANSPOSES and (shared or len(node.users) != 1):
            break
        chain.append(node)
        shared = shared or len(node.users) != 1
        node = node.args[0]
    while chain and not _written(node) and node not in unwritten:
        node = chain.pop()  # a feed (forward may write into it: the copy keeps what it read)
    if not chain or node in outs or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    # Views valid on the base's strides in forward are valid again on them in backward, and
    # on the contiguous tensor ONNX Runtime hands over.
    return chain


def save_bases_of_views(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    reads: list[tuple[str, int]],
    parameters: frozenset[torch.fx.Node] = frozenset(),
) -> None:
    """A saved value that is a chain of views (reshapes to static sizes, transpositions) of a
    value forward computes is saved as that value, and backward makes the views
    again. ONNX Runtime writes out every view that is a graph output: a Reshape's copy (292
    us for 4 MB, against 7 us when the Reshape's input is the graph output) where the
    partitioner saves a linear layer's reshaped input, and a Transpose where it saves the
    transposed operands of attention's batched products for their gradients (four in a
    transformer layer, 0.8 ms of its forward), which backward's matrix products take
    transposed for free (ONNX Runtime fuses a Transpose into the MatMul that reads it).
    `reads` are backward's inputs (`linking.link`): the placeholder of each saved value keeps
    its place and name, and holds the base. A view of a parameter (forward's placeholders in
    `parameters`, which no run writes into) is saved as the parameter: the partitioner saves
    the transposes of GPT-2's Conv1D weights for the input gradients, 27 MiB copied and held
    a layer a step."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(reads):
        return
    moved = []
    for placeholder, (kind, k) in zip(placeholders, reads, strict=True):
        chain = _view_chain(outs[k], outs, parameters) if kind == "out" else None
        if chain is None:
            continue
        base = chain[-1].args[0]
        assert isinstance(base, torch.fx.Node)
        outs[k] = base
        moved.append(chain[0])
        readers = list(placeholder.users)
        again, anchor = placeholder, placeholders[-1]
        for view in reversed(chain):
            if view.target is _aten.expand.default:
                continue  # the same value and strides: ONNX Runtime would copy it
            with backward.graph.inserting_after(anchor):
                target: Any = view.target
                again = anchor = backward.graph.call_function(
                    target, (again, *view.args[1:]), dict(view.kwargs)
                )
            again.meta = dict(view.meta)
        for user in readers:
            user.replace_input_with(placeholder, again)
        placeholder.meta = {**placeholder.meta, "val": base.meta["val"]}
        placeholder.meta.pop("tensor_meta", None)
    if not moved:
        return
    output.args = (tuple(outs),)
    for node in moved:
        # the views nothing reads any more, back to the saved value
        while _replayable(node) and not node.users:
            source = node.args[0]
            forward.graph.erase_node(node)
            if not isinstance(source, torch.fx.Node):
                break
            node = source
    forward.recompile()
    backward.recompile()


def real_constants(cls: str, gm: torch.fx.GraphModule) -> None:
    """Tensors forward made from data (`torch.tensor(1.0)`, transformers' masks and empty
    caches) are the graph's constants, held as the trace's fake tensors: each is replaced by
    the real value the fake one carries (the translator reads it from the node's `val`).
    Tensors forward read from attributes are constants as they are
    (`trace_context.real_constants_allowed`); one that requires grad is refused in grad mode:
    eager would give it a gradient, and a constant has none."""
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        if isinstance(value, FakeTensor):
            if value.constant is None:
                raise refuse(cls, f"a constant tensor of {tuple(value.shape)} made in forward")
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


_RESHAPES = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default})
_TRANSPOSES = frozenset({_aten.t.default, _aten.transpose.int, _aten.permute.default})


def sums_without_kept_dims(gm: torch.fx.GraphModule) -> None:
    """`sum(x, dims, keepdim=True)` read only by a view dropping those dims (a bias's
    gradient, as the partitioner writes it) becomes `sum(x, dims)`: one ReduceSum without
    the Reshape behind it, the same numbers. Runs after `linking.link`: outputs keep their
    places."""
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


def detaches_read_through(gm: torch.fx.GraphModule) -> None:
    """Operators reading a `detach` or an `alias` read its input instead: the graphs run
    without autograd, where both are their input, and ONNX Runtime copies the Identity they
    become wherever its value leaves a graph (a backward cut into `stages`: GPT-2 small's
    log-softmax, 51 MB, 8 ms a step). The graph's outputs keep theirs: an output that is an
    input would hand back the caller's own tensor."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _ALIASES:
            continue
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            continue
        for user in list(node.users):
            if user.op != "output":
                user.replace_input_with(node, source)
                changed = True
        if not node.users:
            gm.graph.erase_node(node)
    if changed:
        gm.recompile()


#: operators that are their input, for a graph run without autograd
_ALIASES = frozenset({_aten.detach.default, _aten.alias.default})
#: operators that change a tensor's shape alone, the elements in the same order
_SHAPE_ONLY = _RESHAPES | frozenset(
    {_aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default}
)
#: views that are their input itself where their shape is the input's
_ITSELF_AT_OWN_SHAPE = _SHAPE_ONLY | frozenset({_aten.expand.default})


def _static_sizes(node: Any) -> list[int] | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not all(type(s) is int for s in value.shape):
        return None
    return list(value.shape)


def _as_output(gm: torch.fx.GraphModule, node: torch.fx.Node, start: torch.fx.Node) -> bool:
    """Where `node` is a graph output, make `start` that output instead, if it may be: an
    output once, and `start` computed in the graph and no other output (an input's view, or
    one value output twice, keeps its own node). Whether `node`'s uses may now go to
    `start`."""
    output = gm.graph.find_nodes(op="output")[0]
    if output not in node.users:
        return True
    single = not isinstance(output.args[0], (list, tuple))  # make_fx's graph of one value
    outs = [output.args[0]] if single else list(output.args[0])
    if start.op != "call_function" or start in outs or outs.count(node) != 1:
        return False
    outs[outs.index(node)] = start
    output.args = (outs[0] if single else tuple(outs),)
    return True


def reshape_chains_as_one(gm: torch.fx.GraphModule) -> None:
    """A chain of reshapes, unsqueezes and squeezes is one reshape of the value it starts
    from, and none where that value already has the chain's shape. BatchNorm's gradient
    makes each per-channel value (C,) and then (1, C, 1, 1) one unsqueeze at a time, and
    its saved mean goes (1, C, 1, 1) -> (C,) -> (1, C, 1, 1): ONNX Runtime runs every step
    as a node of its own (13 of a small CNN's 137 nodes). Only static sizes, and a
    contiguous start, on which the one view is valid in torch too. A graph output that is
    the value itself becomes that value where it is computed in the graph and is no other
    output; else it stays a node of its own (an input's view, or one value output twice).

    An expand to the shape its value has is that value too: the decomposition of a batched
    matmul expands both operands to the batch shape they have already, and ONNX Runtime's
    Expand writes a copy each time (GPT-2 small: 15 copies of 0.4 to 1.5 MiB a layer)."""
    changed = False
    for node in list(gm.graph.nodes):  # in order: a chain folds into its last node
        if node.op != "call_function" or node.target not in _SHAPE_ONLY:
            continue
        inner = node.args[0]
        if not isinstance(inner, torch.fx.Node) or inner.op != "call_function":
            continue
        if inner.target not in _SHAPE_ONLY:
            continue
        start, sizes = inner.args[0], _static_sizes(node)
        value = start.meta.get("val") if isinstance(start, torch.fx.Node) else None
        if sizes is None or not isinstance(value, torch.Tensor) or not value.is_contiguous():
            continue
        node.target, node.args, node.kwargs = _aten.view.default, (start, sizes), {}
        if not inner.users:
            gm.graph.erase_node(inner)
        changed = True
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _ITSELF_AT_OWN_SHAPE:
            continue
        start, sizes = node.args[0], _static_sizes(node)
        if not isinstance(start, torch.fx.Node) or sizes is None or sizes != _static_sizes(start):
            continue
        if not _as_output(gm, node, start):
            continue
        node.replace_all_uses_with(start)  # the value itself, shape and all
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


def transposes_composed(gm: torch.fx.GraphModule) -> None:
    """Transposes of a transpose are one permute of the value they start from, and none
    where they undo each other. The gradient of a weight used transposed (a tied output
    embedding, `logits = h @ wte.t()`) came out as `t(t(mm(...)))`: ONNX Runtime copied
    GPT-2 small's 147 MiB embedding gradient twice a step to give it back its own layout.
    Transposes are views, so the one permute is the same tensor, strides and all."""
    changed = False
    for node in list(gm.graph.nodes):  # in order: a chain folds into its last node
        if node.op != "call_function" or node.target not in _TRANSPOSES:
            continue
        inner = node.args[0]
        if not isinstance(inner, torch.fx.Node) or inner.target not in _TRANSPOSES:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        outer, first = _permutation(node, value.dim()), _permutation(inner, value.dim())
        start = inner.args[0]
        if outer is None or first is None or not isinstance(start, torch.fx.Node):
            continue
        order = [first[d] for d in outer]  # output dim i is dim order[i] of `start`
        if order == list(range(len(order))):
            if not _as_output(gm, node, start):
                continue
            node.replace_all_uses_with(start)
            gm.graph.erase_node(node)
        else:
            node.target, node.args, node.kwargs = _aten.permute.default, (start, order), {}
        if not inner.users:
            gm.graph.erase_node(inner)
        changed = True
    if changed:
        gm.recompile()


def _mask_factor(node: Any) -> tuple[torch.fx.Node, torch.fx.Node, float | None] | None:
    """(the cast, the boolean mask, the scale) when `node` is a mask cast to a float type,
    scaled by a positive finite number or not (dropout's and ReLU's gradients), else None."""
    scale = None
    if isinstance(node, torch.fx.Node) and node.target is _aten.mul.Tensor:
        factor: Any = node.args[1]
        if type(factor) not in (int, float) or not 0 < factor < float("inf"):
            return None
        node, scale = node.args[0], float(factor)
    if not isinstance(node, torch.fx.Node) or node.target is not _aten._to_copy.default:
        return None
    if set(node.kwargs) - {"dtype", "layout", "device"} or len(node.args) != 1:
        return None
    mask, value = node.args[0], node.meta.get("val")
    if not isinstance(mask, torch.fx.Node) or not isinstance(value, torch.Tensor):
        return None
    source = mask.meta.get("val")
    if not isinstance(source, torch.Tensor) or source.dtype != torch.bool:
        return None
    if node.kwargs.get("layout", torch.strided) != torch.strided or value.device != source.device:
        return None
    if not value.dtype.is_floating_point or source.shape != value.shape:
        return None
    return node, mask, scale


def _masked(node: Any) -> tuple[Any, tuple[torch.fx.Node, torch.fx.Node, float | None]] | None:
    """(the other operand, the mask factor) when `node` is a product with a mask factor of
    its own size, else None."""
    if not isinstance(node, torch.fx.Node) or node.target is not _aten.mul.Tensor:
        return None
    value = node.meta.get("val")
    for k in (0, 1):
        factor = _mask_factor(node.args[k])
        if factor is not None and isinstance(value, torch.Tensor):
            if factor[0].meta["val"].shape == value.shape and len(_users(node.args[k])) == 1:
                return node.args[1 - k], factor
    return None


def _users(node: Any) -> list[torch.fx.Node]:
    return list(node.users) if isinstance(node, torch.fx.Node) else []


def masks_multiplied_once(gm: torch.fx.GraphModule) -> None:
    """A product with one mask after another (a gradient through dropout, then through
    ReLU: `g * (keep.to(f) * scale) * (x > 0).to(f)`) becomes a product with one mask,
    `g * (keep & (x > 0)).to(f) * scale`: a boolean And in place of a float Cast and Mul
    over the activation (1.2 ms of a transformer layer's 68 ms step at one thread, where
    these passes are bound by memory). Exact: each factor is 0 or 1 but for at most one
    positive scale, so the product is `g * scale` or `g * 0` either way; only where
    `g * scale` overflows does a masked element now give 0 (as eager's ReLU) and not NaN.

    ReLU's gradient is one operator of ours (`activations`), its mask inside it; where it
    meets another mask it is first written out as the product it computes (`_relus_written_out`)."""
    changed = _relus_written_out(gm)
    while (rewrite := _two_masks(gm)) is not None:
        node, grad, (cast, masks, scale) = rewrite
        with gm.graph.inserting_before(node):
            both = gm.graph.call_function(_aten.logical_and.default, masks)
            factor = gm.graph.call_function(_aten._to_copy.default, (both,), dict(cast.kwargs))
            both.meta, factor.meta = {"val": masks[1].meta["val"]}, {"val": cast.meta["val"]}
            if scale is not None:
                factor = gm.graph.call_function(_aten.mul.Tensor, (factor, scale))
                factor.meta = {"val": cast.meta["val"]}
        dead = [*node.args]
        node.args = (grad, factor)
        while dead:  # the factors and the first product, nothing reads them any more
            gone = dead.pop()
            if isinstance(gone, torch.fx.Node) and gone.op == "call_function" and not gone.users:
                dead.extend(gone.all_input_nodes)
                gm.graph.erase_node(gone)
        changed = True
    if changed:
        gm.recompile()


def activation_masks_saved(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, reads: list[tuple[str, int]]
) -> None:
    """A value forward saves only for activation gradients of ours (`activations.GRADIENTS`:
    ReLU's, LeakyReLU's; read as the activation, one operator, one threshold or slope) is
    saved as their boolean mask, one byte an element, and backward applies it (the
    operator's own formula, `activations.Gradient`). The partitioner chose so itself when
    the gradient was ATen operators; our operator reads the activation whole, which a
    transformer layer's feed-forward saved in float beside its dropout's output. An
    activation backward reads otherwise too (a convolution's input, in a CNN) stays saved
    as it is. `reads` are backward's inputs (`linking.link`)."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(reads):
        return
    changed = False
    for placeholder, (kind, k) in zip(placeholders, reads, strict=True):
        users = list(placeholder.users)
        value = outs[k] if kind == "out" else None
        if not users or not isinstance(value, torch.fx.Node) or outs.count(value) != 1:
            continue
        if any(u.target not in activations.GRADIENTS or u.args[0] is placeholder for u in users):
            continue
        readers = {(u.target, u.args[2]) for u in users}
        if len(readers) != 1 or not isinstance(value.meta.get("val"), torch.Tensor):
            continue
        ((target, arg),) = readers
        gradient = activations.GRADIENTS[target]
        # made as soon as the activation is (an input: after the last input), which forward
        # may then free early
        anchor = value
        if value.op == "placeholder":
            anchor = [n for n in forward.graph.nodes if n.op == "placeholder"][-1]
        with forward.graph.inserting_before(anchor.next):  # in order, after the anchor
            mask = gradient.mask(activations.Fx(forward.graph), value, arg)
        outs[k] = mask
        placeholder.meta = {**placeholder.meta, "val": mask.meta["val"]}
        placeholder.meta.pop("tensor_meta", None)
        for user in users:
            with backward.graph.inserting_before(user):
                product = gradient.apply(
                    activations.Fx(backward.graph), user.args[0], placeholder, arg
                )
            user.replace_all_uses_with(product)
            backward.graph.erase_node(user)
        changed = True
    if changed:
        output.args = (tuple(outs),)
        forward.recompile()
        backward.recompile()


def _relus_written_out(gm: torch.fx.GraphModule) -> bool:
    """Each ReLU gradient of ours (`threshold_backward`) whose gradient is a product with a
    mask, or whose one reader is one, written out as the product it computes
    (`activations.RELU`: `g * (~(x <= t)).to(f)`), which `_two_masks` then finds; whether
    one was."""
    written = False
    for node in list(gm.graph.nodes):
        if (
            node.op != "call_function"
            or activations.GRADIENTS.get(node.target) is not activations.RELU
        ):
            continue
        grad, x, threshold = node.args
        readers = list(node.users)
        inner = grad
        while isinstance(inner, torch.fx.Node) and inner.target is _aten.clone.default:
            inner = inner.args[0]
        outer = readers[0] if len(readers) == 1 else None
        if _masked(inner) is None and _masked(outer) is None:
            continue
        with gm.graph.inserting_before(node):
            product = activations.RELU(activations.Fx(gm.graph), grad, x, threshold)
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        written = True
    return written


def _two_masks(
    gm: torch.fx.GraphModule,
) -> tuple[torch.fx.Node, Any, tuple[torch.fx.Node, tuple[Any, Any], float | None]] | None:
    """The first product of `gm` with a mask whose other operand is a product with a mask
    read by it alone: (the product, the gradient they multiply, (a cast, the two masks,
    the one scale)), or None."""
    for node in gm.graph.nodes:
        outer = _masked(node)
        if outer is None:
            continue
        operand, (cast2, mask2, scale2) = outer
        inner_node = operand
        while (
            isinstance(inner_node, torch.fx.Node)
            and inner_node.target is _aten.clone.default
            and len(inner_node.users) == 1
        ):
            inner_node = inner_node.args[0]  # dropout's gradient ends in a clone
        inner = _masked(inner_node)
        if inner is None or len(_users(inner_node)) != 1:
            continue
        grad, (cast1, mask1, scale1) = inner
        if scale1 is not None and scale2 is not None:
            continue  # two scales: their product would round differently
        if cast1.meta["val"].dtype != cast2.meta["val"].dtype:
            continue
        scale = scale1 if scale1 is not None else scale2
        return node, grad, (cast2, (mask1, mask2), scale)
    return None


#: operators taking a list of index tensors, which ONNX (GatherND, ScatterND) reads as int64
_INDEXING = frozenset(
    {
        _aten.index.Tensor,
        _aten._unsafe_index.Tensor,
        _aten.index_put.default,
        _aten._unsafe_index_put.default,
    }
)


_PUTS = frozenset({_aten.index_put.default, _aten._unsafe_index_put.default})
_ZEROS = frozenset({_aten.new_zeros.default, _aten.zeros.default, _aten.zeros_like.default})


def _scatter_into_zeros(node: Any) -> tuple[torch.fx.Node, Any, Any] | None:
    """(the zeros, the indices, the values) where `node` adds values at indices into zeros
    that nothing else reads, the one reader of its result being the sum it is a term of."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target not in _PUTS or len(node.users) != 1 or node.kwargs:
        return None
    zeros, indices, values, *rest = node.args
    accumulate = rest[0] if rest else False
    if accumulate is not True or not isinstance(zeros, torch.fx.Node):
        return None
    if zeros.op != "call_function" or zeros.target not in _ZEROS or len(zeros.users) != 1:
        return None
    return zeros, indices, values


def scatters_added_into_the_sum(gm: torch.fx.GraphModule) -> None:
    """`a + index_put(zeros, indices, values, accumulate=True)` is `index_put(a, indices,
    values, accumulate=True)`: the values added into `a` itself. A tied embedding's gradient
    is such a sum (the embedding's gradient, values scattered into zeros, and the output
    projection's), and ONNX Runtime filled the zeros, copied them into the ScatterND's
    result, then read both terms and wrote the sum: four passes over GPT-2 small's 147 MiB
    and two such tensors alive at once at the end of backward, where one copy of `a` does.
    Only where both terms have the sum's static shape and type (no broadcast, no
    promotion). A value indexed twice is added into `a` in turn rather than summed first:
    the same rounding as any other order of a sum."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _aten.add.Tensor:
            continue
        if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or _static_sizes(node) is None:
            continue
        for term, other in (node.args, node.args[::-1]):
            scatter = None if term is other else _scatter_into_zeros(term)
            if scatter is None or not (_alike(term, node) and _alike(other, node)):
                continue
            zeros, indices, values = scatter
            node.target, node.args, node.kwargs = term.target, (other, indices, values, True), {}
            gm.graph.erase_node(term)
            gm.graph.erase_node(zeros)
            changed = True
            break
    if changed:
        gm.recompile()


def cross_entropy_backward_fused(gm: torch.fx.GraphModule) -> None:
    """`log_softmax_backward(nll_loss_backward(g, lp, ...), lp, 1)`, where nothing else reads
    the loss's gradient, is `cross_entropy_backward(g, lp, ...)` (`losses`): a language
    model's loss gradient in two passes over (tokens, vocabulary) rather than eight."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not losses.LOG_SOFTMAX_BACKWARD:
            continue
        grad, output, dim = node.args
        if not isinstance(grad, torch.fx.Node) or grad.op != "call_function":
            continue
        if grad.target is not losses.NLL_LOSS_BACKWARD or len(grad.users) != 1:
            continue
        if grad.args[1] is not output or dim != 1:
            continue
        node.target, node.args = losses.CROSS_ENTROPY_BACKWARD, grad.args
        gm.graph.erase_node(grad)
        changed = True
    if changed:
        gm.recompile()


def tied_gradients_summed(backward: torch.fx.GraphModule, tied: dict[int, int]) -> None:
    """A tensor fed twice (`Captured.tied`: a weight two modules hold) has its gradient
    summed in the graph, under its first feed, and none under the other. Left to autograd,
    which adds the two into the one `.grad`, GPT-2 small's tied embedding had two 147 MiB
    gradients out of backward, the embedding's scattered into zeros the graph filled: three
    such tensors alive at backward's end, and an add in torch after it. Summed here, the
    embedding's part goes into the projection's at once (`scatters_added_into_the_sum`).
    Backward's outputs are one per feed, in order (`linking.link`)."""
    output = next(n for n in backward.graph.nodes if n.op == "output")
    grads = list(output.args[0])
    if any(again >= len(grads) for again in tied):  # not one output per feed: left to autograd
        return  # (before any sum is made: one made, then abandoned, would stay in the graph)
    changed = False
    for again, first in sorted(tied.items()):
        grad, kept = grads[again], grads[first]
        if not isinstance(grad, torch.fx.Node):
            continue
        if isinstance(kept, torch.fx.Node):
            with backward.graph.inserting_before(output):
                summed = backward.graph.call_function(_aten.add.Tensor, (kept, grad))
            summed.meta = dict(kept.meta)
            grad = summed
        grads[first], grads[again] = grad, None
        changed = True
    if changed:
        output.args = (type(output.args[0])(grads), *output.args[1:])
        backward.recompile()


def _alike(node: Any, like: torch.fx.Node) -> bool:
    """Whether `node`'s value has `like`'s type and static shape."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == like.meta["val"].dtype
        and _static_sizes(node) == _static_sizes(like)
    )


def int64_indices(gm: torch.fx.GraphModule) -> None:
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


def _pad_span(node: Any, rank: int) -> tuple[int, int, int, int] | None:
    """(dim, start, end, size) of the place a zero `constant_pad_nd` puts its input along the
    one dimension it pads, of a static size, when the pads are plain non-negative integers;
    else None."""
    if node.op != "call_function" or node.target is not _aten.constant_pad_nd.default:
        return None
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    pads = node.args[1]
    padded = node.meta.get("val")
    if value != 0 or not isinstance(padded, torch.Tensor) or padded.dim() != rank:
        return None
    if not all(type(p) is int and p >= 0 for p in pads) or len(pads) % 2:
        return None
    spans = [(rank - 1 - k, pads[2 * k], pads[2 * k + 1]) for k in range(len(pads) // 2)]
    moved = [span for span in spans if span[1] or span[2]]
    if len(moved) != 1:
        return None
    dim, before, after = moved[0]
    size = padded.shape[dim]
    if type(size) is not int:
        return None
    return dim, before, size - after, size


def _is_add(node: Any) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target is _aten.add.Tensor
        and "alpha" not in node.kwargs
    )


def _summed_terms(root: torch.fx.Node) -> tuple[list[torch.fx.Node], list[Any]] | None:
    """The adds of the sum `root` heads (itself first, each after its user) and its terms,
    when no add or term of it is read elsewhere."""
    adds, terms, pending = [root], [], list(root.args[:2])
    while pending:
        node = pending.pop()
        if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
            return None
        if _is_add(node):
            adds.append(node)
            pending.extend(node.args[:2])
        else:
            terms.append(node)
    return adds, terms


def _tiling(terms: list[Any], value: torch.Tensor) -> tuple[int, list[Any]] | None:
    """The dimension and the pads in their order along it, when `terms` are zero pads of
    `value`'s shape and type that place their inputs side by side along one dimension,
    covering it exactly."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    placed = []
    for term in terms:
        span = _pad_span(term, value.dim())
        if span is None:
            return None
        padded = term.meta["val"]
        if padded.dtype != value.dtype or not all(
            statically_known_true(a == b) for a, b in zip(padded.shape, value.shape, strict=True)
        ):
            return None
        placed.append((span, term))
    if len(placed) < 2 or len({(dim, size) for (dim, _, _, size), _ in placed}) != 1:
        return None
    placed.sort(key=lambda item: item[0][1])
    dim, _, _, size = placed[0][0]
    end = 0
    for (_, start, stop, _), _ in placed:
        if start != end:
            return None  # a gap, or an overlap
        end = stop
    if end != size:
        return None
    return dim, [term for _, term in placed]


def pads_summed_into_cat(gm: torch.fx.GraphModule) -> None:
    """A sum of zero pads that put their inputs side by side along one dimension, tiling it
    exactly (the gradient of a tensor split into parts: `select_backward` and
    `slice_backward` of q, k and v taken from one projection, as `decompositions` writes
    them), becomes one `cat` of the inputs: ONNX Runtime ran the pads and the adds as full
    passes over the whole tensor each (2 ms of a transformer layer's 70 ms backward), a Concat
    is one. Every element of the sum is one input's element plus zeros, so the numbers are the
    same (a -0.0 stays -0.0 where the sum made it +0.0). Parts that overlap, leave a gap,
    broadcast or pad more than one dimension are left as they are."""
    erased: set[torch.fx.Node] = set()
    for root in list(gm.graph.nodes):
        if not _is_add(root) or root in erased:
            continue
        if len(root.users) == 1 and _is_add(next(iter(root.users))):
            continue  # a part of a larger sum: rewritten from its root
        value = root.meta.get("val")
        summed = _summed_terms(root)
        if not isinstance(value, torch.Tensor) or summed is None:
            continue
        adds, terms = summed
        tiling = _tiling(terms, value)
        if tiling is None:
            continue
        dim, pads = tiling
        with gm.graph.inserting_before(root):
            cat = gm.graph.call_function(_aten.cat.default, ([pad.args[0] for pad in pads], dim))
        cat.meta = dict(root.meta)
        root.replace_all_uses_with(cat)
        for node in [*adds, *pads]:
            gm.graph.erase_node(node)  # the root first: each node's user is gone before it
            erased.add(node)
    if erased:
        gm.recompile()
