"""Backward hooks on a selected class while its calls run in ORT, compared with eager.

Full backward hooks and backward pre-hooks see the gradients ORT's backward computes, in eager's
order, and what they return replaces gradients as in eager. Global backward hooks do too, for a
class without submodules (on one with submodules they would have to run inside the graph, so
its calls run in PyTorch, as under global forward hooks). The eager side of each comparison is
`torch.nn.Module.__call__` on an identical copy, which is torch's own `_call_impl`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ort_autopatch import patcher
from ort_autopatch.engine import EngineOptions
from tests.helpers import assert_close, class_stats, patched, repatch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(x))
        return self.out(h) * y, h.sum(-1)


class Leaf(Net):
    """The same computation with its own parameters: no submodule for a global hook to see."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        net = Net()
        self.w1, self.b1 = nn.Parameter(net.fc.weight), nn.Parameter(net.fc.bias)
        self.w2, self.b2 = nn.Parameter(net.out.weight), nn.Parameter(net.out.bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(nn.functional.linear(x, self.w1, self.b1))
        return nn.functional.linear(h, self.w2, self.b2) * y, h.sum(-1)


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched([Net], patcher.Settings(engine=EngineOptions()))


Seen = list[tuple[str, tuple[Any, ...]]]


def _detached(grads: Any) -> tuple[Any, ...]:
    return tuple(None if g is None else g.detach().clone() for g in grads)


def _train(
    model: Net, register: Callable[[Net, Seen], None], through_ort: bool, x_grad: bool = True
) -> tuple[Seen, list[torch.Tensor | None]]:
    """Register hooks, run two training steps (batch 4, then 7: the hooks must see each call's
    own sizes) with an upstream leaf, and return what the hooks saw (in order) and every
    gradient upstream of and inside the module."""
    seen: Seen = []
    register(model, seen)
    grads: list[torch.Tensor | None] = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        batch = 4 + 3 * step
        leaf = torch.randn(batch, 6, generator=g, requires_grad=x_grad)
        y = torch.randn(batch, 3, generator=g, requires_grad=True)
        x = leaf * 3.0 if x_grad else leaf
        call = model if through_ort else lambda *a: nn.Module.__call__(model, *a)
        out, side = call(x, y)
        (out.square().sum() + side.sum()).backward()
        grads += [leaf.grad, y.grad] + [p.grad for p in model.parameters()]
        model.zero_grad()
    return seen, grads


def _compare(
    register: Callable[[Net, Seen], None], x_grad: bool = True, cls: type[Net] = Net
) -> None:
    torch.manual_seed(0)
    model = cls()
    twin = copy.deepcopy(model)
    seen, grads = _train(model, register, through_ort=True, x_grad=x_grad)
    want_seen, want_grads = _train(twin, register, through_ort=False, x_grad=x_grad)
    assert [name for name, _ in seen] == [name for name, _ in want_seen]
    for (name, got), (_, want) in zip(seen, want_seen, strict=True):
        assert len(got) == len(want), name
        for k, (a, e) in enumerate(zip(got, want, strict=True)):
            if e is None:
                assert a is None, f"{name} #{k}: a gradient where eager has None"
            else:
                assert_close(a, e, f"{name} #{k}")
    for k, (a, e) in enumerate(zip(grads, want_grads, strict=True)):
        if e is None:
            assert a is None, f"gradient {k}"
        else:
            assert_close(a, e, f"gradient {k}")
    stats = class_stats(Net)  # a Leaf counts for Net, the selected class it derives from
    assert stats.ort_calls == 2, dict(stats.eager_calls)


def _full_hook(replace: bool) -> Callable[[Net, Seen], None]:
    def register(model: Net, seen: Seen) -> None:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:
            seen.append(("grad_input", _detached(grad_input)))
            seen.append(("grad_output", _detached(grad_output)))
            if replace:
                return tuple(None if g is None else g * 2 + 1 for g in grad_input)
            return None

        model.register_full_backward_hook(hook)

    return register


@pytest.mark.parametrize("x_grad", [True, False], ids=["input_grad", "no_input_grad"])
def test_a_full_backward_hook_sees_ort_gradients_as_eager(x_grad: bool) -> None:
    _compare(_full_hook(replace=False), x_grad=x_grad)


def test_a_full_backward_hook_result_replaces_the_input_gradients_upstream() -> None:
    _compare(_full_hook(replace=True))


def test_a_backward_pre_hook_result_replaces_the_output_gradients_before_ort_backward() -> None:
    def register(model: Net, seen: Seen) -> None:
        def pre(module: nn.Module, grad_output: Any) -> Any:
            seen.append(("pre", _detached(grad_output)))
            return tuple(g * -0.5 for g in grad_output)

        model.register_full_backward_pre_hook(pre)
        model.register_full_backward_hook(
            lambda m, gi, go: seen.append(("full", _detached(gi) + _detached(go))) or None
        )

    _compare(register)


def test_a_parameter_gradient_hook_sees_only_the_users_backward() -> None:
    """The first call of a graph also runs through the graph and eagerly to compare them (the
    plain backend's check; `--verify` on either backend): neither run fires a hook."""
    repatch(Net, patcher.Settings(engine=EngineOptions(verify=1)))

    def register(model: Net, seen: Seen) -> None:
        model.fc.weight.register_hook(lambda g: seen.append(("fc.weight", (g.clone(),))))

    _compare(register)


def test_global_and_module_backward_hooks_run_in_eager_order() -> None:
    handles: list[Any] = []

    def register(model: Net, seen: Seen) -> None:
        for h in handles:
            h.remove()
        handles.clear()
        handles.append(
            torch_module.register_module_full_backward_pre_hook(
                lambda m, go: seen.append(("global pre", _detached(go))) or None
            )
        )
        handles.append(
            torch_module.register_module_full_backward_hook(
                lambda m, gi, go: seen.append(("global full", _detached(gi))) or None
            )
        )
        model.register_full_backward_pre_hook(
            lambda m, go: seen.append(("module pre", _detached(go))) or None
        )
        model.register_full_backward_hook(
            lambda m, gi, go: seen.append(("module full", _detached(gi))) or None
        )

    try:
        _compare(register, cls=Leaf)
    finally:
        for h in handles:
            h.remove()


def test_global_forward_hooks_run_the_class_in_pytorch_with_their_reason() -> None:
    model = Leaf()
    handle = torch_module.register_module_forward_hook(lambda m, args, out: None)
    try:
        model(torch.randn(2, 6), torch.randn(2, 3))
    finally:
        handle.remove()
    stats = class_stats(Net)
    assert stats.ort_calls == 0 and stats.eager_calls["global forward hooks"] == 1


def test_a_non_full_backward_hook_runs_the_class_in_pytorch_with_its_reason() -> None:
    model = Net()
    calls: list[int] = []
    with pytest.warns(FutureWarning):  # torch's own deprecation of the non-full kind
        model.register_backward_hook(lambda m, gi, go: calls.append(1))
        out, _ = model(torch.randn(2, 6), torch.randn(2, 3))
    out.sum().backward()
    stats = class_stats(Net)
    assert calls and stats.ort_calls == 0
    assert stats.eager_calls["non-full backward hooks (register_backward_hook)"] == 1


def test_a_backward_hook_on_a_submodule_runs_the_class_in_pytorch_with_its_reason() -> None:
    model = Net()
    calls: list[int] = []
    model.fc.register_full_backward_hook(lambda m, gi, go: calls.append(1))
    out, _ = model(torch.randn(2, 6), torch.randn(2, 3))
    out.sum().backward()
    stats = class_stats(Net)
    assert calls == [1] and stats.ort_calls == 0
    assert stats.eager_calls["hooks on submodules"] == 1


def test_a_global_backward_hook_runs_a_class_with_submodules_in_pytorch_with_its_reason() -> None:
    model = Net()
    names: list[str] = []
    handle = torch_module.register_module_full_backward_hook(
        lambda m, gi, go: names.append(type(m).__name__) or None
    )
    try:
        out, _ = model(torch.randn(2, 6), torch.randn(2, 3))
        out.sum().backward()
    finally:
        handle.remove()
    stats = class_stats(Net)
    assert names == ["Net", "Linear", "Linear"] and stats.ort_calls == 0
    reason = "global backward hooks (they run on every submodule, inside the graph)"
    assert stats.eager_calls[reason] == 1
