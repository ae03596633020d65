"""One root for every error the tool raises on purpose, each with a cause and a remedy."""

from __future__ import annotations

import pickle

import pytest
import torch

import ort_autopatch
from ort_autopatch.engine import errors as engine_errors
from ort_autopatch.hook import Selector

ENGINE_ERRORS = [
    cls
    for cls in vars(engine_errors).values()
    if isinstance(cls, type) and issubclass(cls, engine_errors.EngineError)
]


@pytest.mark.parametrize("cls", ENGINE_ERRORS, ids=lambda c: c.__name__)
def test_every_engine_error_is_an_ort_autopatch_error_that_pickles(cls: type) -> None:
    error = cls("m:Net", "the cause", "the remedy")
    assert isinstance(error, ort_autopatch.OrtAutopatchError)
    assert isinstance(error, RuntimeError)  # what callers caught before
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.module_class, copy.cause, copy.remedy, str(copy)) == (
        cls,
        "m:Net",
        "the cause",
        "the remedy",
        "m:Net: the cause. the remedy",
    )


def test_an_error_that_concerns_no_class_does_not_name_the_tool_as_one() -> None:
    error = engine_errors.RuntimeUnavailableError("", "no training build", "Install one")
    assert str(error) == "no training build. Install one"


def test_patching_a_non_module_names_cause_and_remedy() -> None:
    with pytest.raises(ort_autopatch.NotPatchableError) as info:
        ort_autopatch.patch(torch.nn.Linear(2, 2))  # type: ignore[arg-type]  (an instance)
    assert isinstance(info.value, (ort_autopatch.OrtAutopatchError, TypeError))
    assert "is not a torch.nn.Module subclass" in info.value.cause
    assert "the class, not an instance" in info.value.remedy
    assert pickle.loads(pickle.dumps(info.value)).cause == info.value.cause


def test_a_bad_selector_pattern_is_a_config_error() -> None:
    with pytest.raises(ort_autopatch.ConfigError) as info:
        Selector(["no_colon"], [])
    assert isinstance(info.value, ort_autopatch.OrtAutopatchError)
    assert info.value.cause and info.value.remedy
