"""hazards.py on its own: what a trace froze, judged from small traced functions."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ort_autopatch.engine import hazards


def _findings(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> hazards.Findings:
    with hazards.recording() as found:
        torch.jit.trace(fn, (x,), check_trace=False)
    return found


def test_a_branch_on_a_tensor_value_is_a_value_hazard() -> None:
    def branch(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if bool(x.sum() > 0) else x

    found = _findings(branch, torch.ones(3))
    assert hazards.worst(found.hazards) == hazards.VALUE
    assert all(__file__.rsplit("/", 1)[-1] in h.where for h in found.hazards)


def test_a_python_int_taken_from_a_size_is_a_shape_hazard() -> None:
    def halves(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(int(x.shape[0]) // 2, -1)

    found = _findings(halves, torch.ones(4, 3))
    assert hazards.worst(found.hazards) == hazards.SHAPE


def test_a_trace_without_conversions_finds_nothing() -> None:
    found = _findings(lambda x: x.relu() + 1, torch.ones(3))
    assert found.hazards == [] and hazards.worst(found.hazards) is None


def test_recording_puts_torch_tensor_methods_back() -> None:
    before = {name: torch.Tensor.__dict__.get(name) for name in ("__bool__", "__int__", "split")}
    _findings(lambda x: x + 1, torch.ones(2))
    assert {name: torch.Tensor.__dict__.get(name) for name in before} == before


def test_a_check_holds_only_for_the_traced_value() -> None:
    hazard = hazards.Hazard(hazards.SHAPE, "size", "model.py:1")
    assert hazards.Check(4, hazard).holds(4) and not hazards.Check(4, hazard).holds(5)
    assert hazards.Check([2, 3], hazard).width == 2 and hazards.Check([2, 3], hazard).is_list
