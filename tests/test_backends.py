"""backends/: the declared list and the interface every backend implements."""

from __future__ import annotations

import pytest
import torch

from ort_autopatch.engine import EngineOptions, backends, signature
from ort_autopatch.engine.backends.ort_training import TrainingBuild
from ort_autopatch.engine.errors import UnsupportedInputError


def test_every_declared_backend_is_a_backend_under_its_own_name() -> None:
    for name in backends.BACKENDS:
        backend = backends.backend_class(name)
        assert issubclass(backend, backends.Backend) and backend.name == name


def test_auto_picks_the_training_build_where_it_is_installed() -> None:
    assert TrainingBuild.unavailable() is None
    assert backends.choose() is TrainingBuild and backends.choose("auto") is TrainingBuild


def test_an_unknown_backend_name_is_refused() -> None:
    with pytest.raises(KeyError):
        backends.choose("no-such-backend")


def test_the_training_build_refuses_an_empty_training_batch() -> None:
    backend = TrainingBuild("Net", EngineOptions(), lambda m, *a, **k: m(*a, **k))
    call = signature.flatten_call("Net", (torch.zeros(0, 3),), {}, True)
    with pytest.raises(UnsupportedInputError, match="empty"):
        backend.refuse(call)
    backend.refuse(signature.flatten_call("Net", (torch.zeros(2, 3),), {}, True))

