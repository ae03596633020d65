"""Export-time symbolics that turn a traced call into a torch-calling node (torch_nodes.py).

Two sources: a custom `torch.autograd.Function` (the tracer records `prim::PythonOp`; the node
calls the Function's own `apply`, so its own forward and backward run), and any ATen operator
the engine routes to torch (no ONNX symbolic, no ORT gradient, or faster in torch): the node
calls the operator overload the tracer recorded, with the arguments it recorded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.onnx._internal.torchscript_exporter import _type_utils, symbolic_helper

from ort_autopatch.engine import torch_nodes
from ort_autopatch.engine.torch_nodes import TENSOR

_Scalar = _type_utils.JitScalarType
DOMAIN = torch_nodes.DOMAIN

#: ATen operators that draw random numbers: their node runs under the tool's generator.
RANDOM_OPS = frozenset(
    {
        "aten::multinomial",
        "aten::bernoulli",
        "aten::dropout",
        "aten::feature_dropout",
        "aten::alpha_dropout",
        "aten::feature_alpha_dropout",
        "aten::rrelu",
        "aten::rand",
        "aten::rand_like",
        "aten::randn",
        "aten::randn_like",
        "aten::randint",
        "aten::randint_like",
        "aten::randperm",
        "aten::normal",
        "aten::lstm",
        "aten::gru",
        "aten::rnn_tanh",
        "aten::rnn_relu",
        "aten::scaled_dot_product_attention",
        "aten::native_dropout",
    }
)


class NotRoutable(Exception):
    """This call cannot become a torch-calling node; the message says why."""


class _Scalar_:
    """A non-tensor argument computed in the graph: it travels as a tensor, converted back."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def convert(self, tensor: torch.Tensor) -> Any:
        value: Any = tensor.item() if tensor.numel() == 1 else tensor.tolist()
        if self.kind == "int":
            return int(value)
        if self.kind == "float":
            return float(value)
        if self.kind == "bool":
            return bool(value)
        return value


def _onnx_type(value: Any) -> int:
    return _type_code(_Scalar.from_value(value, _Scalar.FLOAT))


def _type_code(scalar: Any) -> int:
    code: Any = scalar.onnx_type()
    return int(code)


def _rank(value: Any) -> int:
    rank = symbolic_helper._get_tensor_rank(value)
    return -1 if rank is None else int(rank)


def _tensor_outputs(node: Any, label: str) -> list[Any]:
    """A traced node's outputs, which a torch-calling node can return only as tensors."""
    outputs = list(node.outputs())
    for out in outputs:
        if not isinstance(out.type(), torch._C.TensorType):
            raise NotRoutable(f"{label} returns a {out.type()}, not tensors")
    return outputs


def emit(
    g: Any,
    *,
    label: str,
    kind: str,
    call: Callable[..., Any],
    template: list[Any],
    tensors: list[Any],
    outputs: list[Any],
    random: bool = False,
    clone_inputs: bool = False,
) -> list[Any]:
    """One PythonOp node; returns its outputs (the context output left out).

    `template` is the flat argument list with TENSOR (or a `_Scalar_` marker) where each of
    `tensors` goes; `outputs` are the traced values whose dtype and rank the node declares.
    """
    bool_inputs = [_Scalar.from_value(t, _Scalar.UNDEFINED) == _Scalar.BOOL for t in tensors]
    out_types = []
    bool_outputs = []
    for out in outputs:
        scalar = _Scalar.from_value(out, _Scalar.UNDEFINED)
        if scalar == _Scalar.UNDEFINED:
            raise NotRoutable(f"{label}: an output has no known dtype")
        bool_outputs.append(scalar == _Scalar.BOOL)
        out_types.append(_Scalar.UINT8 if scalar == _Scalar.BOOL else scalar)
    spec = torch_nodes.new_spec(
        label,
        kind,
        call,
        template,
        bool_inputs,
        bool_outputs,
        random,
        clone_inputs,
        [s.dtype() for s in out_types],
    )
    values = g.op(
        f"{torch_nodes.DOMAIN}::{torch_nodes.OP_TYPE}",
        *tensors,
        func_name_s=spec.name,
        input_convention_s="d" * len(tensors),
        input_tensor_types_i=[_onnx_type(t) for t in tensors],
        input_tensor_ranks_i=[_rank(t) for t in tensors],
        output_tensor_types_i=[_type_code(s) for s in out_types],
        output_tensor_ranks_i=[_rank(o) for o in outputs],
        training_mode_i=1,
        safe_run_mode_i=1,
        comment_s=label,
        outputs=len(outputs) + 1,
    )
    results = []
    for k, (value, out) in enumerate(zip(list(values)[1:], outputs, strict=True)):
        rank = symbolic_helper._get_tensor_rank(out)
        dtype = out_types[k].dtype()
        # dtype and rank only: sizes seen in the trace must not reach later symbolics
        typed = torch._C.TensorType.create_from_tensor(torch.empty((), dtype=dtype))
        if rank is not None:
            typed = typed.with_sizes([None] * rank)
        value.setType(typed)
        if bool_outputs[k]:
            value = g.op("Cast", value, to_i=_Scalar.BOOL.onnx_type())
        results.append(value)
    return results


# -- custom autograd Functions ------------------------------------------------------------------
def autograd_function(g: Any, *args: Any, **kwargs: Any) -> Any:
    """`prim::PythonOp`: the Function's own apply, forward and backward, inside the graph."""
    n = g.original_node
    function = n.pyobj().__self__
    label = f"Function {function.__module__}.{function.__qualname__}"
    if getattr(function, "symbolic", None) is not None:  # pragma: no cover - exporter uses it
        raise NotRoutable(f"{label} has its own symbolic")
    template: list[Any] = []
    tensors: list[Any] = []
    for arg, convention in zip(args, n.cconv(), strict=True):
        if convention == "d":
            template.append(TENSOR)
            tensors.append(arg)
            continue
        from torch.utils import _pytree as pytree

        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(arg)):
            raise NotRoutable(
                f"{label} takes a tensor inside a {type(arg).__name__} argument, which a graph "
                "would freeze; pass tensors as direct arguments of apply()"
            )
        template.append(arg)
    outputs = _tensor_outputs(n, label)
    results = emit(
        g,
        label=label,
        kind="function",
        call=function.apply,
        template=template,
        tensors=tensors,
        outputs=outputs,
        random=False,
        clone_inputs=True,
    )
    return results[0] if len(results) == 1 else tuple(results)


# -- ATen operators ----------------------------------------------------------------------------
def _constant(value: Any) -> tuple[bool, Any]:
    """(True, python value) when `value` is known at export time."""
    if symbolic_helper._is_none(value):
        return True, None
    if not isinstance(value, torch._C.Value):
        return True, value
    node = value.node()
    if node.kind() in ("onnx::Constant", "prim::Constant"):
        if "value" not in node.attributeNames():
            return True, None
        found = symbolic_helper._node_get(node, "value")
        return True, found
    if symbolic_helper._is_packed_list(value):
        items = [_constant(v) for v in symbolic_helper._unpack_list(value)]
        if all(ok for ok, _ in items):
            return True, [v for _, v in items]
    return False, None


def _describe(kind: Any) -> tuple[str, bool]:
    """A schema type as (base name, is list): ("Tensor", False), ("int", True), ..."""
    if isinstance(kind, torch._C.OptionalType):
        kind = kind.getElementType()
    if isinstance(kind, torch._C.ListType):
        inner = kind.getElementType()
        if isinstance(inner, torch._C.OptionalType):
            inner = inner.getElementType()
        return _base(inner), True
    return _base(kind), False


def _base(kind: Any) -> str:
    if isinstance(kind, torch._C.TensorType):
        return "Tensor"
    text = str(kind)
    return {"SymInt": "int", "number": "Scalar", "SymFloat": "float", "SymBool": "bool"}.get(
        text, text
    )


def _python(found: Any, base: str, is_list: bool) -> Any:
    """A constant from the trace as the Python value the operator's schema wants."""
    if found is None:
        return None
    if isinstance(found, list):
        return [_python(f, base, False) for f in found]
    if not isinstance(found, torch.Tensor):
        return found
    if is_list:
        return [_python(v, base, False) for v in found.reshape(-1)]
    if base == "int" and str(found.dtype) == "torch.int64":
        return int(found.item())
    if base == "float":
        return float(found.item())
    if base == "bool":
        return bool(found.item())
    if base == "ScalarType":
        return _Scalar(int(found.item())).dtype()
    if base in ("int", "Scalar") and found.numel() == 1:
        return found.item()
    raise NotRoutable(f"a constant of type {base} cannot be rebuilt")


def _schema_for(name: str, inputs: list[Any]) -> Any:
    """The traced overload: the conversion passes drop node schemas, so the candidates are
    scored by how well constants and tensors fit their arguments."""
    best, best_score = None, -1
    for schema in torch._C._jit_get_schemas_for_operator(name):
        if schema.overload_name.endswith("out") or "!" in str(schema):
            continue
        arguments = schema.arguments
        if len(arguments) != len(inputs):
            continue
        score = 0
        for argument, value in zip(arguments, inputs, strict=True):
            base, is_list = _describe(argument.type)
            constant, _ = _constant(value)
            tensor_arg = base == "Tensor" and not is_list
            if base == "Tensor" and is_list != symbolic_helper._is_packed_list(value):
                score = -1
                break
            if tensor_arg and not constant:
                score += 2
            elif not tensor_arg and constant:
                score += 1
        if score >= 0 and score > best_score:
            best, best_score = schema, score
    if best is None:
        raise NotRoutable(f"{name}: no overload takes {len(inputs)} arguments")
    return best


def _transposed(inputs: tuple[Any, ...]) -> bool:
    known, value = _constant(inputs[6]) if len(inputs) > 6 else (False, None)
    return not known or bool(_python(value, "bool", False))


def aten_symbolic(name: str) -> Callable[..., Any]:
    """A symbolic that sends the traced `name` (e.g. "aten::cummax") to torch."""

    def symbolic(g: Any, *inputs: Any, **attrs: Any) -> Any:
        node = g.original_node
        if name == "aten::_convolution" and not _transposed(inputs):
            # only transposed convolutions lack CPU gradient kernels; others stay in ONNX
            from torch.onnx._internal.torchscript_exporter import symbolic_opset9

            return symbolic_opset9._convolution(g, *inputs)
        schema = _schema_for(node.kind(), list(inputs))
        overload = getattr(
            getattr(torch.ops.aten, schema.name.split("::", 1)[1]),
            schema.overload_name or "default",
        )
        template: list[Any] = []
        tensors: list[Any] = []
        names: list[str | None] = []
        for argument, value in zip(schema.arguments, inputs, strict=True):
            base, is_list = _describe(argument.type)
            names.append(argument.name if argument.kwarg_only else None)
            if base == "Tensor" and not is_list:
                if symbolic_helper._is_none(value):
                    template.append(None)
                else:
                    template.append(TENSOR)
                    tensors.append(value)
                continue
            if base == "Tensor":
                listed: list[Any] = []
                for item in symbolic_helper._unpack_list(value):
                    if symbolic_helper._is_none(item):
                        listed.append(None)
                    else:
                        listed.append(TENSOR)
                        tensors.append(item)
                template.append(listed)
                continue
            known, found = _constant(value)
            if known:
                template.append(_python(found, base, is_list))
                continue
            if base in ("int", "float", "bool", "Scalar") and not is_list:
                template.append(_Scalar_(base))
                tensors.append(value)
                continue
            if base == "int" and symbolic_helper._is_packed_list(value):
                listed = []
                for item in symbolic_helper._unpack_list(value):
                    known_item, item_value = _constant(item)
                    if known_item:
                        listed.append(_python(item_value, "int", False))
                    else:
                        listed.append(_Scalar_("int"))
                        tensors.append(item)
                template.append(listed)
                continue
            raise NotRoutable(f"{name}: argument {argument.name} ({argument.type}) is not known")
        positional = [n is None for n in names]

        def call(*values: Any) -> Any:
            args = [v for v, p in zip(values, positional, strict=True) if p]
            kwargs = {n: v for v, n in zip(values, names, strict=True) if n is not None}
            return overload(*args, **kwargs)

        outputs = _tensor_outputs(node, name)
        results = emit(
            g,
            label=name,
            kind="aten",
            call=call,
            template=template,
            tensors=tensors,
            outputs=outputs,
            random=name in RANDOM_OPS,
        )
        return results[0] if len(results) == 1 else tuple(results)

    return symbolic


#: Gradient operators ORT 1.19.2's builder emits but its CPU build has no kernel for (the
#: session would be rejected), with the forward operator they differentiate.
MISSING_CPU_GRADIENT_KERNELS = {"ConvTransposeGrad": "ConvTranspose", "ResizeGrad": "Resize"}
#: Gradient operators that take their input's shape from shape inference: behind a
#: torch-calling node (whose output sizes ORT cannot infer) they return an empty gradient.
SHAPE_INFERRED_GRADIENTS = {"AveragePoolGrad": "AveragePool"}


def default_routes(device: torch.device) -> frozenset[str]:
    """Operators sent to torch up front on `device`, by a measured rule.

    On CUDA, `scaled_dot_product_attention` runs torch's fused flash/efficient kernels inside
    the graph (ORT's CUDA build would run the unfused MatMul/Softmax/MatMul the symbolic emits).
    On CPU the ONNX path stays for attention: torch's CPU flash kernel inside the graph measured
    no faster (TransformerEncoderLayer d256, 64 tokens, ratio to eager at 1 thread 1.25 ONNX vs
    1.27 torch, at 2 threads 1.69 vs 1.60, noisy; `bench_profile.py` measures it), as a node
    costs a Python round trip per call. (Slow CPU gradient kernels are replaced in the gradient
    graph instead: `gradients_in_torch`.)
    """
    if device.type == "cuda":
        return frozenset({"aten::scaled_dot_product_attention"})
    return frozenset()


def culprits(message: str, provenance: dict[str, set[str]]) -> set[str]:
    """The ATen operators whose export produced the ONNX operator an ORT error names."""
    import re

    found = re.search(r"no gradient for operator (\w+)", message)
    if found is None:
        return set()
    return producers(found[1], provenance)


def producers(op_type: str, provenance: dict[str, set[str]]) -> set[str]:
    """The ATen operators whose export produced ONNX operator `op_type`."""
    return {name for name, made in provenance.items() if op_type in made}


def unrunnable_gradients(gradient_model: bytes, device: torch.device) -> set[str]:
    """Forward ONNX operators whose gradient nodes this device has no kernel for."""
    if device.type != "cpu":
        return set()
    import onnx

    model = onnx.load_from_string(gradient_model)
    found = {
        MISSING_CPU_GRADIENT_KERNELS[n.op_type]
        for n in model.graph.node
        if n.op_type in MISSING_CPU_GRADIENT_KERNELS
    }
    forward_ops = set(SHAPE_INFERRED_GRADIENTS.values())
    if any(n.op_type in SHAPE_INFERRED_GRADIENTS for n in model.graph.node) and any(
        n.op_type == torch_nodes.OP_TYPE for n in model.graph.node
    ):
        inferred = onnx.shape_inference.infer_shapes(model)
        known = {
            v.name
            for v in (*inferred.graph.value_info, *inferred.graph.input)
            if v.type.tensor_type.HasField("shape")
            and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)
        }
        found |= {
            n.op_type
            for n in inferred.graph.node
            if n.op_type in forward_ops and n.input[0] not in known
        }
    return found


#: Elements from which a gradient node runs in torch on CPU (`gradients_in_torch`): below,
#: ORT's own kernel beats the round trip (about 80 us).
GRADIENT_IN_TORCH_FROM = 1 << 14


def _relu_backward(grad: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward.default(grad, result, 0.0)


def _layer_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    *,
    axis: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ORT's mean and inverse standard deviation are torch's `mean` and `rstd`; the bias only
    # tells torch to compute its gradient (its values are never read)
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = (
        torch.ops.aten.native_layer_norm_backward.default(
            grad, x, list(x.shape[axis:]), mean, rstd, weight, weight, [True, True, True]
        )
    )
    return result


#: A gradient node's torch call and the ranks of its inputs and outputs, from the node and
#: the rank of its forward tensor (-1: unknown); None where the node's form is not the one known.
_Binding = tuple[Callable[..., Any], list[int], list[int]]


def _bind_relu(node: Any, rank: int) -> _Binding | None:
    if len(node.input) != 2:  # (incoming gradient, the ReLU's output)
        return None
    return _relu_backward, [rank, rank], [rank]


def _bind_layer_norm(node: Any, rank: int) -> _Binding | None:
    if len(node.input) != 5:  # (incoming gradient, x, scale, mean, inverse std)
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
    if axis >= 0 and rank < 0:
        return None  # how many dimensions it normalises is unknown
    normalized = -axis if axis < 0 else rank - axis
    call = functools.partial(_layer_norm_backward, axis=axis)
    return call, [rank, rank, normalized, rank, rank], [rank, normalized, normalized]


#: ORT CPU gradient kernels slower than the torch function eager's backward calls, by
#: operator type: what reports call them, and how to call it. Measured alone (2^20 floats, 1
#: thread): `ReluGrad` 5.7 ms (an Eigen select branching per element) against
#: `threshold_backward` 0.5 ms; `LayerNormalizationGrad` (16x64x256) 2.3 ms at 1 thread and
#: 2.4 at 2 (not parallel) against `native_layer_norm_backward` 0.3.
GRADIENTS_IN_TORCH: dict[str, tuple[str, Callable[[Any, int], _Binding | None]]] = {
    "ReluGrad": ("aten::threshold_backward", _bind_relu),
    "LayerNormalizationGrad": ("aten::native_layer_norm_backward", _bind_layer_norm),
}


def gradients_in_torch(
    gradient_model: bytes,
    input_shapes: dict[str, tuple[int, ...]],
    may_route: Callable[[str], bool],
) -> bytes:
    """ORT's slow CPU gradient nodes (`GRADIENTS_IN_TORCH`) as torch-calling nodes running the
    function eager's backward runs, so the same numbers: `threshold_backward` keeps eager's 0
    where an infinite gradient meets a zeroed ReLU unit (`sqrt(relu(x))`), which `Mul` by the
    mask, the one faster ONNX form, turns into NaN.

    The forward nodes stay ONNX (no round trip; what reads them, such as pooling gradients,
    keeps its shapes). A node is replaced when its input is large enough to pay for the round
    trip, judged by its size for the call being built (`input_shapes`, the graph inputs'
    shapes), as the trace judges sizes; where shape inference cannot tell (dynamic `Reshape`
    targets, a forward torch-calling node upstream), by the call's largest input. Such a node's
    outputs then have no declared rank, which ORT's shape inference may refuse in a graph of
    static shapes; the engine then keeps ORT's kernels for that graph.
    """
    import onnx
    from onnx import TensorProto, helper

    if not any(op.encode() in gradient_model for op in GRADIENTS_IN_TORCH):
        return gradient_model
    model = onnx.load_from_string(gradient_model)
    shaped = onnx.ModelProto()
    shaped.CopyFrom(model)
    for graph_input in shaped.graph.input:
        shape = input_shapes.get(graph_input.name)
        dims = graph_input.type.tensor_type.shape.dim
        if shape is not None and len(dims) == len(shape):
            for dim, size in zip(dims, shape, strict=True):
                dim.Clear()
                dim.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(shaped)
    largest_input = max(map(math.prod, input_shapes.values()), default=0)
    types = {
        v.name: v.type.tensor_type for v in (*inferred.graph.value_info, *inferred.graph.input)
    }
    taken = {o for n in model.graph.node for o in n.output}
    # where inference lost even the type, it is float32 if every floating input is
    floating = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
    fed = {i.type.tensor_type.elem_type for i in model.graph.input} & floating
    float32 = (
        onnx.TypeProto.Tensor(elem_type=TensorProto.FLOAT) if fed == {TensorProto.FLOAT} else None
    )
    swapped = 0
    nodes = []
    for node in model.graph.node:
        route = GRADIENTS_IN_TORCH.get(node.op_type) if node.domain == DOMAIN else None
        known = types.get(node.input[1], float32) if route is not None else None
        if route is None or known is None or known.elem_type != TensorProto.FLOAT:
            nodes.append(node)
            continue
        label, bind = route
        rank, numel = -1, largest_input  # unknown behind dynamic reshapes or a torch node
        if known.HasField("shape"):
            dims = known.shape.dim
            rank = len(dims)
            if all(d.HasField("dim_value") for d in dims):
                numel = math.prod(d.dim_value for d in dims)
        binding = bind(node, rank)
        if binding is None or numel < GRADIENT_IN_TORCH_FROM or not may_route(label):
            nodes.append(node)
            continue
        call, input_ranks, output_ranks = binding
        spec = torch_nodes.new_spec(
            label,
            "aten",
            call,
            [TENSOR] * len(input_ranks),
            [False] * len(input_ranks),
            [False] * len(output_ranks),
            output_dtypes=[torch.float32] * len(output_ranks),
        )
        outputs = []
        for k in range(len(output_ranks)):
            name = node.output[k] if k < len(node.output) else ""
            if not name:  # an output the graph does not use still needs a name here
                name = f"{node.name or node.op_type}__unused_{k}"
                while name in taken:
                    name += "_"
                taken.add(name)
            outputs.append(name)
        nodes.append(
            helper.make_node(
                torch_nodes.OP_TYPE,
                list(node.input),
                [f"{outputs[0]}__context", *outputs],
                name=f"{node.name}__torch",
                domain=DOMAIN,
                func_name=spec.name,
                input_convention="d" * len(input_ranks),
                input_tensor_types=[TensorProto.FLOAT] * len(input_ranks),
                input_tensor_ranks=input_ranks,
                output_tensor_types=[TensorProto.FLOAT] * len(output_ranks),
                output_tensor_ranks=output_ranks,
                training_mode=0,  # a node of the backward pass: nothing to differentiate
                safe_run_mode=1,
                comment=spec.label,
            )
        )
        swapped += 1
    if swapped == 0:
        return gradient_model  # the very same graph
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model.SerializeToString()
