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
    graph and is no other output (else the node stays). Whether it was removed. The shape the
    translator gave the output (from the FX node) passes to `source`, which inside a
    torchlib function has none: the rewrites after read ranks off it."""
    out = node.outputs[0]
    if source.shape is None and out.shape is not None:
        source.shape = out.shape
    if not out.is_graph_output():
        out.replace_all_uses_with(source)
        graph.remove(node, safe=True)
        return True
    if source.producer() is None or source.is_graph_output() or source.is_graph_input():
        return False
    if sum(o is out for o in graph.outputs) != 1:
        return False
    name = out.name
    out.replace_all_uses_with(source, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    source.name = name
    return True


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
    if rank > 1:
        rows = add(before, "Unsqueeze", [rows, constant(before, list(range(1, rank)))])
    index = add(before, "Expand", [rows, add(before, "Shape", [values])])
    return add(before, "ScatterElements", [data, index, values], axis=0, reduction="add")


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
