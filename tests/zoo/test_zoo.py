"""Real models train through ONNX Runtime with eager's numbers, or fall back for a named reason.

By default only the fast entries run (part of `nox -s tests`); `ZOO_MODELS=all` runs the whole
table (`nox -s zoo`, and `nox -s tests_torch215` on the plain backend), `ZOO_TIMING_STEPS=n`
also times n interleaved steps of each side.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.zoo import harness
from tests.zoo.models import BY_NAME, ENTRIES, FAST

SELECTED = [e.name for e in ENTRIES] if os.environ.get("ZOO_MODELS") == "all" else FAST
TIMING_STEPS = int(os.environ.get("ZOO_TIMING_STEPS", "0"))


@pytest.mark.parametrize("name", SELECTED)
def test_model_trains_like_eager_or_falls_back_for_its_named_reason(
    name: str, zoo_results: list[dict[str, Any]]
) -> None:
    entry = BY_NAME[name]
    result = harness.run(entry, timing_steps=TIMING_STEPS)
    zoo_results.append({**result.as_dict(), "order": SELECTED.index(name)})
    if entry.expect_fallback is None:
        assert result.status == "ort", f"{name}: {result.status}: {result.reason}"
        assert result.loss_rel <= harness.RTOL and result.grad_rel <= harness.RTOL, result.worst
        assert result.builds >= 1
    else:
        assert result.status == "fallback", f"{name} was expected to fall back: {result}"
        assert entry.expect_fallback in result.reason
