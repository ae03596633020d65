"""Torch-calling ATen nodes that the persistent cache can store: each node's callable described as
data (the operator overload by name, which arguments are keywords, the argument template, how
values travel) and registered under a name derived from that description.

A node's registered name is what the graph holds (`func_name`); a counter made it unique in
the process, so a stored graph named callables no other process had, and a graph with a routed
node (`--torch-ops`, or an operator ONNX cannot express) was never stored: every process built
it again. Named by its description instead, the node means the same in every process: a
process that loads the graph registers the description under the same name (`restore`), and
neither the graph nor ORT's optimised form of it needs rewriting. A custom
`autograd.Function`'s node has no such description (its callable is the class, found by
nothing but this process's objects): a graph holding one is still never stored.

This module is the description's format (the argument template as JSON, the operator by
name); `nodes.restore` registers a stored node, `nodes.stored_nodes` lists a graph's. No
exporter import here or there: a warm start restores nodes without importing torch.onnx.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: What a description's format is; part of the name, so another format never meets this one.
FORMAT = 1

TENSOR = object()  # placeholder for a tensor argument in a node's template


class ScalarMarker:
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


#: The keys `describe` writes (`nodes.new_spec` adds the typed ones)
DESCRIBED = ("format", "operator", "names", "label", "template", "random", "clone_inputs")


class Undescribable(Exception):
    """An argument the description cannot write as JSON."""


def aten_call(overload: Any, names: Sequence[str | None]) -> Callable[..., Any]:
    """The operator called with the template's values: keyword arguments by `names` (None for
    a positional one)."""
    positional = [n is None for n in names]

    def call(*values: Any) -> Any:
        args = [v for v, p in zip(values, positional, strict=True) if p]
        kwargs = {n: v for v, n in zip(values, names, strict=True) if n is not None}
        return overload(*args, **kwargs)

    return call


def _encode(value: Any) -> Any:
    if value is TENSOR:
        return {"tensor": True}
    if isinstance(value, ScalarMarker):
        return {"scalar": value.kind}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    raise Undescribable(f"an argument {value!r}")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if value.get("tensor"):
            return TENSOR
        if "scalar" in value:
            return ScalarMarker(str(value["scalar"]))
        if "dtype" in value:
            dtype = getattr(torch, str(value["dtype"]))
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"no dtype {value['dtype']!r}")
            return dtype
        raise ValueError(f"an argument {value!r}")
    return value


def overload(qualified: str) -> Any:
    """`torch.ops.aten.<name>.<overload>` for "aten::name.overload"."""
    namespace, rest = qualified.split("::", 1)
    name, overload = rest.rsplit(".", 1)
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def describe(
    operator: str,
    names: Sequence[str | None],
    label: str,
    template: list[Any],
    random: bool,
    clone_inputs: bool = False,
) -> dict[str, Any] | None:
    """The description of an ATen node calling `operator` ("aten::name.overload") with
    `template`, None where an argument cannot be written as JSON."""
    try:
        encoded = _encode(template)
    except Undescribable:
        return None
    return {
        "format": FORMAT,
        "operator": operator,
        "names": list(names),
        "label": label,
        "template": encoded,
        "random": random,
        "clone_inputs": clone_inputs,
    }
