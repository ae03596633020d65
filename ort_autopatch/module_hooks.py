"""Running a patched module's hooks around a call that ORT serves.

When the graph runs in ORT, `torch.nn.Module._call_impl` never runs, so the hooks it would run
are run here, in its order and with its signatures and result rules: the module's forward
pre-hooks (`with_kwargs` hooks get and may replace the keyword arguments; a non-None result
replaces the arguments), then its full backward hooks and backward pre-hooks and the global
ones, set up with torch's own `BackwardHook` around the positional inputs and the output, so
ORT's backward feeds them the gradients eager's would (a pre-hook may replace the output
gradients before ORT's backward runs, a full hook the input gradients after), then its forward
hooks (a non-None result replaces the output). What this does not re-implement is sent to
eager by the patcher instead: non-full backward hooks (`register_backward_hook`), which hang on
the graph's last autograd node; global forward hooks, which would also run on the export's own
modules; `always_call` semantics on exceptions; hooks on submodules, and global backward hooks
of a module with submodules (those would run inside the exported graph). No global effect:
hooks are only read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as torch_module
from torch.utils.hooks import BackwardHook

_global_forward_pre = torch_module._global_forward_pre_hooks
_global_forward = torch_module._global_forward_hooks
_global_backward = torch_module._global_backward_hooks
_global_backward_pre = torch_module._global_backward_pre_hooks


def forward_hooked(module: torch.nn.Module) -> bool:
    """Whether a call of `module` has forward hooks of its own to run."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


def backward_hooked(module: torch.nn.Module) -> bool:
    """Whether a call of `module` has backward hooks or pre-hooks (its own or global ones)."""
    return bool(
        module._backward_hooks
        or module._backward_pre_hooks
        or _global_backward
        or _global_backward_pre
    )


def global_forward_hooks() -> bool:
    """Whether global forward hooks exist (`register_module_forward_hook`)."""
    return bool(_global_forward_pre or _global_forward)


def global_backward_hooks() -> bool:
    """Whether global backward hooks exist: they run on every module, submodules included."""
    return bool(_global_backward or _global_backward_pre)


def non_full_backward_hooks(module: torch.nn.Module) -> bool:
    """Whether `register_backward_hook` (not the full kind) hooks apply to `module`'s calls."""
    return bool(
        (module._backward_hooks and module._is_full_backward_hook is False)
        or (_global_backward and torch_module._global_is_full_backward_hook is False)
    )


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


def setup_backward_hooks(
    module: torch.nn.Module, args: tuple[Any, ...]
) -> tuple[BackwardHook | None, tuple[Any, ...]]:
    """torch's `BackwardHook` for this call's full backward hooks and backward pre-hooks, and
    the positional arguments routed through it (None and `args` when there are none); the
    output goes through its `setup_output_hook` after the forward hooks, as in eager."""
    full, _ = module._get_backward_hooks()
    pre = module._get_backward_pre_hooks()
    if not (full or pre):
        return None, args
    hook = BackwardHook(module, full, pre)
    return hook, hook.setup_input_hook(args)


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
