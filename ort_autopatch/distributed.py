"""What a sharding wrapper around a patched module means for its calls.

FSDP2 (`fully_shard`) swaps a module's parameters between sharded DTensors and full tensors in
its forward hooks, and with `reshard_after_forward` frees the full tensors' memory between
forward and backward (gathering them again, into new memory, before backward). FSDP1
(`FullyShardedDataParallel`) replaces parameters by views of flat parameters on every forward.
This module answers, per call, what the patcher needs to know about that; it reads torch's
FSDP state and changes nothing. A run that never imports FSDP pays one `sys.modules` lookup.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

_COMPOSABLE = "torch.distributed._composable_state"
_FSDP2_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"
_FLAT_PARAM = "torch.distributed.fsdp._flat_param"

# module -> (number of composable states when computed, weak references to its FSDP2 groups)
_groups: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[weakref.ref[Any]]]] = (
    weakref.WeakKeyDictionary()
)
_fsdp1: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def _fsdp2_groups(module: torch.nn.Module) -> list[Any]:
    """FSDP2 parameter groups holding parameters of `module`'s tree (its own `fully_shard` or an
    ancestor's)."""
    composable = sys.modules.get(_COMPOSABLE)
    fsdp_state = sys.modules.get(_FSDP2_STATE)
    if composable is None or fsdp_state is None:
        return []
    mapping = composable._module_state_mapping
    count = len(mapping)
    if count == 0:
        return []
    cached = _groups.get(module)
    if cached is None or cached[0] != count:
        tree = set(module.modules())
        found: dict[int, Any] = {}
        for state_ref in list(mapping.values()):
            state = state_ref()
            if not isinstance(state, fsdp_state.FSDPState):
                continue
            for group in state._fsdp_param_groups:
                if any(p._module_info.module in tree for p in group.fsdp_params):
                    found[id(group)] = group
        cached = (count, [weakref.ref(g) for g in found.values()])
        _groups[module] = cached
    return [g for g in (ref() for ref in cached[1]) if g is not None]


def frees_parameters_after_forward(module: torch.nn.Module) -> bool:
    """Whether FSDP2 frees the memory of this module's full parameters between its forward and
    its backward (`reshard_after_forward`), so a graph must not keep pointers to them."""
    return any(group._reshard_after_forward for group in _fsdp2_groups(module))


def mixed_precision(module: torch.nn.Module) -> str | None:
    """The FSDP2 mixed-precision policy that casts this module's parameters, in words."""
    for group in _fsdp2_groups(module):
        policy = group.mp_policy
        if policy.param_dtype is not None:
            return f"FSDP2 MixedPrecisionPolicy(param_dtype={policy.param_dtype})"
    return None


def sharded_submodules(module: torch.nn.Module) -> list[str]:
    """Names of modules below `module` that `fully_shard` wrapped (their hooks gather and free
    parameters in the middle of `module`'s forward, which one graph cannot do)."""
    composable = sys.modules.get(_COMPOSABLE)
    if composable is None or not composable._module_state_mapping:
        return []
    mapping = composable._module_state_mapping
    return [name for name, sub in module.named_modules() if name and sub in mapping]


def fsdp1_reason(module: torch.nn.Module) -> str | None:
    """Why calls under FSDP1 run eagerly, when `module`'s parameters belong to it."""
    flat = sys.modules.get(_FLAT_PARAM)
    if flat is None:
        return None
    known = _fsdp1.get(module)
    if known is None:
        known = _fsdp1[module] = _under_fsdp1(module, flat.FlatParameter)
    if not known:
        return None
    return (
        "FSDP1 (FullyShardedDataParallel) replaces its parameters by views of flat parameters "
        "on every forward; use FSDP2's fully_shard to train this class through ONNX Runtime"
    )


def _under_fsdp1(module: torch.nn.Module, flat_parameter: type) -> bool:
    for sub in module.modules():
        if "_flat_param" in sub._parameters:
            return True
        for value in (*sub._parameters.values(), *sub.__dict__.values()):
            if isinstance(value, torch.Tensor) and (
                getattr(value, "_fsdp_flattened", False)
                or isinstance(value, flat_parameter)
                or isinstance(value._base, flat_parameter)
            ):
                return True
    return False
