"""The call key: one structure decides whether a graph fits a call, and says why not.

The hit path hands back the previous call's key object when no guard moved; these tests pin
down that every change a key guards still moves it, including the changes no patched method
sees (a submodule's `.eval()`, `requires_grad_()`, a direct `_parameters` write, in-place
mutation of a guarded container or tensor), and that each computed call still matches eager.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ort_autopatch import attribute_guards, patcher, report
from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine.callkey import CallKey, KeyMaker
from ort_autopatch.engine.module_engine import ModuleEngine
from ort_autopatch.engine.state import ModuleState


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.fc(x))))


def _key(
    maker: KeyMaker, grad: bool = True, inputs: object = ("x",), shapes: object = None
) -> CallKey:
    requires = maker.state.requires_grad_flags() if grad else []
    return maker.key(grad, inputs, shapes, requires)  # type: ignore[arg-type]


def test_an_unchanged_call_gets_the_previous_key_object_back() -> None:
    maker = KeyMaker(ModuleState(Block()), None)
    assert _key(maker) is _key(maker)


def test_a_submodule_switched_to_eval_alone_moves_the_key() -> None:
    model = Block()
    maker = KeyMaker(ModuleState(model), None)
    before = _key(maker)
    model.drop.eval()  # not through the root: no patched method sees it
    after = _key(maker)
    assert after != before
    assert after.diff(before) == "train/eval mode changed"


def test_a_nested_parameter_frozen_in_place_moves_the_key() -> None:
    model = Block()
    maker = KeyMaker(ModuleState(model), None)
    before = _key(maker)
    model.fc.weight.requires_grad_(False)
    assert _key(maker).diff(before) == "requires_grad changed"


def test_gradient_mode_and_inputs_are_named_in_the_order_of_the_guards() -> None:
    maker = KeyMaker(ModuleState(Block()), None)
    training = _key(maker)
    assert _key(maker, grad=False).diff(training) == "gradient mode changed"
    assert _key(maker, inputs=("x", "y")).diff(training) == "new input signature"
    assert _key(maker, shapes=((2, 6),)).diff(training) == "new input shape"


def test_entering_autocast_moves_the_key_and_is_named_with_its_dtype() -> None:
    maker = KeyMaker(ModuleState(Block()), None)
    requires = maker.state.requires_grad_flags()
    plain = maker.key(True, ("x",), None, requires)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = maker.key(True, ("x",), None, requires, amp.state("cpu"))
    assert autocast != plain
    assert autocast.diff(plain) == "autocast changed (off -> cpu bfloat16)"
    assert plain.diff(autocast) == "autocast changed (cpu bfloat16 -> off)"
    assert maker.key(True, ("x",), None, requires) == plain


def test_a_parameter_written_straight_into_the_parameters_dict_is_stale() -> None:
    model = Block()
    maker = KeyMaker(ModuleState(model), None)
    assert maker.stale() is None
    # What FSDP2's unshard and torch.func.functional_call do: no __setattr__ runs.
    model.out._parameters["weight"] = nn.Parameter(torch.randn(3, 6))
    assert maker.stale() == "weight replaced"


def test_a_dtype_changed_in_place_is_stale() -> None:
    model = Block()
    maker = KeyMaker(ModuleState(model), None)
    model.fc.bias.data = model.fc.bias.data.double()  # same Parameter object
    assert maker.stale() == "dtype changed"


class Attribute:
    """A guard source holding one attribute, as the patcher's recorded reads do."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def values(self) -> tuple[object, ...]:
        return (attribute_guards.guard_value(getattr(self.owner, self.name)),)

    def labels(self) -> list[str]:
        return [f"{type(self.owner).__name__}.{self.name}"]

    def paths(self) -> list[str]:
        return [self.name]

    def adopt(self, root: object, paths: list[str]) -> None:
        pass


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.sizes = [1.0, 2.0]
        self.offset = torch.ones(4)
        self.scale = 2.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.sizes[-1] * self.scale + self.offset


@pytest.fixture
def scaled() -> Iterator[Scaled]:
    report.reset()
    patcher.patch(Scaled)
    yield Scaled()
    patcher.unpatch_all()


def _rebuilds(cls: type) -> dict[str, int]:
    return dict(report.stats_for(patcher.class_name(cls)).rebuilds)


def test_a_list_attribute_appended_to_in_place_selects_another_graph(scaled: Scaled) -> None:
    x = torch.randn(3, 4)
    scaled(x)
    scaled.sizes.append(3.0)  # the same list object: only its contents say it changed
    torch.testing.assert_close(scaled(x), scaled.forward(x))
    assert _rebuilds(Scaled) == {"attribute Scaled.sizes written": 1}


def test_a_tensor_attribute_updated_in_place_selects_another_graph(scaled: Scaled) -> None:
    x = torch.randn(3, 4)
    scaled(x)
    scaled.offset.add_(1.0)  # its version counter moves; the object stays
    torch.testing.assert_close(scaled(x), scaled.forward(x))
    assert _rebuilds(Scaled) == {"attribute Scaled.offset written": 1}


def test_an_equal_value_in_a_new_object_keeps_its_graph(scaled: Scaled) -> None:
    x = torch.randn(3, 4)
    scaled(x)
    scaled.scale = float("2.5")  # another object, the same value
    scaled.sizes = [1.0, 2.0]
    torch.testing.assert_close(scaled(x), scaled.forward(x))
    assert _rebuilds(Scaled) == {}
    assert report.stats_for(patcher.class_name(Scaled)).ort_calls == 2


class Encoder(nn.Module):
    """Its eager eval call reads attributes no trace of it reads: TransformerEncoderLayer's
    checks for its fused fast path (`activation_relu_or_gelu`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_an_eval_call_between_training_steps_keeps_the_training_graph() -> None:
    """Only a trace's reads are guards: an eager run for the engine (the plain backend's check
    of a graph's first call, --verify) guards nothing, or every training call after an eval
    call would miss its graph ('attributes forward reads changed') and build again."""
    report.reset()
    patcher.patch(Encoder)
    try:
        model, x = Encoder(), torch.randn(2, 5, 8)
        for mode in ("train", "eval", "train"):
            model.train(mode == "train")
            with torch.set_grad_enabled(mode == "train"):
                torch.testing.assert_close(model(x), model.forward(x), msg=mode)
        stats = report.stats_for(patcher.class_name(Encoder))
        assert (stats.ort_calls, stats.exports) == (3, 2)
        assert _rebuilds(Encoder) == {"train/eval mode changed": 1}
    finally:
        patcher.unpatch_all()


def test_the_persistent_part_holds_no_memory_addresses() -> None:
    model = Scaled()
    maker = KeyMaker(ModuleState(model), Attribute(model, "offset"))
    stored = repr(_key(maker).persistent())
    assert "0x" not in stored and str(id(model.offset)) not in stored


def test_every_call_matches_eager_across_the_changes_the_key_guards() -> None:
    torch.manual_seed(0)
    model = Block()
    engine = ModuleEngine(model)
    x = torch.randn(5, 6)

    def check() -> None:
        with torch.no_grad():
            expected = model.forward(x) if not model.drop.training else None
        got = engine(x)
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    model.eval()
    check()
    model.drop.train()  # dropout alone back in training: random, so only the key is checked
    engine(x)
    model.drop.eval()
    check()
    model.out._parameters["weight"] = nn.Parameter(torch.randn(3, 6))
    check()
    reasons = [r.reason for r in engine.records]
    assert reasons == ["first call", "train/eval mode changed", "weight replaced"]
