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
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
