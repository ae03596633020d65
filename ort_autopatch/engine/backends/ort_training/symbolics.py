"""Symbolic functions our exports need, registered only while the engine exports.

PyTorch's TorchScript exporter keeps one global registry; a symbolic left registered would
change the user's own `torch.onnx.export`. `registered(opset)` installs ours with
`torch.onnx.register_custom_op_symbolic` at the export's opset and afterwards puts back exactly
what was there (a user's own override included).

- `aten::scaled_dot_product_attention`: `enable_gqa=True` (K/V heads repeated as torch does)
  and fully masked rows that stay finite in backward (torch's safe softmax: such rows are zero;
  the stock symbolic hides their NaN in forward only, and SoftmaxGrad spreads it everywhere).
- `aten::diff`: no stock symbolic at opset 17 (transformers calls it when no attention_mask).
- `aten::cumsum`: integral and bool inputs accumulate in int64 as in torch (the stock symbolic
  keeps a bool input bool).
- `aten::group_norm`: reductions and arithmetic instead of InstanceNormalization, which has no
  gradient in ORT 1.19.2 (exact, and cheaper than a torch-calling node).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.onnx import _constants
from torch.onnx._internal.torchscript_exporter import _type_utils, registration, symbolic_helper
from torch.onnx._internal.torchscript_exporter.symbolic_opset14 import (
    _attention_scale,
    _causal_attention_mask,
)

_Scalar = _type_utils.JitScalarType
_INTEGRAL_BELOW_64 = {
    _Scalar.BOOL,
    _Scalar.UINT8,
    _Scalar.INT8,
    _Scalar.INT16,
    _Scalar.INT,
}


def _const(g: Any, values: list[int]) -> Any:
    return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))


def _scalar_like(g: Any, value: float, like: Any) -> Any:
    scalar = _Scalar.from_value(like, _Scalar.FLOAT)
    return g.op("Constant", value_t=torch.tensor([value], dtype=scalar.dtype()))


def _reduce_max_last(g: Any, x: Any) -> Any:
    if g.opset >= 18:
        return g.op("ReduceMax", x, _const(g, [-1]), keepdims_i=1)
    return g.op("ReduceMax", x, axes_i=[-1], keepdims_i=1)


def _slice(g: Any, x: Any, start: int, end: int) -> Any:
    return g.op("Slice", x, _const(g, [start]), _const(g, [end]))


def _repeat_heads(g: Any, query: Any, kv: Any) -> Any:
    """[B, Hkv, S, D] -> [B, H, S, D], each head repeated H/Hkv times in a row (repeat_interleave
    on dim -3, what SDPA does with enable_gqa)."""
    kv_shape = g.op("Shape", kv)
    heads = _slice(g, g.op("Shape", query), -3, -2)
    repeats = g.op("Div", heads, _slice(g, kv_shape, -3, -2))
    lead, tail = _slice(g, kv_shape, 0, -2), _slice(g, kv_shape, -2, _constants.INT64_MAX)
    grown = g.op(
        "Expand",
        g.op("Unsqueeze", kv, _const(g, [-3])),
        g.op("Concat", lead, repeats, tail, axis_i=0),
    )
    batch = _slice(g, kv_shape, 0, -3)
    return g.op("Reshape", grown, g.op("Concat", batch, heads, tail, axis_i=0))


@symbolic_helper.parse_args("v", "v", "v", "v", "f", "b", "v", "b")
def scaled_dot_product_attention(
    g: Any,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Any:
    """torch's math SDPA, with safe softmax over fully masked rows and GQA."""
    if is_causal and not symbolic_helper._is_none(attn_mask):
        raise ValueError("is_causal and attn_mask cannot be set at the same time")
    if enable_gqa:
        key, value = _repeat_heads(g, query, key), _repeat_heads(g, query, value)
    if symbolic_helper._is_none(scale):
        scale = _attention_scale(g, query)
    rank = symbolic_helper._get_tensor_rank(key)
    if rank is None:
        raise ValueError("scaled_dot_product_attention needs the rank of key")
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    root = g.op("Sqrt", scale)
    scores = g.op(
        "MatMul", g.op("Mul", query, root), g.op("Mul", g.op("Transpose", key, perm_i=perm), root)
    )
    dead = None  # rows no key may attend to
    if is_causal:
        scores = g.op("Add", scores, _causal_attention_mask(g, query, key))
    elif not symbolic_helper._is_none(attn_mask):
        zero, neg_inf = _scalar_like(g, 0.0, query), _scalar_like(g, float("-inf"), query)
        if _Scalar.from_value(attn_mask, _Scalar.UNDEFINED) == _Scalar.BOOL:
            allowed = g.op("Cast", attn_mask, to_i=_Scalar.FLOAT.onnx_type())
            dead = g.op("Equal", _reduce_max_last(g, allowed), _scalar_like(g, 0.0, allowed))
            bias = g.op("Where", attn_mask, zero, neg_inf)
        else:
            bias = attn_mask
            dead = g.op("Equal", _reduce_max_last(g, attn_mask), neg_inf)
        scores = g.op("Add", scores, bias)
        # Zero before the softmax keeps forward and SoftmaxGrad finite; zero after gives
        # torch's result (a fully masked row attends to nothing).
        scores = g.op("Where", dead, zero, scores)
    weights = g.op("Softmax", scores, axis_i=-1)
    if dead is not None:
        weights = g.op("Where", dead, _scalar_like(g, 0.0, query), weights)
    if dropout_p != 0:
        ratio = g.op("Constant", value_t=torch.tensor(dropout_p, dtype=torch.float))
        weights = g.op("Dropout", weights, ratio)
    return g.op("MatMul", weights, value)


@symbolic_helper.parse_args("v", "i", "i", "v", "v")
def diff(g: Any, x: Any, n: int, dim: int, prepend: Any = None, append: Any = None) -> Any:
    """torch.diff: n times x[1:] - x[:-1] along dim, after prepend/append (xor for bool)."""
    parts = [p for p in (prepend, x, append) if p is not None and not symbolic_helper._is_none(p)]
    if len(parts) > 1:
        x = g.op("Concat", *parts, axis_i=dim)
    is_bool = _Scalar.from_value(x, _Scalar.UNDEFINED) == _Scalar.BOOL
    axes = _const(g, [dim])
    for _ in range(n):
        later = g.op("Slice", x, _const(g, [1]), _const(g, [_constants.INT64_MAX]), axes)
        earlier = g.op("Slice", x, _const(g, [0]), _const(g, [-1]), axes)
        x = g.op("Xor" if is_bool else "Sub", later, earlier)
    return x


def cumsum(g: Any, x: Any, dim: Any, dtype: Any = None) -> Any:
    """torch.cumsum: an explicit dtype casts first; otherwise integral inputs go to int64."""
    axis = symbolic_helper._get_const(dim, "i", "dim")
    if dtype is not None and not symbolic_helper._is_none(dtype):
        target: _type_utils.JitScalarType | None = _Scalar(
            symbolic_helper._get_const(dtype, "i", "dtype")
        )
    else:
        source = _Scalar.from_value(x, _Scalar.UNDEFINED)
        target = _Scalar.INT64 if source in _INTEGRAL_BELOW_64 else None
    if target is not None:
        x = g.op("Cast", x, to_i=target.onnx_type())
    return g.op("CumSum", x, g.op("Constant", value_t=torch.tensor(axis, dtype=torch.int64)))


def _reduce_mean(g: Any, x: Any, axes: list[int]) -> Any:
    if g.opset >= 18:
        return g.op("ReduceMean", x, _const(g, axes), keepdims_i=1)
    return g.op("ReduceMean", x, axes_i=axes, keepdims_i=1)


@symbolic_helper.parse_args("v", "i", "v", "v", "f", "b")
def group_norm(
    g: Any, x: Any, groups: int, weight: Any, bias: Any, eps: float, cudnn_enabled: bool
) -> Any:
    """GroupNorm as reductions and arithmetic, all of which ORT differentiates (the stock
    symbolic's InstanceNormalization has no gradient in ORT 1.19.2): per sample and group,
    (x - mean) / sqrt(biased variance + eps), then the per-channel affine."""
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        raise ValueError("group_norm needs the rank of its input")
    shape = g.op("Shape", x)
    grouped = g.op("Reshape", x, _const(g, [0, groups, -1]))
    mean = _reduce_mean(g, grouped, [2])
    centred = g.op("Sub", grouped, mean)
    var = _reduce_mean(g, g.op("Mul", centred, centred), [2])
    eps_value = _scalar_like(g, eps, x)
    normed = g.op("Div", centred, g.op("Sqrt", g.op("Add", var, eps_value)))
    y = g.op("Reshape", normed, shape)
    trailing = list(range(1, rank - 1))
    if not symbolic_helper._is_none(weight):
        w = g.op("Unsqueeze", weight, _const(g, trailing)) if trailing else weight
        y = g.op("Mul", y, w)
    if not symbolic_helper._is_none(bias):
        b = g.op("Unsqueeze", bias, _const(g, trailing)) if trailing else bias
        y = g.op("Add", y, b)
    return y


#: Every symbolic this module installs during an export.
SYMBOLICS: dict[str, Callable[..., Any]] = {
    "aten::scaled_dot_product_attention": scaled_dot_product_attention,
    "aten::diff": diff,
    "aten::cumsum": cumsum,
    "aten::group_norm": group_norm,
}

_lock = threading.Lock()


def _current_override(name: str, opset: int) -> Callable[..., Any] | None:
    group = registration.registry.get_function_group(name)
    if group is None:
        return None
    functions = group._functions
    return functions._overrides.get(opset) if functions.overridden(opset) else None


@contextlib.contextmanager
def registered(
    opset: int, symbolics: dict[str, Callable[..., Any]] | None = None
) -> Iterator[None]:
    """Our symbolics for one export at `opset`; the registry is as before afterwards."""
    chosen = SYMBOLICS if symbolics is None else symbolics
    with _lock:
        previous = {name: _current_override(name, opset) for name in chosen}
        try:
            for name, function in chosen.items():
                torch.onnx.register_custom_op_symbolic(name, function, opset)
            yield
        finally:
            for name, before in previous.items():
                if before is not None:
                    torch.onnx.register_custom_op_symbolic(name, before, opset)
                elif _current_override(name, opset) is not None:
                    torch.onnx.unregister_custom_op_symbolic(name, opset)
