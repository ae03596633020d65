"""Autocast: the part of torch's mixed-precision state a graph bakes in.

The TorchScript exporter traces under the caller's autocast state (autocast dispatches before
the tracer, so its casts are recorded; the exporter turns the weight-cast cache off for the
trace itself), so a graph exported inside `torch.autocast` computes in autocast's dtypes and
one exported outside it does not. The state is therefore part of every call key: read per
call for the device type of the module's tensors, with one C call while autocast is off.
"""

from __future__ import annotations

from typing import Any

import torch

#: what a call refused for its autocast dtype is told (`AutocastUnsupportedError`)
REMEDY = (
    "A known limitation: these calls run in PyTorch under this autocast, and calls outside it "
    "in ONNX Runtime"
)

#: enabled for the device type, its dtype, and whether casts of weights are cached; None: off
State = tuple[str, torch.dtype, bool] | None

_any_enabled = torch._C._is_any_autocast_enabled
_enabled = torch.is_autocast_enabled
_dtype = torch.get_autocast_dtype
_cache = torch.is_autocast_cache_enabled


def state(device_type: str) -> State:
    """The autocast state that decides how a graph on `device_type` computes."""
    if not _any_enabled() or not _enabled(device_type):
        return None
    return (device_type, _dtype(device_type), _cache())


def describe(autocast: State) -> str:
    """`off` or `cpu bfloat16`, as reports and rebuild reasons name it."""
    if autocast is None:
        return "off"
    device_type, dtype, _ = autocast
    return f"{device_type} {str(dtype).removeprefix('torch.')}"


#: ONNX element types of autocast's lower-precision dtypes
_ONNX_TYPES = {torch.float16: 10, torch.bfloat16: 16}


def lowers_on_cpu(autocast: State) -> bool:
    """Autocast lowers precision on CPU: only then may `cpu_refusal` refuse a graph."""
    return autocast is not None and autocast[0] == "cpu"


def cpu_refusal(model: Any, autocast: State) -> str | None:
    """Why ORT's CPU build cannot run this graph as autocast computes it, or None.

    The CPU build has no bfloat16 kernels for the operators autocast lowers (Gemm, MatMul,
    Conv: session creation fails), and runs their float16 nodes in float32 through casts
    it inserts, then removes the casts that rounded the weights: other numbers, and float32
    outputs where eager gives float16. A graph that autocast left in float32 (no operator it
    lowers) runs as it is.
    """
    if autocast is None or not lowers_on_cpu(autocast):
        return None
    dtype = autocast[1]
    target = _ONNX_TYPES.get(dtype)
    lowered = {
        output
        for node in model.graph.node
        if node.op_type == "Cast" and any(a.name == "to" and a.i == target for a in node.attribute)
        for output in node.output
    }
    if not lowered:
        return None
    ops = sorted(
        {
            node.op_type
            for node in model.graph.node
            if node.op_type != "Cast" and lowered.intersection(node.input)
        }
    )
    name = str(dtype).removeprefix("torch.")
    what = ", ".join(ops) or "its operators"
    if dtype is torch.float16:
        return (
            f"ONNX Runtime's CPU build has no float16 kernel for {what}: it would compute them "
            "in float32 and return float32 where autocast gives float16"
        )
    return f"ONNX Runtime's CPU build has no {name} kernel for {what}"
