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


def _bypass(graph: Any, node: Any, source: Any) -> bool:
    """Remove `node`, whose one output is `source`'s value unchanged, its uses reading
    `source`; a graph output keeps its name, given to `source` where that is computed in the
    graph and is no other output (else the node stays). Whether it was removed."""
    out = node.outputs[0]
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
