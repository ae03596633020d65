"""Tracing a call with symbolic sizes, and the size guards the trace leaves.

The inputs become fake tensors under a fresh `ShapeEnv`, with the dimensions the engine asks
for (`Miss.dynamic`) as symbols and every other dimension as its size; aot_autograd traces
with them as it does with real tensors, and the exporter writes the symbols as named ONNX
dimensions (sizes the backward needs, such as `s0 * 64`, become int64 scalars the forward
returns). Whatever the trace decided from a symbolic size (`if x.shape[0] > 4`, two inputs
sharing a batch size, a dimension of at least 2, which torch assumes of every symbol) is a
guard of the `ShapeEnv`; they become the graph's `SizeGuards`, so no call is admitted that
would have traced differently. Guards on strides are left out: every input is made dense
before ONNX Runtime sees it, so the graph never reads a stride.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import Any

import torch

from ort_autopatch.engine.sizes import Dims, Shapes, SizeGuards

_SOURCE = re.compile(r"L\['t(\d+)'\]\.size\(\)\[(\d+)\]")


def fake_inputs(tensors: Sequence[torch.Tensor], dynamic: Dims) -> tuple[Any, list[torch.Tensor]]:
    """The call's inputs as fake tensors, `dynamic` dimensions as symbols; and their
    `ShapeEnv`."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    # no duck sizing: two dimensions equal by chance stay two symbols (a guard joins them
    # only where the trace needs them equal)
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env)
    fakes: list[torch.Tensor] = []
    for k, (tensor, dims) in enumerate(zip(tensors, dynamic, strict=True)):
        sizes = [
            DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(tensor.dim())
        ]
        context: Any = StatelessSymbolicContext(dynamic_sizes=sizes)
        fakes.append(
            mode.from_tensor(tensor, symbolic_context=context, source=LocalSource(f"t{k}"))
        )
    return env, fakes


def size_guards(env: Any, fakes: Sequence[torch.Tensor], shapes: Shapes) -> SizeGuards:
    """The sizes a graph traced with `fakes` serves. Dimensions the trace fixed to one value
    (`range(x.size(1))`, a size-1 example) count as traced exactly. Raises ValueError for a
    guard that is not arithmetic on sizes."""
    from torch._dynamo.source import LocalSource

    dynamic = tuple(
        tuple(
            d
            for d, size in enumerate(fake.shape)
            if isinstance(size, torch.SymInt) and not env.simplify(size.node.expr).is_number
        )
        for fake in fakes
    )
    if not any(dynamic):
        return SizeGuards(shapes)
    produced = env.produce_guards(list(fakes), [LocalSource(f"t{k}") for k in range(len(fakes))])
    texts = []
    for text in produced:
        if ".stride()" in text or ".storage_offset()" in text:
            continue
        text = _SOURCE.sub(r"inputs[\1].shape[\2]", text)
        if "L[" in text:
            raise ValueError(f"a guard on something other than sizes: {text}")
        texts += _conjuncts(text)
    return SizeGuards(shapes, dynamic, tuple(texts))


def _conjuncts(text: str) -> list[str]:
    """`2 <= a and a <= 4` as its two guards, so a rebuild reason names the one that failed."""
    tree = ast.parse(text, mode="eval").body
    if isinstance(tree, ast.BoolOp) and isinstance(tree.op, ast.And):
        return [part for value in tree.values for part in _conjuncts(ast.unparse(value))]
    return [text]


def expand_numel(gm: torch.fx.GraphModule) -> None:
    """`x.numel()` of a symbolic shape (BatchNorm's decomposition asks for it) as the product
    of its sizes: the exporter translates `sym_size` and integer arithmetic, not `sym_numel`.
    A pass of a symbolic trace's graphs (`passes.PARTITIONED`)."""
    import operator

    numel = torch.ops.aten.sym_numel.default
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not numel:
            continue
        source = node.args[0]
        with gm.graph.inserting_before(node):
            product: Any = 1
            for d in range(len(source.meta["val"].shape)):
                size = gm.graph.call_function(torch.ops.aten.sym_size.int, (source, d))
                size.meta["val"] = source.meta["val"].shape[d]
                if product == 1:
                    product = size
                    continue
                value = product.meta["val"] * size.meta["val"]
                product = gm.graph.call_function(operator.mul, (product, size))
                product.meta["val"] = value
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
    gm.recompile()
