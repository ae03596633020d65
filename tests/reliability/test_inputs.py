"""Bad and unusual inputs: equal to eager, or a clear error naming the argument."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ort_autopatch import patcher, report
from ort_autopatch.engine import MixedDevicesError, UnsupportedInputError
from ort_autopatch.policy import Fallback
from tests.helpers import patched, plain_backend, repatch


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()


class Mixed(nn.Module):
    """Integer and bool inputs, and a Python scalar and None among the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> tuple[Any, ...]:
        h = self.embed(ids) * keep.unsqueeze(-1)
        return h.sum(), 7, None, (ids + 1)


class AnyArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return sum(self.fc(x) for x in xs)  # type: ignore[return-value]


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, tree: Any) -> torch.Tensor:
        while isinstance(tree, (list, dict)):
            tree = tree[0] if isinstance(tree, list) else tree["x"]
        return self.fc(tree)


class Fields(nn.Module):
    """Takes a dataclass and returns one (of the classes the call brings)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, batch: Any) -> Any:
        out = type(batch)(x=self.fc(batch.x), scale=batch.scale)
        return dataclasses.replace(out, x=out.x * batch.scale)


PATCHED = (Dense, Conv, Mixed, AnyArgs, Nested, Fields)


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched(PATCHED)


def _compare(model: nn.Module, *args: Any, in_ort: bool = True) -> None:
    """Outputs and gradients equal eager; and this very call ran in ORT (or did not)."""
    model.zero_grad(set_to_none=True)  # deepcopy does not copy .grad of parameters
    twin = copy.deepcopy(model)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    twin_args = [
        a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        for a in args
    ]
    name = patcher.class_name(type(model))
    ran_in_ort = report.snapshot().get(name, {}).get("ort_calls", 0)
    out = model(*args)
    assert report.snapshot()[name]["ort_calls"] == ran_in_ort + in_ort, "where the call ran"
    ref = twin.forward(*twin_args)
    torch.testing.assert_close(out, ref, equal_nan=True)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True)
    for a, b in zip(
        leaves,
        [a for a in twin_args if isinstance(a, torch.Tensor) and a.requires_grad],
        strict=True,
    ):
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True)


def test_nan_and_inf_inputs_give_eager_outputs_and_gradients() -> None:
    x = torch.randn(5, 4)
    x[0, 1], x[2, 3], x[3, 0] = float("nan"), float("inf"), float("-inf")
    _compare(Dense(), x)


def test_an_empty_batch_gives_eager_outputs_and_gradients() -> None:
    """The training build's GemmGrad rejects K = 0 (PyTorch runs that call); the plain
    backend's gradient graph comes from torch's autograd and takes it in ORT."""
    plain = plain_backend()
    model = Dense()
    _compare(model, torch.randn(3, 4))
    _compare(model, torch.randn(0, 4), in_ort=plain)
    stats = report.snapshot()[patcher.class_name(Dense)]
    if not plain:
        assert stats["eager_calls"] == 1 and stats["fallbacks"][0]["reason"] == "unsupported input"
    _compare(model, torch.randn(3, 4))  # the graph was not condemned by the empty batch
    assert report.snapshot()[patcher.class_name(Dense)]["ort_calls"] == 2 + plain


def test_an_empty_batch_without_gradients_runs_in_ort() -> None:
    model = Dense().eval()
    with torch.no_grad():
        assert model(torch.randn(0, 4)).shape == (0, 3)
    assert report.snapshot()[patcher.class_name(Dense)]["ort_calls"] == 1


def test_non_contiguous_inputs_give_eager_results() -> None:
    _compare(Dense(), torch.randn(4, 5).t())


def test_channels_last_inputs_give_eager_results() -> None:
    _compare(Conv(), torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last))


def test_inputs_requiring_grad_get_eager_gradients() -> None:
    _compare(Dense(), torch.randn(5, 4, requires_grad=True))


def test_integer_and_bool_inputs_and_scalar_and_none_outputs() -> None:
    model = Mixed()
    twin = copy.deepcopy(model)
    ids = torch.tensor([[1, 2, 3], [4, 0, 9]])
    keep = torch.tensor([[True, False, True], [True, True, False]])
    total, seven, nothing, shifted = model(ids, keep)
    ref = twin.forward(ids, keep)
    torch.testing.assert_close(total, ref[0])
    assert (seven, nothing) == (7, None)
    assert torch.equal(shifted, ref[3]) and shifted.dtype == torch.int64
    total.backward()
    ref[0].backward()
    torch.testing.assert_close(model.embed.weight.grad, twin.embed.weight.grad)


def test_a_different_number_of_arguments_builds_another_graph() -> None:
    model = AnyArgs()
    x = torch.randn(2, 4)
    _compare(model, x)
    _compare(model, x, x + 1)
    assert report.snapshot()[patcher.class_name(AnyArgs)]["exports"] == 2


def test_very_deep_nesting_of_inputs() -> None:
    model = Nested()
    x = torch.randn(2, 4)
    tree: Any = x
    for depth in range(200):
        tree = [tree] if depth % 2 else {"x": tree}
    torch.testing.assert_close(model(tree), model.fc(x))
    assert report.snapshot()[patcher.class_name(Nested)]["ort_calls"] == 1


def test_dataclass_inputs_and_outputs_run_in_ort_and_stay_out_of_pytrees_registry() -> None:
    from torch.utils import _pytree as pytree

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        scale: float

    model = Fields()
    twin = copy.deepcopy(model)
    x = torch.randn(3, 4)
    out = model(Batch(x, 2.0))
    ref = twin.forward(Batch(x, 2.0))
    assert type(out) is Batch and out.scale == 2.0
    torch.testing.assert_close(out.x, ref.x)
    out.x.sum().backward()
    ref.x.sum().backward()
    torch.testing.assert_close(model.fc.weight.grad, twin.fc.weight.grad)
    assert report.snapshot()[patcher.class_name(Fields)]["ort_calls"] == 1
    # The user's class is not in torch's process-wide registry: registering it (for
    # torch.export, say) still works, and the patched module keeps working afterwards.
    assert Batch not in pytree.SUPPORTED_NODES
    pytree.register_dataclass(Batch)
    try:
        torch.testing.assert_close(model(Batch(x, 2.0)).x, ref.x)
    finally:
        pytree._deregister_pytree_node(Batch)


def test_tensors_on_two_devices_are_a_clear_error() -> None:
    repatch(AnyArgs, patcher.Settings(fallback=Fallback.FALLBACK_DISABLE))
    with pytest.raises(MixedDevicesError, match="inputs on cpu and meta"):
        AnyArgs()(torch.randn(2, 4), torch.randn(2, 4, device="meta"))


def test_an_unsupported_argument_is_named() -> None:
    repatch(Nested, patcher.Settings(fallback=Fallback.FALLBACK_DISABLE))
    with pytest.raises(UnsupportedInputError, match=r"argument #0\['x'\] is a set"):
        Nested()({"x": {1, 2}})
