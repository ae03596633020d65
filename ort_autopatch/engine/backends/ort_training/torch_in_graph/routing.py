"""Export-time symbolics that turn a traced call into a torch-calling node (`nodes.py`).

Two sources: a custom `torch.autograd.Function` (the tracer records `prim::PythonOp`; the node
calls the Function's own `apply`, so its own forward and backward run), and any ATen operator
the engine routes to torch (no ONNX symbolic, no ORT gradient, or faster in torch): the node
calls the operator overload the tracer recorded, with the arguments it recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.onnx._internal.torchscript_exporter import _type_utils, symbolic_helper

from ort_autopatch.engine import random_ops
from ort_autopatch.engine.backends.ort_training.torch_in_graph import nodes, stored
from ort_autopatch.engine.backends.ort_training.torch_in_graph.stored import TENSOR, ScalarMarker

_Scalar = _type_utils.JitScalarType
DOMAIN = nodes.DOMAIN


class NotRoutable(Exception):
    """This call cannot become a torch-calling node; the message says why."""


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


def emit(g: Any, callee: nodes.Callee, tensors: list[Any], outputs: list[Any]) -> list[Any]:
    """One PythonOp node; returns its outputs (the context output left out).

    `callee.template` is the flat argument list with TENSOR (or a `ScalarMarker`) where each
    of `tensors` goes; `outputs` are the traced values whose dtype and rank the node declares.
    """
    bool_inputs = [_Scalar.from_value(t, _Scalar.UNDEFINED) == _Scalar.BOOL for t in tensors]
    out_types = []
    bool_outputs = []
    for out in outputs:
        scalar = _Scalar.from_value(out, _Scalar.UNDEFINED)
        if scalar == _Scalar.UNDEFINED:
            raise NotRoutable(f"{callee.label}: an output has no known dtype")
        bool_outputs.append(scalar == _Scalar.BOOL)
        out_types.append(_Scalar.UINT8 if scalar == _Scalar.BOOL else scalar)
    spec = nodes.new_spec(callee, bool_inputs, bool_outputs, [s.dtype() for s in out_types])
    values = g.op(
        f"{nodes.DOMAIN}::{nodes.OP_TYPE}",
        *tensors,
        func_name_s=spec.name,
        input_convention_s="d" * len(tensors),
        input_tensor_types_i=[_onnx_type(t) for t in tensors],
        input_tensor_ranks_i=[_rank(t) for t in tensors],
        output_tensor_types_i=[_type_code(s) for s in out_types],
        output_tensor_ranks_i=[_rank(o) for o in outputs],
        training_mode_i=1,
        safe_run_mode_i=1,
        comment_s=callee.label,
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
    callee = nodes.Callee(label, "function", function.apply, template, clone_inputs=True)
    results = emit(g, callee, tensors, outputs)
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


def _fits(kind: Any, found: Any) -> bool:
    """Whether a constant from the trace can be an argument of schema type `kind`: None only
    where the argument is optional, a list only where it is one, a tensor with dimensions
    only where a tensor or a list goes."""
    if found is None:
        return isinstance(kind, torch._C.OptionalType)
    if isinstance(kind, torch._C.OptionalType):
        kind = kind.getElementType()
    if isinstance(found, list):
        return isinstance(kind, torch._C.ListType)
    if isinstance(found, torch.Tensor) and found.dim() > 0:
        # a tensor constant with dimensions (a plain tensor attribute, traced as a constant):
        # only a Tensor or a list takes it (`bitwise_or.Tensor`, not `.Scalar`, whose result
        # would lose the tensor's shape and type promotion)
        return isinstance(kind, (torch._C.TensorType, torch._C.ListType))
    return True


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
            constant, found = _constant(value)
            tensor_arg = base == "Tensor" and not is_list
            if base == "Tensor" and is_list != symbolic_helper._is_packed_list(value):
                score = -1
                break
            if constant and not _fits(argument.type, found):
                score = -1  # upsample_nearest1d(self, int[1], float?) taking .vec's None
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
                template.append(ScalarMarker(base))
                tensors.append(value)
                continue
            if base == "int" and symbolic_helper._is_packed_list(value):
                listed = []
                for item in symbolic_helper._unpack_list(value):
                    known_item, item_value = _constant(item)
                    if known_item:
                        listed.append(_python(item_value, "int", False))
                    else:
                        listed.append(ScalarMarker("int"))
                        tensors.append(item)
                template.append(listed)
                continue
            raise NotRoutable(f"{name}: argument {argument.name} ({argument.type}) is not known")
        outputs = _tensor_outputs(node, name)
        random = random_ops.aten(name)  # a random operator runs under the tool's generator
        operator = f"{schema.name}.{schema.overload_name or 'default'}"
        callee = nodes.Callee(
            name,
            "aten",
            stored.aten_call(overload, names),
            template,
            random=random,
            described=stored.describe(operator, names, name, template, random),
        )
        results = emit(g, callee, tensors, outputs)
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

    On CPU an LSTM runs torch's kernel: ORT 1.19.2's LSTM and LSTMGrad took 59-63 ms of a
    2-layer LSTM language model's step (35 tokens x 20, 128 units, 2 threads) where eager took
    32-40 ms and the routed graph 35-38 ms, and they refuse a bidirectional LSTM. Not GRU (ORT's
    GRU measured faster than eager's: 52 ms against 61 ms) nor the tanh RNN (no difference).
    """
    if device.type == "cuda":
        return frozenset({"aten::scaled_dot_product_attention"})
    return frozenset({"aten::lstm"})


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
        n.op_type == nodes.OP_TYPE for n in model.graph.node
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
