"""Running a patched module's forward hooks around a call that ORT serves.

When the graph runs in ORT, `torch.nn.Module._call_impl` never runs, so its forward pre-hooks and
forward hooks are called here, in registration order, with the same signatures and result rules
(`with_kwargs` hooks get and may replace the keyword arguments; a non-None result replaces the
arguments or the output). What this does not re-implement is sent to eager by the patcher
instead: global module hooks, backward hooks, `always_call` semantics on exceptions and hooks on
submodules (those would run inside the exported graph). No global effect: hooks are only read.
"""

from __future__ import annotations

from typing import Any

import torch


def run_pre_hooks(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The module's forward pre-hooks, as `Module._call_impl` runs them."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def run_post_hooks(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    """The module's forward hooks, as `Module._call_impl` runs them."""
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook_id in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output


def forward_without_hooks(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Eager forward for a fallback whose hooks this module already ran (or will run)."""
    return module.forward(*args, **kwargs)
