"""The rewrites of a graph once translated to ONNX (`lowering.to_onnx`), each a function of
one `onnx_ir.Graph`.

One job: drop what torchlib's translation of an operator adds that copies a tensor for
nothing, where the FX passes (`fx_passes`) cannot see it because it is made inside a
translation: a transpose that moves no dimension, a cast to the type the value has. ONNX
Runtime runs each such node as a copy of the whole tensor, and its own optimizer leaves them
where the types or permutation are known only once torchlib's functions are inlined. A graph
output keeps its name throughout (the program reads outputs by name).
"""

from __future__ import annotations

from typing import Any

#: the ONNX domain's names (torchlib writes the default domain either way)
_ONNX = ("", "ai.onnx")
#: the types a ConstantOfShape makes and numpy converts to as a Cast does: the ones torch has
_FILLABLE = frozenset(
    {"FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16", "BOOL"}
    | {f"{sign}INT{bits}" for sign in ("", "U") for bits in (8, 16, 32, 64)}
)


def cleaned(graph: Any) -> None:
    """Every rewrite below, in order."""
    identity_transposes_dropped(graph)
    casts_to_own_type_dropped(graph)
    accumulating_scatters_by_element(graph)


def _bypass(graph: Any, node: Any, source: Any) -> bool:
    """Remove `node`, whose one output is `source`'s value unchanged, its uses reading
    `source`; a graph output keeps its name, given to `source` where that is computed in the
    graph and is no other output (else the node stays). Whether it was removed. The type and
    the shape the translator gave the output (from the FX node) pass to `source`, which
    inside a torchlib function has none: the rewrites after read ranks off it, and a graph
    output is declared with its type."""
    out = node.outputs[0]
    if source.dtype is None and out.dtype is not None:
        source.dtype = out.dtype
    if source.shape is None and out.shape is not None:
        source.shape = out.shape
    if out.is_graph_output() and not _output_taken_by(graph, out, source):
        return False
    out.replace_all_uses_with(source)
    graph.remove(node, safe=True)
    return True


def _output_taken_by(graph: Any, out: Any, value: Any) -> bool:
    """`value` put in the place of the graph output `out`, under its name and declared with
    its type (`out` keeps its readers, renamed), where `value` is computed in the graph, is
    no input and no other output, and `out` is an output once. Whether it was."""
    at = [k for k, o in enumerate(graph.outputs) if o is out]
    if len(at) != 1 or value.producer() is None:
        return False
    if value.is_graph_output() or value.is_graph_input():
        return False
    if value.dtype is None and out.dtype is not None:
        value.dtype = out.dtype
    graph.outputs[at[0]] = value
    name = out.name
    out.name = f"{name}.replaced"
    value.name = name  # the program reads outputs by name
    return True


#: a scatter's rows and values (`_rows_scattered`), on its node (in memory, never written)
_ROWS = "ort_autopatch_rows"


def accumulations_into_outputs_left_to_torch(graph: Any) -> dict[str, list[str]]:
    """Each graph output made by adding values into rows of a tensor (`_rows_scattered`: an
    embedding's gradient) returned as that tensor, with the rows and the values as outputs of
    their own, for torch to add in place (`index_add_`, `program`); by output name, the
    names of its rows and values. ONNX Runtime scatters in place only where the result stays
    inside the graph: into a graph output it copies the whole tensor first (ScatterElements
    adding 256 rows into a 50257 x 768 table: 2 ms in place, 57-164 ms as an output; GPT-2
    small's tied gradient, BERT-base's word embeddings'). Only where that tensor is computed
    in the graph and is no other output (else the scatter stays)."""
    import onnx_ir as ir

    added: dict[str, list[str]] = {}
    for node in list(graph):
        kept = node.meta.get(_ROWS)
        if kept is None:
            continue
        out, data = node.outputs[0], node.inputs[0]
        rows, values = kept
        if out.uses() or rows.is_graph_output() or values.is_graph_output():
            continue  # the sum read in the graph too, or rows or values handed out already
        name, index = out.name, node.inputs[1]
        if not _output_taken_by(graph, out, data):
            continue
        graph.remove(node, safe=True)
        # declared with their types (a backward cut in `stages` needs them)
        if values.dtype is None:
            values.dtype = data.dtype
        if rows.dtype is None:
            rows.dtype = ir.DataType.INT64
        rows.name, values.name = f"{name}.rows", f"{name}.values"
        graph.outputs.extend([rows, values])
        _unused_dropped(graph, index)
        added[name] = [rows.name, values.name]
    return added


def _unused_dropped(graph: Any, value: Any) -> None:
    """The node making `value`, and in turn those making its inputs, removed where nothing
    reads their outputs any more."""
    node = value.producer()
    if node is None or node.graph is not graph:  # an input, or removed by another path
        return
    if any(o.uses() or o.is_graph_output() for o in node.outputs):
        return
    inputs = [v for v in node.inputs if v is not None]
    graph.remove(node, safe=True)
    for source in inputs:
        _unused_dropped(graph, source)


def reshapes_into_outputs_left_to_torch(graph: Any) -> dict[str, list[int]]:
    """Each graph output made by a Reshape of a value the graph computes, returned as that
    value instead, under the output's name; the shape the output had, by name, for torch to
    give it back at no cost (`program`). ONNX Runtime copies every Reshape into a graph
    output: a convolution's weight gradient is made as a matrix (ResNet-50's 512 x 4608,
    3.3 ms into (512, 512, 3, 3); 15 ms of its step at batch 2), a language model's logits
    are viewed from (tokens, vocabulary) (GPT-2 small's 51 MB, 9 ms). The graph's own
    readers of the reshaped value keep their Reshape. Only outputs of a static shape (a
    symbolic one would have to be computed again at run time), and only where the value is
    no input, no other output and no constant."""
    viewed: dict[str, list[int]] = {}
    for node in list(graph):
        if node.op_type != "Reshape" or node.domain not in _ONNX or node.inputs[0] is None:
            continue
        out, source = node.outputs[0], node.inputs[0]
        if out.shape is None or not all(isinstance(d, int) for d in out.shape):
            continue
        producer = source.producer()
        if producer is not None and producer.op_type == "Constant":
            continue  # an initializer to ORT, which copies it into an output either way
        name, target = out.name, node.inputs[1] if len(node.inputs) > 1 else None
        if not _output_taken_by(graph, out, source):
            continue
        if not out.uses():  # else the Reshape stays for the graph's own readers
            graph.remove(node, safe=True)
            if target is not None:
                _unused_dropped(graph, target)
        viewed[name] = [int(d) for d in out.shape]
    return viewed


def identity_transposes_dropped(graph: Any) -> None:
    """Transposes that keep every dimension where it is, dropped: torchlib's `index_put`
    moves the indexed dimensions first and back, with `perm=[0, 1]` when they are first
    already, and ONNX Runtime copies the tensor for each (an embedding's gradient: GPT-2
    small's 147 MiB, twice a step)."""
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in _ONNX:
            continue
        perm = node.attributes.get_ints("perm")
        source = node.inputs[0]
        if perm is None or list(perm) != list(range(len(perm))) or source is None:
            continue
        _bypass(graph, node, source)


def _cast_target(node: Any) -> Any:
    """The type a Cast or CastLike node casts to (an `onnx_ir.DataType`), or None."""
    import onnx_ir as ir

    if node.domain not in _ONNX:
        return None
    if node.op_type == "Cast":
        to = node.attributes.get_int("to")
        return None if to is None else ir.DataType(to)
    if node.op_type == "CastLike" and len(node.inputs) == 2 and node.inputs[1] is not None:
        return node.inputs[1].dtype
    return None


def _filled(node: Any) -> Any:
    """The value a ConstantOfShape node fills its tensor with (an `onnx_ir` tensor of one
    element: ONNX's default, float32 zero, where the node names none)."""
    import numpy as np
    import onnx_ir as ir

    value = node.attributes.get("value")
    return ir.tensor(np.zeros(1, dtype=np.float32)) if value is None else value.as_tensor()


def casts_to_own_type_dropped(graph: Any) -> None:
    """Casts of a value to the type it has, dropped, and a ConstantOfShape's tensor made in
    the type it is cast to: torchlib's `new_zeros` is `CastLike(ConstantOfShape(size),
    self)`, and an embedding's gradient starts from one (GPT-2 small's 147 MiB, filled, then
    copied, then copied again by its ScatterND, at the end of backward where the step's
    memory peaks). Only where the type the value has is known: its own, or its
    ConstantOfShape's (which then has no other reader)."""
    import onnx_ir as ir

    for node in list(graph):
        if node.op_type not in ("Cast", "CastLike") or node.inputs[0] is None:
            continue
        target = _cast_target(node)
        if target is None:
            continue
        source = node.inputs[0]
        producer = source.producer()
        if (
            source.dtype != target
            and producer is not None
            and producer.op_type == "ConstantOfShape"
            and producer.domain in _ONNX
            and len(source.uses()) == 1
            and not source.is_graph_output()
        ):
            if target.name not in _FILLABLE:  # a string: the cast says how it is written
                continue
            fill = _filled(producer).numpy().astype(target.numpy())
            producer.attributes["value"] = ir.AttrTensor("value", ir.tensor(fill, dtype=target))
            source.dtype = target
        if source.dtype == target:
            _bypass(graph, node, source)


def accumulating_scatters_by_element(graph: Any) -> None:
    """Every ScatterND that adds (`index_put` with `accumulate=True`: an embedding's
    gradient, `x[ids] += v`) made a ScatterElements that adds, over the data's rows.

    ONNX Runtime's CPU ScatterND splits its updates among its threads and adds them without
    synchronisation: updates of one row from two threads lose one (onnxruntime 1.32, two
    threads: 1024 ids into 2 rows of 768 came out 14 % off, 4096 into BERT's 30522 rows 38 %
    off; from one thread, or below a few hundred updates, exact). BERT-base's token type and
    position embeddings at batch 8 had wrong gradients, which the first-call check refused;
    a race lost nothing on some runs, so a graph that passed its check could still lose
    updates on a later call.
    ScatterElements adds exactly at every size and thread count, at the price of its indices
    spelled out per element (rows x row size int64s) and a slower scatter (44 ms against 10
    for 4096 ids into 30522 x 768). One indexed dim of data of known rank (an embedding's)
    scatters into the data as it is (`_rows_scattered`); other depths have the indexed
    leading dims flattened into one row index, the rest into the row, and the result
    reshaped back (`_flattened_and_scattered`). (onnxruntime-training 1.19.2's ScatterND races
    alike, but the training build's graphs have no adding ScatterND: its embedding gradients
    are ORT's GatherGrad, and the TorchScript exporter writes `index_put` without a
    reduction.)"""
    import numpy as np
    import onnx_ir as ir

    def add(before: Any, op: str, inputs: list[Any], **attributes: Any) -> Any:
        node = ir.node(op, inputs, attributes)  # attributes typed from their Python values
        graph.insert_before(before, node)
        return node.outputs[0]

    def constant(before: Any, values: list[int]) -> Any:
        return add(before, "Constant", [], value=ir.tensor(np.array(values, dtype=np.int64)))

    for node in list(graph):
        if node.op_type != "ScatterND" or node.domain not in _ONNX:
            continue
        if node.attributes.get_string("reduction", "none") != "add" or len(node.inputs) != 3:
            continue
        data, indices, updates = node.inputs
        if data is None or indices is None or updates is None:
            continue
        out = node.outputs[0]
        rank = _rank(data, out)
        if rank is not None and rank >= 1 and _depth(indices) == 1:
            result = _rows_scattered(add, constant, node, data, indices, updates, rank)
        else:
            result = _flattened_and_scattered(add, constant, node, data, indices, updates)
        name, was_output = out.name, out.is_graph_output()
        if result.shape is None:
            result.shape = out.shape
        if result.dtype is None and out.dtype is not None:
            result.dtype = out.dtype
        out.replace_all_uses_with(result, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        if was_output:
            result.name = name  # the program reads outputs by name


def _rank(data: Any, out: Any) -> int | None:
    """The rank of a scatter's data (its result's), where the translation gave either a
    shape."""
    for value in (data, out):
        if value.shape is not None:
            return len(value.shape)
    return None


def _ints(value: Any) -> list[int] | None:
    """A value's integers where a Constant node (or a constant tensor) gives them, or None."""
    if value is None:
        return None
    if value.const_value is not None:
        return [int(v) for v in value.const_value.numpy().reshape(-1)]
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or producer.domain not in _ONNX:
        return None
    listed = producer.attributes.get_ints("value_ints")
    if listed is not None:
        return [int(v) for v in listed]
    tensor = producer.attributes.get("value")
    return None if tensor is None else [int(v) for v in tensor.as_tensor().numpy().reshape(-1)]


def _depth(indices: Any) -> int | None:
    """How many leading dims a ScatterND's index tuples address: the last dim of `indices`
    where its shape says, else torchlib's spelling of `index_put`'s tuples (one index tensor
    per indexed dim, each unsqueezed at -1, concatenated on the last axis)."""
    if indices.shape is not None and len(indices.shape) and isinstance(indices.shape[-1], int):
        return int(indices.shape[-1])
    concat = indices.producer()
    if concat is None or concat.op_type != "Concat" or concat.attributes.get_int("axis") != -1:
        return None
    for part in concat.inputs:
        unsqueeze = None if part is None else part.producer()
        if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.inputs) != 2:
            return None
        if _ints(unsqueeze.inputs[1]) != [-1]:
            return None
    return len(concat.inputs)


def _rows_scattered(
    add: Any, constant: Any, before: Any, data: Any, indices: Any, updates: Any, rank: int
) -> Any:
    """One indexed dim (an embedding's gradient): ScatterElements on the data as it is, one
    row per index (negative ones wrapped), no reshape of the data or the result. A Reshape
    into a graph output is a copy in ONNX Runtime, and GPT-2 small's tied 50257 x 768
    gradient took 94 ms a step in it."""
    rows_count = add(before, "Shape", [data], end=1)
    flat = add(before, "Reshape", [indices, constant(before, [-1])])
    rows = add(before, "Mod", [add(before, "Add", [flat, rows_count]), rows_count])
    rest = add(before, "Shape", [data], start=1)
    values = add(
        before,
        "Reshape",
        [updates, add(before, "Concat", [add(before, "Shape", [rows]), rest], axis=0)],
    )
    column = rows
    if rank > 1:
        column = add(before, "Unsqueeze", [rows, constant(before, list(range(1, rank)))])
    index = add(before, "Expand", [column, add(before, "Shape", [values])])
    result = add(before, "ScatterElements", [data, index, values], axis=0, reduction="add")
    result.producer().meta[_ROWS] = (rows, values)
    return result


def _flattened_and_scattered(
    add: Any, constant: Any, before: Any, data: Any, indices: Any, updates: Any
) -> Any:
    """Several indexed dims, or the depth or the data's rank unknown: the indexed leading
    dims flattened into one row index (`_row_index`), the rest into the row, scattered, and
    reshaped back (a copy where the result is a graph output)."""
    sizes = add(before, "Shape", [data])
    lead = add(
        before, "Slice", [sizes, constant(before, [0]), add(before, "Shape", [indices], start=-1)]
    )
    rows = _row_index(add, constant, before, indices, lead)
    count = add(before, "ReduceProd", [lead], keepdims=1)
    minus_one = constant(before, [-1])
    table = add(before, "Reshape", [data, add(before, "Concat", [count, minus_one], axis=0)])
    width = add(before, "Concat", [add(before, "Shape", [rows]), minus_one], axis=0)
    values = add(before, "Reshape", [updates, width])
    unsqueezed = add(before, "Unsqueeze", [rows, constant(before, [1])])
    index = add(before, "Expand", [unsqueezed, add(before, "Shape", [values])])
    summed = add(before, "ScatterElements", [table, index, values], axis=0, reduction="add")
    return add(before, "Reshape", [summed, sizes])


def _row_index(add: Any, constant: Any, before: Any, indices: Any, lead: Any) -> Any:
    """ScatterND's index tuples (..., depth) as one flat row index over the data's leading
    dims `lead` (sizes, depth of them), row-major: each index taken modulo its dim
    (ScatterND's negative indices count from the end) times the product of the dims after
    it, summed. The depth is read at run time: torchlib's index tensors have no static
    shape here."""
    normal = add(before, "Mod", [add(before, "Add", [indices, lead]), lead])
    depth = add(before, "Shape", [lead])
    zero, one = constant(before, [0]), constant(before, [1])
    positions = add(
        before,
        "Range",
        [
            add(before, "Squeeze", [zero]),
            add(before, "Squeeze", [depth]),
            add(before, "Squeeze", [one]),
        ],
    )
    after = add(before, "Greater", [positions, add(before, "Unsqueeze", [positions, one])])
    square = add(before, "Concat", [depth, depth], axis=0)
    factors = add(before, "Where", [after, add(before, "Expand", [lead, square]), one])
    strides = add(before, "ReduceProd", [factors, one], keepdims=0)  # product of later dims
    row = add(
        before,
        "ReduceSum",
        [add(before, "Mul", [normal, strides]), constant(before, [-1])],
        keepdims=0,
    )
    return add(before, "Reshape", [row, constant(before, [-1])])
