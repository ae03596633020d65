"""Outputs that share memory with an input, an intermediate or another output, as eager has them.

aot_autograd's graphs are functional: an output that eager returns as a view (`x.T`,
`x.diagonal()`, `x.chunk(3)`, a view of a parameter, two views of one intermediate) is
computed there as a value of its own, and aot's own runtime wrappers regenerate the view
outside the compiled graph from its base (`AliasOfInputHandler`, `gen_alias_from_base`). ONNX
Runtime's outputs are fresh memory, so this backend does the same: the forward graph's chain of
view operators from the base to the output (read off the FX graph, nothing but views and size
arithmetic) is kept as plain data (`Replay`, stored beside the graphs in the persistent cache)
and replayed by torch on the real base at each call: the caller's input or parameter, the
intermediate base that the training Function returns, or another output. The result is a real
view with eager's `_base`, writes through it reach the base, and autograd raises where eager
raises (an in-place change of a view of a leaf that requires grad) and routes gradients
through the view's own backward. An output that is another output's very tensor (`return y, y`)
is that tensor again, as eager returns one object twice.

At capture, `regenerated` decides which outputs are made so (and from which base), and
`drop_regenerated` takes them out of the forward graph: ONNX Runtime never computes them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ort_autopatch.engine.backends.ort.linking import refuse

if TYPE_CHECKING:
    from ort_autopatch.engine.backends.ort.capture import Feed

_aten = torch.ops.aten
#: size arithmetic a view chain may read (symbolic sizes)
_SIZES = {
    "aten.sym_size.int": _aten.sym_size.int,
    "aten.sym_stride.int": _aten.sym_stride.int,
    "aten.sym_numel.default": _aten.sym_numel.default,
    "aten.sym_storage_offset.default": _aten.sym_storage_offset.default,
}
_PYTHON = {
    "operator.getitem": operator.getitem,
    "operator.add": operator.add,
    "operator.sub": operator.sub,
    "operator.mul": operator.mul,
    "operator.floordiv": operator.floordiv,
    "operator.mod": operator.mod,
    "operator.neg": operator.neg,
}
_PYTHON_NAMES = {function: name for name, function in _PYTHON.items()}


class NotAView(Exception):
    """The chain from a base to its output has a node that is not a view (its text says which)."""


@dataclass(frozen=True)
class Replay:
    """How to make one user output from its base, as plain data (JSON-able).

    `source`: "feed" (a graph input: the caller's tensor or a module tensor, by feed index) or
    "slot" (a value the program returns: a user output, or an intermediate base the training
    Function returns, by slot). `steps`: [target, args, kwargs] per operator, in order; in the
    arguments {"v": i} is value i (0: the base, i > 0: step i - 1's result), {"feed": k} a
    graph input and {"dtype": name} a dtype. The last value is the output (the base itself when
    there is no step). `requires_grad`: the output's, by the trace."""

    source: str
    index: int
    steps: list[Any]
    requires_grad: bool

    def as_data(self) -> list[Any]:
        return [self.source, self.index, self.steps, self.requires_grad]

    @classmethod
    def from_data(cls, data: Sequence[Any]) -> Replay:
        source, index, steps, requires_grad = data
        return cls(str(source), int(index), list(steps), bool(requires_grad))

    def run(self, base: torch.Tensor, feeds: Sequence[Any]) -> torch.Tensor:
        """The output from the real `base` (the graph inputs `feeds` for sizes they read)."""
        values: list[Any] = [base]
        for target, args, kwargs in self.steps:
            function = _target(target)
            values.append(function(*_decode(args, values, feeds), **_decode(kwargs, values, feeds)))
        out = values[-1]
        assert isinstance(out, torch.Tensor)
        return out


def _target(name: str) -> Any:
    if name in _PYTHON:
        return _PYTHON[name]
    if name in _SIZES:
        return _SIZES[name]
    namespace, packet, overload = name.split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    if not op.is_view:
        raise NotAView(name)
    return op


def _decode(value: Any, values: list[Any], feeds: Sequence[Any]) -> Any:
    if isinstance(value, dict):
        if "v" in value:
            return values[value["v"]]
        if "feed" in value:
            return feeds[value["feed"]]
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        return {k: _decode(v, values, feeds) for k, v in value["kwargs"].items()}
    if isinstance(value, list):
        return [_decode(v, values, feeds) for v in value]
    return value


def chain(
    source: torch.fx.Node, output: torch.fx.Node, placeholders: Sequence[torch.fx.Node]
) -> list[Any]:
    """The steps that make `output` from `source` in a forward graph (raises `NotAView`)."""
    feeds = {node: k for k, node in enumerate(placeholders)}
    order: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = {source}

    def visit(node: torch.fx.Node) -> None:
        if node in seen:
            return
        seen.add(node)
        if node.op == "placeholder":
            if node not in feeds:
                raise NotAView(f"input {node.name}")
            return  # read by size arithmetic (checked with its reader)
        if node.op != "call_function" or _name(node.target) is None:
            raise NotAView(str(node.target))
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" and arg is not source and node.target not in _SIZE_OPS:
                raise NotAView(f"{_name(node.target)} of another input")
            visit(arg)
        order.append(node)

    visit(output)
    position = {source: 0, **{node: k + 1 for k, node in enumerate(order)}}

    def encode(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            if value in position:
                return {"v": position[value]}
            return {"feed": feeds[value]}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise NotAView(f"an argument of type {type(value).__name__}")

    return [
        [
            _name(node.target),
            encode(list(node.args)),
            {"kwargs": {k: encode(v) for k, v in node.kwargs.items()}},
        ]
        for node in order
    ]


_SIZE_OPS = frozenset(_SIZES.values())


def _name(target: Any) -> str | None:
    """The replayable name of an FX target, or None: views, size arithmetic, getitem."""
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}.{target._opname}.{target._overloadname}"
        if target in _SIZE_OPS or target.is_view:
            return name
        return None
    return _PYTHON_NAMES.get(target)


def regenerated(
    cls: str,
    joint: Any,
    gm: torch.fx.GraphModule,
    feeds: list[Feed],
    user_outputs: list[int],
    bases: list[int],
) -> dict[int, Any]:
    """The user outputs made on the torch side from their base, by aot's analysis of the
    outputs (the `Replay` of each): inputs returned as they are, views of inputs, parameters,
    intermediates or other outputs, and an output returned twice."""
    from torch._functorch._aot_autograd.schemas import OutputType

    infos = joint._aot_state.fw_metadata.output_info
    if len(infos) != len(user_outputs):
        raise refuse(cls, f"{len(infos)} outputs by aot's count, {len(user_outputs)} by ours")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][: len(feeds)]
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    own = (OutputType.non_alias, OutputType.unsafe_view_alias, OutputType.custom_function_view)
    first: dict[Any, int] = {}  # a graph value -> the first user output that is it
    regenerated: dict[int, Any] = {}
    for k, info in enumerate(infos):
        node, kind = outs[user_outputs[k]], info.output_type
        if kind in own:
            root = viewed_input(node, placeholders)
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
            raise refuse(cls, f"output {k} that aliases other memory ({kind.name})")
        try:
            steps = chain(base, node, placeholders)
        except NotAView as exc:
            raise refuse(
                cls, f"output {k} that aliases other memory ({kind.name}) through {exc}"
            ) from exc
        regenerated[k] = Replay(source, int(index), steps, bool(info.requires_grad))
    return regenerated


def viewed_input(node: Any, placeholders: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The input `node` is a view of, through views and their items alone, or None.
    aot's analysis calls multi-output views of an input (`x.chunk(3)`, `x.unbind()`) outputs
    of their own, which eager returns as views of the input."""

    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if _name(node.target) is None or not node.args:
            return None
        node = node.args[0]
    if node is not None and node in placeholders and node.meta.get("val") is not None:
        return node
    return None


def drop_regenerated(forward: torch.fx.GraphModule, outputs: list[int]) -> None:
    """The forward graph's outputs the torch side makes (`Captured.regenerated`) are None
    in it: ONNX Runtime neither computes nor copies them; the views only they read go."""

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
        if node.op == "call_function" and not node.users and _name(node.target):
            dropped.extend(n for n in node.all_input_nodes if n not in dropped)
            forward.graph.erase_node(node)
    forward.recompile()
