"""Output objects holding tensors (transformers' DynamicCache) carry each call's tensors."""

from __future__ import annotations

import torch
from torch import nn

from ort_autopatch.engine import ModuleEngine
from tests.helpers import plain_backend


class Cache:
    """Like transformers' DynamicCache: a list of layer objects with tensors and ints."""

    def __init__(self) -> None:
        self.layers: list[Layer] = []


class Layer:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.length = 0
        self.name = "layer"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        cache = Cache()
        for _ in range(2):
            layer = Layer()
            layer.keys = self.proj(x)
            layer.length += x.shape[1]
            cache.layers.append(layer)
            x = torch.tanh(layer.keys)
        return x, cache


def test_each_call_gets_a_fresh_object_with_its_own_tensors() -> None:
    torch.manual_seed(0)
    model = Model()
    engine = ModuleEngine(model)
    first_input, second_input = torch.randn(2, 3, 4), torch.randn(5, 6, 4)
    first = engine(first_input)[1]
    second = engine(second_input)[1]
    expected = model(second_input)[1]
    assert second is not first and second.layers[0] is not first.layers[0]
    for got, want in zip(second.layers, expected.layers, strict=True):
        assert got.keys is not None and want.keys is not None
        torch.testing.assert_close(got.keys, want.keys)
        assert got.length == want.length == 6 and type(got.length) is int
        assert got.name == "layer"
    # plain: the first call's shapes get their own graph, the second call a symbolic one
    assert engine.builds == (2 if plain_backend() else 1)


def test_the_objects_tensors_carry_gradients() -> None:
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 3, 4)
    _, cache = ModuleEngine(model)(x)
    cache.layers[1].keys.sum().backward()
    assert model.proj.weight.grad is not None
    ours = model.proj.weight.grad.clone()
    model.zero_grad()
    model(x)[1].layers[1].keys.sum().backward()
    torch.testing.assert_close(ours, model.proj.weight.grad)
