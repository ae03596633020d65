"""backends/: the declared list and the interface every backend implements."""

from __future__ import annotations

import pytest
import torch

from ort_autopatch.engine import EngineOptions, signature
from ort_autopatch.engine import backend as backends
from ort_autopatch.engine.backends.ort_training.backend import OrtTrainingBackend
from ort_autopatch.engine.errors import UnsupportedInputError


def test_every_declared_backend_is_a_backend_under_its_own_name() -> None:
    for name in backends.BACKENDS:
        backend = backends.backend_class(name)
        assert issubclass(backend, backends.Backend) and backend.name == name


def test_auto_picks_the_training_build_where_it_is_installed_else_the_plain_one() -> None:
    from importlib import metadata

    from ort_autopatch.engine.backends.ort.backend import OrtBackend

    installed = {d.metadata["Name"].lower() for d in metadata.distributions()}
    training = bool(installed & {"onnxruntime-training", "onnxruntime-training-cpu"})
    expected = OrtTrainingBackend if training else OrtBackend
    assert backends.unavailable_reason(expected.name) is None
    assert backends.resolve() == expected.name
    assert backends.choose() is expected and backends.choose("auto") is expected
    assert backends.chosen()[0] == expected.name  # what the report names


def test_the_configuration_offers_every_declared_backend_and_auto() -> None:
    from ort_autopatch import config

    assert config.BACKENDS == ("auto", *backends.BACKENDS)


def test_an_unknown_backend_name_is_refused() -> None:
    with pytest.raises(ValueError, match="no-such-backend"):
        backends.choose("no-such-backend")


def test_the_training_build_refuses_an_empty_training_batch() -> None:
    backend = OrtTrainingBackend("Net", EngineOptions(), lambda m, *a, **k: m(*a, **k))
    call = signature.flatten_call("Net", (torch.zeros(0, 3),), {}, True)
    with pytest.raises(UnsupportedInputError, match="empty"):
        backend.refuse(call)
    backend.refuse(signature.flatten_call("Net", (torch.zeros(2, 3),), {}, True))


def test_a_backend_registered_from_outside_serves_the_engines_calls() -> None:
    """One `register` call and no edit to the engine: `choose()`, which every engine asks,
    picks it, and a training step gives eager's outputs and gradients through it."""
    from ort_autopatch.engine import ModuleEngine
    from tests import toy_backend

    saved = dict(backends.BACKENDS)
    backends.register(toy_backend.DECLARED, first=True)
    try:
        assert backends.resolve() == "toy" and backends.choose() is toy_backend.ToyBackend
        toy_backend.ToyProgram.runs = 0
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        engine = ModuleEngine(model)
        x = torch.randn(5, 3)
        out = engine(x)
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        model(x).sum().backward()
        assert torch.equal(out, model(x))
        for got, p in zip(grads, model.parameters(), strict=True):
            assert torch.equal(got, p.grad)
        assert type(out.grad_fn).__name__ == "GraphFunctionBackward"  # the shared run-time
        assert toy_backend.ToyProgram.runs == 1 and len(engine.records) == 1
        assert engine.records[0].has_backward
    finally:
        backends.BACKENDS.clear()
        backends.BACKENDS.update(saved)
        backends.choose.cache_clear()


def test_the_parity_suite_passes_through_a_backend_registered_from_outside() -> None:
    """The seam test: tests/test_engine_parity.py, every model against eager over its
    optimizer steps, with the toy backend (tests/toy_backend.py, registered by a pytest
    plugin) serving every engine, unchanged."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.toy_backend",
            "tests/test_engine_parity.py",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_an_option_the_backend_does_not_take_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The plain backend has no opset of its own choosing and no torch-calling nodes: setting
    those options is said once per option and process, never silently ignored."""
    import logging

    from ort_autopatch.engine.backends.ort.backend import OrtBackend

    backends._said.clear()
    options = EngineOptions(opset=18, torch_ops=("aten::einsum",))
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        for _ in range(3):  # one backend per module instance
            OrtBackend("Net", options, lambda m, *a, **k: m(*a, **k))
        OrtBackend("Net", EngineOptions(), lambda m, *a, **k: m(*a, **k))
    said = sorted(r.getMessage() for r in caplog.records)
    assert len(said) == 2, said
    assert "opset option does not apply to the ort backend" in said[0]
    assert "torch_ops option does not apply to the ort backend" in said[1]
