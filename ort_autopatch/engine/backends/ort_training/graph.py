"""Named, tested passes that make a TorchScript export trainable by ONNX Runtime 1.19.2.

Each pass edits an `onnx.ModelProto` in place and is named for the one fix it makes, so tests can
exercise them one by one. Which passes run, in which order and when, is declared in `passes.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper


def load(model_bytes: bytes) -> onnx.ModelProto:
    return onnx.load_from_string(model_bytes)


def _unique(model: onnx.ModelProto, base: str) -> str:
    taken = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def name_outputs(model: onnx.ModelProto) -> list[str]:
    """Rename graph outputs to output_0..N so feeds and fetches never depend on trace numbering."""
    names = []
    for i, out in enumerate(model.graph.output):
        new = f"output_{i}"
        old = out.name
        if old != new:
            for node in model.graph.node:
                for k, name in enumerate(node.output):
                    if name == old:
                        node.output[k] = new
                for k, name in enumerate(node.input):
                    if name == old:
                        node.input[k] = new
            out.name = new
        names.append(new)
    return names


def relax_shapes(model: onnx.ModelProto) -> bool:
    """Drop traced intermediate and output shapes: they hold the example's sizes, not the rule."""
    del model.graph.value_info[:]
    for out in model.graph.output:
        tensor_type = out.type.tensor_type
        if tensor_type.HasField("shape"):
            for k, dim in enumerate(tensor_type.shape.dim):
                dim.Clear()
                dim.dim_param = f"{out.name}_dim{k}"
    return True


def layer_norm_outputs(model: onnx.ModelProto) -> int:
    """Give LayerNormalization its mean and inv_std_dev outputs.

    ORT's gradient builder reads them (`GradientBuilderBase::O(1..2)`) and fails otherwise.
    """
    changed = 0
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            while len(node.output) < 3:
                node.output.append(_unique(model, f"{node.name or 'ln'}_stat{len(node.output)}"))
            changed += 1
    return changed


def attention_dropout(model: onnx.ModelProto) -> int:
    """Make Dropout nodes emitted by attention symbolics actually drop in training.

    The scaled_dot_product_attention symbolic emits Dropout(x, ratio) with neither the
    training_mode input (so it never drops) nor the mask output DropoutGrad needs. Such nodes only
    appear when dropout_p > 0 was traced, i.e. in training, so they get training_mode=True.
    """
    changed = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx") and len(node.input) < 3:
            if len(node.input) < 2 or not node.input[1]:
                continue  # no ratio: the default 0.5 is not what attention asked for; leave it
            flag = _unique(model, f"{node.name or 'dropout'}_training_mode")
            new_nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [flag],
                    value=helper.make_tensor(flag, TensorProto.BOOL, [], [True]),
                )
            )
            node.input.append(flag)
            if len(node.output) < 2:
                node.output.append(_unique(model, f"{node.name or 'dropout'}_mask"))
            changed += 1
    for k, const in enumerate(new_nodes):
        model.graph.node.insert(k, const)
    return changed


@dataclass(frozen=True)
class BatchNormStats:
    """Graph outputs carrying one training BatchNorm's batch statistics."""

    running_mean: str  # graph input (buffer) name the statistics belong to
    running_var: str
    mean_output: str
    var_output: str  # unbiased batch variance, as PyTorch's running_var update uses


def batch_norm_statistics(model: onnx.ModelProto) -> list[BatchNormStats]:
    """Route training BatchNorm statistics to graph outputs; `run.BatchNormUpdate` updates
    the buffers.

    ORT's kernel updates running stats with the biased variance, writes them into the fed
    buffers in place, never counts num_batches_tracked and cannot do momentum=None. With
    momentum 0 and internal placeholder inputs, its running-stat outputs become the plain batch
    mean and biased variance; the variance is rescaled by n/(n-1) in the graph (n, the elements
    per channel, is only known there) and PyTorch's update rule is left to `run.BatchNormUpdate`.
    """
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    found: list[BatchNormStats] = []
    nodes: list[onnx.NodeProto] = []
    float_type = TensorProto.FLOAT
    for node in model.graph.node:
        stats_in = node.input[3:5] if len(node.input) >= 5 else []
        if (
            node.op_type != "BatchNormalization"
            or node.domain not in ("", "ai.onnx")
            or not any(a.name == "training_mode" and a.i == 1 for a in node.attribute)
            or len(node.output) < 3
            or len(stats_in) != 2
            or not all(name in inputs for name in stats_in)
        ):
            nodes.append(node)
            continue
        mean_in, var_in = stats_in
        elem = inputs[mean_in]
        for attr in node.attribute:
            if attr.name == "momentum":
                attr.f = 0.0
                break
        else:
            node.attribute.append(helper.make_attribute("momentum", 0.0))
        base = _unique(model, f"{mean_in}__bn")
        channels, placeholders = f"{base}_channels", []
        nodes.append(helper.make_node("Shape", [node.input[1]], [channels]))
        for k in range(2):
            # With momentum 0 the value is irrelevant, but the kernel writes into this tensor
            # in place: a distinct value per tensor stops ORT from merging them into one
            # buffer, which would make the mean and variance outputs alias each other.
            fill = helper.make_tensor("fill", elem, [1], [len(found) * 2 + k])
            placeholders.append(f"{base}_placeholder{k}")
            nodes.append(
                helper.make_node("ConstantOfShape", [channels], [placeholders[-1]], value=fill)
            )
        node.input[3], node.input[4] = placeholders
        nodes.append(node)
        one = helper.make_tensor(f"{base}_one", float_type, [], [1.0])
        nodes.extend(
            [
                helper.make_node("Shape", [node.input[0]], [f"{base}_shape"]),
                helper.make_node("Cast", [f"{base}_shape"], [f"{base}_shapef"], to=float_type),
                helper.make_node("ReduceProd", [f"{base}_shapef"], [f"{base}_numel"], keepdims=0),
                helper.make_node("Cast", [channels], [f"{base}_channelsf"], to=float_type),
                helper.make_node("ReduceProd", [f"{base}_channelsf"], [f"{base}_c"], keepdims=0),
                helper.make_node("Div", [f"{base}_numel", f"{base}_c"], [f"{base}_n"]),
                helper.make_node("Constant", [], [f"{base}_one"], value=one),
                helper.make_node("Sub", [f"{base}_n", f"{base}_one"], [f"{base}_n1"]),
                helper.make_node("Div", [f"{base}_n", f"{base}_n1"], [f"{base}_factor"]),
                helper.make_node("Cast", [f"{base}_factor"], [f"{base}_factor_t"], to=elem),
                helper.make_node("Mul", [node.output[2], f"{base}_factor_t"], [f"{base}_unbiased"]),
            ]
        )
        found.append(BatchNormStats(mean_in, var_in, node.output[1], f"{base}_unbiased"))
    if found:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        for stats in found:
            elem = inputs[stats.running_mean]
            model.graph.output.extend(
                helper.make_tensor_value_info(name, elem, [f"{name}_channels"])
                for name in (stats.mean_output, stats.var_output)
            )
    return found


def eval_batch_norm_arithmetic(model: onnx.ModelProto) -> int:
    """Spell out eval-mode BatchNorm as arithmetic in graphs that get a gradient.

    ORT's gradient builder rewrites every BatchNormalization into its training kernel, so a
    BatchNorm frozen with .eval() inside a training model would use batch statistics and
    update its running stats. As y = x * a + b with a = scale / sqrt(var + eps) and
    b = bias - mean * a (per channel), it keeps eval semantics and its gradients.
    """
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in model.graph.node:
        if (
            node.op_type != "BatchNormalization"
            or node.domain not in ("", "ai.onnx")
            or any(a.name == "training_mode" and a.i == 1 for a in node.attribute)
        ):
            nodes.append(node)
            continue
        x, scale, bias, mean, var = node.input[:5]
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        elem = inputs.get(scale, TensorProto.FLOAT)
        b = _unique(model, f"{node.name or 'bn'}_eval")
        nodes.extend(
            [
                helper.make_node(
                    "Constant", [], [f"{b}_eps"], value=helper.make_tensor("eps", elem, [], [eps])
                ),
                helper.make_node("Add", [var, f"{b}_eps"], [f"{b}_var_eps"]),
                helper.make_node("Sqrt", [f"{b}_var_eps"], [f"{b}_std"]),
                helper.make_node("Div", [scale, f"{b}_std"], [f"{b}_a"]),
                helper.make_node("Mul", [mean, f"{b}_a"], [f"{b}_mean_a"]),
                helper.make_node("Sub", [bias, f"{b}_mean_a"], [f"{b}_b"]),
                # per-channel vectors reshaped to [C, 1, ..., 1] for x of any rank >= 2
                helper.make_node("Shape", [x], [f"{b}_xshape"]),
                helper.make_node("Size", [f"{b}_xshape"], [f"{b}_rank"]),
                helper.make_node(
                    "Constant",
                    [],
                    [f"{b}_two"],
                    value=helper.make_tensor("two", TensorProto.INT64, [1], [2]),
                ),
                helper.make_node("Sub", [f"{b}_rank", f"{b}_two"], [f"{b}_trailing"]),
                helper.make_node(
                    "ConstantOfShape",
                    [f"{b}_trailing"],
                    [f"{b}_ones"],
                    value=helper.make_tensor("one", TensorProto.INT64, [1], [1]),
                ),
                helper.make_node(
                    "Constant",
                    [],
                    [f"{b}_minus1"],
                    value=helper.make_tensor("m1", TensorProto.INT64, [1], [-1]),
                ),
                helper.make_node("Concat", [f"{b}_minus1", f"{b}_ones"], [f"{b}_target"], axis=0),
                helper.make_node("Reshape", [f"{b}_a", f"{b}_target"], [f"{b}_a_r"]),
                helper.make_node("Reshape", [f"{b}_b", f"{b}_target"], [f"{b}_b_r"]),
                helper.make_node("Mul", [x, f"{b}_a_r"], [f"{b}_xa"]),
                helper.make_node("Add", [f"{b}_xa", f"{b}_b_r"], [node.output[0]]),
            ]
        )
        changed += 1
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


def embedding_padding(model: onnx.ModelProto, padding: dict[str, int]) -> list[str]:
    """Keep gradients away from nn.Embedding's padding_idx row, as eager does.

    The export is a plain Gather, so ORT would train the pad row. Positions holding the pad index
    gather from a second, non-trained input fed with the same weight; returns those input names.
    A gradient hook would be wrong with tied weights, whose other uses must still train the row.
    """
    extra: list[str] = []
    graph_inputs = {i.name: i for i in model.graph.input}
    rewritten: list[tuple[int, list[onnx.NodeProto]]] = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "Gather" or node.input[0] not in padding:
            continue
        if any(a.name == "axis" and a.i != 0 for a in node.attribute):
            continue
        weight, ids = node.input[0], node.input[1]
        frozen = f"{weight}__frozen"
        if frozen not in graph_inputs:
            info = onnx.ValueInfoProto()
            info.CopyFrom(graph_inputs[weight])
            info.name = frozen
            model.graph.input.append(info)
            graph_inputs[frozen] = info
            extra.append(frozen)
        out = node.output[0]
        base = _unique(model, f"{out}__pad")
        trained, still, pad, is_pad, mask = (f"{base}_{s}" for s in "tspqm")
        node.output[0] = trained
        axes = f"{base}_axes"
        nodes = [
            helper.make_node("Gather", [frozen, ids], [still], axis=0),
            helper.make_node(
                "Constant",
                [],
                [pad],
                value=helper.make_tensor(pad, TensorProto.INT64, [], [padding[weight]]),
            ),
            helper.make_node(
                "Constant", [], [axes], value=helper.make_tensor(axes, TensorProto.INT64, [1], [-1])
            ),
            helper.make_node("Cast", [ids], [f"{base}_ids64"], to=TensorProto.INT64),
            helper.make_node("Equal", [f"{base}_ids64", pad], [is_pad]),
            helper.make_node("Unsqueeze", [is_pad, axes], [mask]),
            helper.make_node("Where", [mask, still, trained], [out]),
        ]
        rewritten.append((index, nodes))
    for index, nodes in reversed(rewritten):
        for k, new in enumerate(nodes):
            model.graph.node.insert(index + 1 + k, new)
    return extra


def yield_extra_outputs(gradient_model: onnx.ModelProto, names: list[str]) -> int:
    """Hand extra forward values (BatchNorm statistics) out of a gradient graph.

    As graph outputs they would be treated as differentiable and need gradients the builder
    cannot make. Appended to the YieldOp as non-differentiable inputs, the way ORT returns its
    own cached frontier tensors, they come back from run_forward after the user outputs.
    Returns the number of forward outputs.
    """
    for index, found in enumerate(gradient_model.graph.node):
        if found.op_type == "YieldOp":
            _hoist_producers(gradient_model, index, names)
            # rebuilding the node list copies the messages: look the YieldOp up again
            node = next(n for n in gradient_model.graph.node if n.op_type == "YieldOp")
            first = len(node.input)
            node.input.extend(names)
            for attr in node.attribute:
                if attr.name == "non_differentiable_outputs":
                    attr.ints.extend(range(first, first + len(names)))
                    break
            else:
                indices = list(range(first, first + len(names)))
                node.attribute.append(
                    helper.make_attribute(
                        "non_differentiable_outputs", indices, attr_type=onnx.AttributeProto.INTS
                    )
                )
            return len(node.input)
    raise ValueError("the gradient graph has no YieldOp")


def _hoist_producers(model: onnx.ModelProto, yield_index: int, names: list[str]) -> None:
    """Move the nodes computing `names` that sit after the YieldOp to just before it.

    The builder appends nodes it does not need for backward after the YieldOp; once their
    outputs feed the YieldOp they must come first for the graph to stay topologically sorted
    (ORT sorts for itself, but onnx.checker and other tools insist).
    """
    nodes = list(model.graph.node)
    after = nodes[yield_index + 1 :]
    producer = {out: k for k, node in enumerate(after) for out in node.output}
    needed: set[int] = set()
    stack = [producer[n] for n in names if n in producer]
    while stack:
        k = stack.pop()
        if k in needed:
            continue
        needed.add(k)
        stack.extend(producer[i] for i in after[k].input if i in producer)
    if not needed:
        return
    moved = [after[k] for k in sorted(needed)]
    kept = [node for k, node in enumerate(after) if k not in needed]
    del model.graph.node[:]
    model.graph.node.extend([*nodes[:yield_index], *moved, nodes[yield_index], *kept])


def cross_entropy_log_prob(model: onnx.ModelProto) -> int:
    """Give SoftmaxCrossEntropyLoss its log_prob output: ORT's gradient builder reads it
    (`GradientBuilderBase::O(1)`) and fails when the export left it out."""
    changed = 0
    for node in model.graph.node:
        if (
            node.op_type == "SoftmaxCrossEntropyLoss"
            and node.domain in ("", "ai.onnx")
            and len(node.output) < 2
        ):
            node.output.append(_unique(model, f"{node.name or 'sce'}_log_prob"))
            changed += 1
    return changed


def torch_node_mode(model: onnx.ModelProto, training: bool) -> int:
    """Tell each torch-calling node whether its graph gets a gradient.

    In a training graph a node keeps its torch autograd graph for PythonOpGrad; in a
    forward-only graph it runs under no_grad and must hand ORT no context.
    """
    changed = 0
    for node in model.graph.node:
        if node.op_type == "PythonOp" and node.domain == "com.microsoft":
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = int(training)
            changed += 1
    return changed


def torch_node_shapes_unknown(model: onnx.ModelProto, gradient: bool) -> int:
    """Give each torch-calling node's outputs sizes of their own, and in a graph that gets a
    gradient pass them through `Reshape(y, Shape(y))`, whose sizes ORT does not know.

    ORT 1.19.2's shape inference gives every output of every `PythonOp` the same symbolic
    sizes (`PythonOp_unknown_rank_0`, `_1`, ...). Its memory planner trusts them: mobilenet_v3's
    eval graph failed with "Shape mismatch attempting to re-use buffer. {4,96,1,1} !=
    {4,240,1,1}"; so each output is declared with sizes of its own (`<output>_size<k>`), which
    ORT's inference keeps. Its gradient builder takes two symbols, equal or not, for equal
    sizes: the gradient of `Mul(a, b)` with `a` [4, 576, 2, 2] and `b` [4, 576, 1, 1], both
    from torch-calling nodes (mobilenet_v3's hardswish times its hardsigmoid
    squeeze-excitation scale), was built without the sum over the broadcast axes, and `b`'s
    node got a [4, 576, 2, 2] gradient for a [4, 576, 1, 1] output. A Reshape to a computed
    shape has a rank and no sizes, which sends the builder to its run-time path
    (`BroadcastGradientArgs`, a sum over the axes the shapes broadcast). Its cost was within
    the noise (step time with/without 0.97 to 1.04 in four interleaved runs, two torch-calling
    nodes returning 256x512 floats each, 1 thread); it is added only where a gradient is built.
    """
    from onnx import helper

    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type != "PythonOp" or node.domain != "com.microsoft":
            continue
        types = _ints(node, "output_tensor_types")
        ranks = _ints(node, "output_tensor_ranks")
        for k in range(1, len(node.output)):
            name = node.output[k]
            if not name:
                continue
            produced = name
            if gradient:
                # the node's output takes a new name; the Reshape gives its readers the old one
                produced = _unique(model, f"{name}__torch")
                shape = _unique(model, f"{name}__shape")
                node.output[k] = produced
                nodes.append(helper.make_node("Shape", [produced], [shape]))
                nodes.append(helper.make_node("Reshape", [produced, shape], [name]))
            if k - 1 < min(len(types), len(ranks)) and ranks[k - 1] >= 0:
                sizes = [f"{produced}_size{d}" for d in range(ranks[k - 1])]
                info = helper.make_tensor_value_info(produced, types[k - 1], sizes)
                model.graph.value_info.append(info)
            changed += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return changed


def _ints(node: onnx.NodeProto, name: str) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == name), [])


def _integer_scalars(model: onnx.ModelProto) -> dict[str, int]:
    """Every constant integer scalar of the graph (Constant nodes and initializers) by name."""
    return {
        name: values[0] for name, (values, scalar) in _integer_constants(model).items() if scalar
    }


def _integer_constants(model: onnx.ModelProto) -> dict[str, tuple[list[int], bool]]:
    """Every constant integer scalar or vector of the graph by name: (values, is a scalar)."""
    from onnx import numpy_helper

    tensors = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            value = next((a for a in node.attribute if a.name == "value"), None)
            if value is not None:
                tensors[node.output[0]] = value.t
    return {
        name: ([int(v) for v in numpy_helper.to_array(t).reshape(-1)], not list(t.dims))
        for name, t in tensors.items()
        if len(t.dims) <= 1 and t.data_type in (TensorProto.INT32, TensorProto.INT64)
    }


def gather_without_axis_move(model: onnx.ModelProto) -> int:
    """Pick q, k and v out of a packed projection where they lie, not after moving their axis
    to the front.

    nn.MultiheadAttention's `proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2)
    .squeeze(-2)` then `proj[0], proj[1], proj[2]` exports as `Unsqueeze(axes 0)` ->
    `Transpose` (swap 0 and j) -> `Squeeze(axes j)` -> `Gather(i, axis 0)`s: a full copy of the
    projection in the forward (3 MB for 16x64 tokens of width 256) and another in the backward,
    for what is `Gather(i, axis j - 1)` of the unflattened projection, element for element.
    Rewritten only when Gathers on axis 0 are all that read the moved tensor.
    """
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node_reads(node):
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    constants = _integer_constants(model)

    def read_only_by(name: str, node: onnx.NodeProto) -> bool:
        found = readers.get(name, [])
        return len(found) == 1 and found[0] is node and name not in outputs

    def axes_of(node: onnx.NodeProto) -> list[int] | None:
        if len(node.input) > 1:
            found = constants.get(node.input[1])
            return None if found is None else found[0]
        attribute = next((a for a in node.attribute if a.name == "axes"), None)
        return None if attribute is None else list(attribute.ints)

    dead: set[int] = set()
    changed = 0
    for squeeze in model.graph.node:
        if squeeze.op_type != "Squeeze" or squeeze.output[0] in outputs:
            continue
        transpose = producer.get(squeeze.input[0])
        if transpose is None or transpose.op_type != "Transpose":
            continue
        unsqueeze = producer.get(transpose.input[0])
        if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or axes_of(unsqueeze) != [0]:
            continue
        if not read_only_by(transpose.output[0], squeeze):
            continue
        if not read_only_by(unsqueeze.output[0], transpose):
            continue
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), [])
        rank = len(perm)
        squeezed = axes_of(squeeze)
        if rank < 2 or squeezed is None or len(squeezed) != 1:
            continue
        j = squeezed[0] % rank
        swapped = list(range(rank))
        swapped[0], swapped[j] = j, 0
        if j == 0 or perm != swapped:
            continue
        gathers = readers.get(squeeze.output[0], [])
        if not gathers or not all(
            g.op_type == "Gather"
            and g.input[0] == squeeze.output[0]
            and next((a.i for a in g.attribute if a.name == "axis"), 0) == 0
            and constants.get(g.input[1], ([], False))[1]
            for g in gathers
        ):
            continue
        for gather in gathers:
            gather.input[0] = unsqueeze.input[0]
            for attribute in list(gather.attribute):
                if attribute.name == "axis":
                    gather.attribute.remove(attribute)
            gather.attribute.append(helper.make_attribute("axis", j - 1))
        dead.update(id(n) for n in (squeeze, transpose, unsqueeze))
        changed += 1
    if changed:
        kept = [n for n in model.graph.node if id(n) not in dead]
        del model.graph.node[:]
        model.graph.node.extend(kept)
    return changed


def gather_grad_as_slice_grad(gradient_model: onnx.ModelProto) -> int:
    """Differentiate a Gather at a constant index as the equivalent Slice: `SliceGrad`.

    `q, k, v = proj[0], proj[1], proj[2]` (nn.MultiheadAttention's packed projection, most
    fused-QKV attentions) exports as Gathers with scalar indices, and ORT's CPU `GatherGrad`
    scatters element by element: 28 ms of a 75 ms TransformerEncoderLayer step at 1 thread,
    73 ms at 2 (it gets slower with threads). `SliceGrad` of the unsqueezed gradient is a zero
    fill and one copy and gives the same tensor, element for element. Done on the built gradient
    graph, not on the export: the forward keeps its Gather, which ORT's compute optimiser knows
    how to move (a Slice + Squeeze it moves wrongly through an exported GRU).

    When the gradients of indices 0..n-1 of one axis meet in a `Sum` (the q/k/v case), they
    become one `Concat`, zero-padded to the axis' size at run time (`_concat_slices`).
    """
    scalars = _integer_scalars(gradient_model)
    changed = 0
    nodes: list[onnx.NodeProto] = []
    made: dict[str, _Slice] = {}
    for node in gradient_model.graph.node:
        index = (
            scalars.get(node.input[1])
            if node.op_type == "GatherGrad" and node.domain == "com.microsoft"
            else None
        )
        if index is None:
            nodes.append(node)
            continue
        shape, _, grad = node.input
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        base = _unique(gradient_model, f"{node.output[0]}__slice")
        # -1 runs to the end: an `ends` of 0 would be an empty slice
        end = index + 1 if index != -1 else 2**63 - 1
        constants = {"starts": index, "ends": end, "axes": axis}
        for suffix, value in constants.items():
            nodes.append(_int64s(f"{base}_{suffix}", [value]))
        # Unsqueeze's axes count in its output, which has the Gather input's rank.
        nodes.append(helper.make_node("Unsqueeze", [grad, f"{base}_axes"], [f"{base}_grad"]))
        slice_grad = helper.make_node(
            "SliceGrad",
            [f"{base}_grad", shape, *(f"{base}_{s}" for s in constants)],
            list(node.output),
            name=f"{node.name}__as_slice" if node.name else "",
            domain="com.microsoft",
        )
        nodes.append(slice_grad)
        made[node.output[0]] = _Slice(index, axis, f"{base}_grad", shape, slice_grad)
        changed += 1
    if changed:
        nodes = _concat_slices(gradient_model, nodes, made)
        del gradient_model.graph.node[:]
        gradient_model.graph.node.extend(nodes)
    return changed


def _int64s(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], values)
    )


@dataclass(frozen=True)
class _Slice:
    index: int
    axis: int
    unsqueezed: str  # the slice's gradient with the gathered axis back (length 1)
    shape: str  # the Gather input's shape
    node: onnx.NodeProto  # the SliceGrad


def _concat_slices(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], made: dict[str, _Slice]
) -> list[onnx.NodeProto]:
    """`Sum` of the SliceGrads of indices 0..n-1 of one axis -> `Concat` of the n slice
    gradients, padded with zeros to the axis' size at run time (usually none: q, k, v are
    the whole axis). One write of the result instead of n zero-filled full-size tensors and
    their sum (7 ms of a TransformerEncoderLayer step at 1 thread); each element is still
    exactly one slice's value or zero. (An `If` choosing between the two forms would skip the
    pad, but ORT 1.19.2 aborts creating a session for a gradient graph holding an `If`.)"""
    readers: dict[str, int] = {}
    for node in nodes:
        for name in node_reads(node):
            readers[name] = readers.get(name, 0) + 1
    shape_of = {
        n.output[0]: (n.input[0], tuple(sorted((a.name, a.i) for a in n.attribute)))
        for n in nodes
        if n.op_type == "Shape"
    }

    def source(shape: str) -> object:
        """What a shape input measures: Shape nodes of one tensor give the same shape."""
        return shape_of.get(shape, shape)

    moved: set[int] = set()
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for k, node in enumerate(nodes):
        parts = [made.get(name) for name in node.input]
        if node.op_type != "Sum" or len(parts) < 2 or any(p is None for p in parts):
            continue
        slices = sorted((p for p in parts if p is not None), key=lambda p: p.index)
        if (
            [p.index for p in slices] != list(range(len(slices)))
            or len({(p.axis, source(p.shape)) for p in slices}) != 1
            or any(readers.get(name, 0) != 1 for name in node.input)
        ):
            continue
        axis, shape = slices[0].axis, slices[0].shape
        b = _unique(model, f"{node.output[0]}__concat")
        moved.update(id(p.node) for p in slices)
        replaced[k] = [
            _int64s(f"{b}_axis", [axis]),
            _int64s(f"{b}_count", [len(slices)]),
            _int64s(f"{b}_zero", [0]),
            helper.make_node("Concat", [p.unsqueezed for p in slices], [f"{b}_cat"], axis=axis),
            # pads: zeros before every axis, (size - n) after the gathered one
            helper.make_node("Gather", [shape, f"{b}_axis"], [f"{b}_size"], axis=0),
            helper.make_node("Sub", [f"{b}_size", f"{b}_count"], [f"{b}_rest"]),
            helper.make_node("Mul", [shape, f"{b}_zero"], [f"{b}_zeros"]),
            helper.make_node(
                "ScatterElements",
                [f"{b}_zeros", f"{b}_axis", f"{b}_rest"],
                [f"{b}_after"],
                axis=0,
            ),
            helper.make_node("Concat", [f"{b}_zeros", f"{b}_after"], [f"{b}_pads"], axis=0),
            helper.make_node(
                "Pad",
                [f"{b}_cat", f"{b}_pads"],
                list(node.output),
                name=f"{node.name}__concat" if node.name else "",
            ),
        ]
    if not replaced:
        return nodes
    result: list[onnx.NodeProto] = []
    for k, node in enumerate(nodes):
        if id(node) not in moved:
            result.extend(replaced.get(k, [node]))
    return result


def node_reads(node: onnx.NodeProto) -> list[str]:
    """A node's inputs (absent optional ones left out), with the outer values its subgraphs
    (If, Loop, Scan) read."""
    names = [n for n in node.input if n]
    for attribute in node.attribute:
        for sub in [attribute.g, *attribute.graphs] if attribute.type in (5, 10) else []:
            for inner in sub.node:
                names.extend(node_reads(inner))
    return names


def has_op(model: onnx.ModelProto, op_type: str) -> bool:
    return any(n.op_type == op_type for n in model.graph.node)
