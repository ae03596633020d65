"""random_ops.py: the one place that says which operators draw random numbers."""

from __future__ import annotations

import pytest

from ort_autopatch.engine import random_ops


@pytest.mark.parametrize(
    "name",
    [
        "aten::dropout",
        "aten::native_dropout",
        "aten::randn_like",
        "aten::bernoulli_",
        "aten::uniform_",
        "aten::multinomial",
        "aten::rrelu",
        "aten::lstm",
        "aten::scaled_dot_product_attention",
    ],
)
def test_random_aten_operators_are_known(name: str) -> None:
    assert random_ops.aten(name)


@pytest.mark.parametrize(
    "name", ["aten::add", "aten::layer_norm", "aten::batch_norm", "aten::poisson_nll_loss"]
)
def test_deterministic_aten_operators_are_not_random(name: str) -> None:
    assert not random_ops.aten(name)


def test_ort_fused_dropouts_are_random_per_run() -> None:
    assert {"BitmaskDropout", "BiasDropout"} <= random_ops.ONNX_PER_RUN <= random_ops.ONNX
