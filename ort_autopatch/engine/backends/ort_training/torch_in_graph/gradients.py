"""ORT's slow CPU gradient kernels replaced, in a built gradient graph, by the torch function
eager's backward runs for the same operator.

Measured alone (2^20 floats, 1 thread): ORT's `ReluGrad` takes 5.7 ms (an Eigen select that
branches per element) against torch's `threshold_backward` 0.26 ms; `LayerNormalizationGrad`
(16x64x256) 2.3 ms at 1 thread and 2.4 at 2 (not parallel) against `native_layer_norm_backward`
0.3; `GeluGrad` (8x64x512) 1.47 ms at 1 thread and 1.46 at 2 against `gelu_backward` 0.55 and
0.42. The same function gives eager's numbers: `threshold_backward` keeps eager's 0 where an
infinite gradient meets a zeroed ReLU unit (`sqrt(relu(x))`), which `Mul` by the mask, the one
faster ONNX form, turns into NaN; ONNX's `Where` is as slow as `ReluGrad`; ORT's `GeluGrad`
computes another erf (1.4e-6 away).

Two kinds of node call torch: an `ATen` node through the compiled executor (`aten_executor`, about
15 us a node) where it is available, else a `PythonOp` (`nodes`, 0.1 to 0.2 ms). Each
replaces a gradient node from its own size on (`ATEN_FROM`, `PYTHON_FROM`). The forward nodes
stay ONNX: no round trip, and what reads them (pooling gradients) keeps its shapes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor, nodes
from ort_autopatch.engine.backends.ort_training.torch_in_graph.stored import TENSOR

#: Elements from which a gradient node calls torch through the compiled executor: ORT's
#: `ReluGrad` takes 141 us for 2^15 floats and an `ATen` node 19 us (about 15 of them fixed);
#: they meet near 2^12.
ATEN_FROM = 1 << 12
#: Elements from which a gradient node calls torch through Python, without the executor.
PYTHON_FROM = 1 << 14

_CONSTANT = "ort_autopatch.aten."  # initializer names of the ATen nodes' scalar arguments
_TO_THE_END = 1 << 62  # Slice's "to the end"


def _relu_backward(grad: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward.default(grad, result, 0.0)


def _gelu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward.default(grad, x, approximate="none")


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


#: An ATen node's form: the nodes computing arguments first, and its arguments in the
#: operator's order (node inputs, or constants made as initializers).
_AtenForm = tuple[list[Any], list[str]]


@dataclass(frozen=True)
class _Binding:
    """How one gradient node calls torch."""

    python: Callable[..., Any]  # the PythonOp's callable, on the node's inputs
    input_ranks: list[int]  # the PythonOp's declared ranks (-1: unknown)
    output_ranks: list[int]
    aten: Callable[[Any, _Constants], _AtenForm]  # the ATen node's, from the node


def _aten_relu(node: Any, make: _Constants) -> _AtenForm:
    # threshold_backward(grad_output, self, threshold)
    return [], [node.input[0], node.input[1], make.float(0.0)]


def _bind_relu(node: Any, rank: int) -> _Binding | None:
    if len(node.input) != 2:  # (incoming gradient, the ReLU's output)
        return None
    return _Binding(_relu_backward, [rank, rank], [rank], _aten_relu)


def _aten_gelu(node: Any, make: _Constants) -> _AtenForm:
    # gelu_backward(grad_output, self, *, approximate): ORT's Gelu is the exact (erf) one
    return [], [node.input[0], node.input[1], make.string("none")]


def _bind_gelu(node: Any, rank: int) -> _Binding | None:
    if len(node.input) != 2:  # (incoming gradient, the Gelu's input)
        return None
    return _Binding(_gelu_backward, [rank, rank], [rank], _aten_gelu)


def _aten_layer_norm(node: Any, make: _Constants, *, axis: int) -> _AtenForm:
    from onnx import helper

    grad, x, scale, mean, rstd = node.input
    # native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
    # output_mask); the bias only asks for its gradient. The normalized shape is x's trailing
    # dimensions, read at run time (dynamic graphs; Slice, as opset 14's Shape takes no start)
    prefix = node.name or node.output[0]
    shape, normalized = f"{prefix}__shape", f"{prefix}__normalized_shape"
    prelude = [
        helper.make_node("Shape", [x], [shape]),
        helper.make_node(
            "Slice", [shape, make.ints([axis]), make.ints([_TO_THE_END])], [normalized]
        ),
    ]
    return prelude, [grad, x, normalized, mean, rstd, scale, scale, make.ints([1, 1, 1])]


def _bind_layer_norm(node: Any, rank: int) -> _Binding | None:
    if len(node.input) != 5:  # (incoming gradient, x, scale, mean, inverse std)
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
    if axis >= 0 and rank < 0:
        return None  # how many dimensions it normalises is unknown
    normalized = -axis if axis < 0 else rank - axis
    return _Binding(
        functools.partial(_layer_norm_backward, axis=axis),
        [rank, rank, normalized, rank, rank],
        [rank, normalized, normalized],
        functools.partial(_aten_layer_norm, axis=axis),
    )


#: ORT gradient operators replaced, with the torch operator each calls and its binding.
GRADIENTS_IN_TORCH: dict[str, tuple[str, Callable[[Any, int], _Binding | None]]] = {
    "ReluGrad": ("aten::threshold_backward", _bind_relu),
    "LayerNormalizationGrad": ("aten::native_layer_norm_backward", _bind_layer_norm),
    "GeluGrad": ("aten::gelu_backward", _bind_gelu),
}


class _Constants:
    """Initializers for the ATen nodes' non-tensor arguments, one per value."""

    def __init__(self) -> None:
        self.made: dict[str, Any] = {}

    def float(self, value: float) -> str:
        import numpy as np

        return self._add(f"{_CONSTANT}float.{value!r}", np.array(value, dtype=np.float32))

    def string(self, value: str) -> str:
        import numpy as np

        data = np.frombuffer(value.encode(), dtype=np.uint8)  # the executor reads UTF-8 bytes
        return self._add(f"{_CONSTANT}str.{value}", data)

    def ints(self, values: list[int]) -> str:
        import numpy as np

        text = "_".join(map(str, values))
        return self._add(f"{_CONSTANT}ints.{text}", np.array(values, dtype=np.int64))

    def _add(self, name: str, value: Any) -> str:
        from onnx import numpy_helper

        if name not in self.made:
            self.made[name] = numpy_helper.from_array(value, name)
        return name


def warm_up() -> None:
    """Pay onnx's first shape inference (~15 ms: its operator schemas load on first use) ahead
    of `gradients_in_torch`, where it costs no time: while a forked child builds the gradient
    graph (`agent.build_gradient`'s `meanwhile`)."""
    from onnx import TensorProto, helper, shape_inference

    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "warm_up",
        [value("x", TensorProto.FLOAT, [1])],
        [value("y", TensorProto.FLOAT, [1])],
    )
    shape_inference.infer_shapes(helper.make_model(graph))


def gradients_in_torch(
    gradient_model: bytes,
    input_shapes: dict[str, tuple[int, ...]],
    may_route: Callable[[str], bool],
    aten: Callable[[], bool],
) -> bytes:
    """The gradient graph with its `GRADIENTS_IN_TORCH` nodes calling torch: as `ATen` nodes
    when `aten()` (the executor is registered; asked only once a node is large enough for one,
    so a graph that has none never compiles it), else as `PythonOp`s.

    A node is replaced when its input is large enough to pay for the call, judged by its size
    for the call being built (`input_shapes`, the graph inputs' shapes), as the trace judges
    sizes; where shape inference cannot tell (dynamic `Reshape` targets, a forward
    torch-calling node upstream), by the call's largest input. Such a node's outputs then have
    no declared rank, which ORT's shape inference may refuse in a graph of static shapes; the
    engine then keeps ORT's kernels for that graph.
    """
    import onnx
    from onnx import TensorProto

    if not any(op.encode() in gradient_model for op in GRADIENTS_IN_TORCH):
        return gradient_model  # no parsing for a graph without them
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
    constants = _Constants()
    declared = {v.name for v in model.graph.value_info}
    typed: list[Any] = []  # value_info the ATen nodes' outputs need (ORT cannot infer them)
    swapped = 0
    executor: bool | None = None  # aten(), once asked
    rewritten: list[Any] = []
    for node in model.graph.node:
        route = GRADIENTS_IN_TORCH.get(node.op_type) if node.domain == nodes.DOMAIN else None
        known = types.get(node.input[1], float32) if route is not None else None
        if route is None or known is None or known.elem_type != TensorProto.FLOAT:
            rewritten.append(node)
            continue
        label, bind = route
        rank, numel = -1, largest_input  # unknown behind dynamic reshapes or a torch node
        if known.HasField("shape"):
            dims = known.shape.dim
            rank = len(dims)
            if all(d.HasField("dim_value") for d in dims):
                numel = math.prod(d.dim_value for d in dims)
        if numel < ATEN_FROM or not may_route(label):
            rewritten.append(node)
            continue
        if executor is None:
            executor = aten()
        binding = bind(node, rank) if executor or numel >= PYTHON_FROM else None
        if binding is None:
            rewritten.append(node)
            continue
        outputs = []
        for k in range(len(binding.output_ranks)):
            name = node.output[k] if k < len(node.output) else ""
            if not name:  # an output the graph does not use still needs a name here
                name = f"{node.name or node.op_type}__unused_{k}"
                while name in taken:
                    name += "_"
                taken.add(name)
            outputs.append(name)
        if executor:
            prelude, arguments = binding.aten(node, constants)
            rewritten.extend(prelude)
            rewritten.append(aten_executor.node(label, arguments, outputs, f"{node.name}__aten"))
            typed.extend(
                _float_info(name, rank)
                for name, rank in zip(outputs, binding.output_ranks, strict=True)
                if name not in declared
            )
        else:
            rewritten.append(_python_node(node, label, binding, outputs))
        swapped += 1
    if swapped == 0:
        return gradient_model  # the very same graph
    del model.graph.node[:]
    model.graph.node.extend(rewritten)
    model.graph.initializer.extend(constants.made.values())
    model.graph.value_info.extend(typed)
    if executor and not any(o.domain == aten_executor.DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(aten_executor.DOMAIN, 1))
    return model.SerializeToString()


def _float_info(name: str, rank: int) -> Any:
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(
        name, TensorProto.FLOAT, None if rank < 0 else [None] * rank
    )


def _python_node(node: Any, label: str, binding: _Binding, outputs: list[str]) -> Any:
    from onnx import TensorProto, helper

    spec = nodes.new_spec(
        nodes.Callee(label, "aten", binding.python, [TENSOR] * len(binding.input_ranks)),
        [False] * len(binding.input_ranks),
        [False] * len(binding.output_ranks),
        output_dtypes=[torch.float32] * len(binding.output_ranks),
    )
    return helper.make_node(
        nodes.OP_TYPE,
        list(node.input),
        [f"{outputs[0]}__context", *outputs],
        name=f"{node.name}__torch",
        domain=nodes.DOMAIN,
        func_name=spec.name,
        input_convention="d" * len(binding.input_ranks),
        input_tensor_types=[TensorProto.FLOAT] * len(binding.input_ranks),
        input_tensor_ranks=binding.input_ranks,
        output_tensor_types=[TensorProto.FLOAT] * len(binding.output_ranks),
        output_tensor_ranks=binding.output_ranks,
        training_mode=0,  # a node of the backward pass: nothing to differentiate
        safe_run_mode=1,
        comment=spec.label,
    )
