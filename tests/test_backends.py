"""backends/: the declared list and the interface every backend implements."""

from __future__ import annotations

import pytest
import torch

from ort_autopatch.engine import EngineOptions, calls, signature
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
    assert expected.unavailable() is None
    assert backends.choose() is expected and backends.choose("auto") is expected


def test_an_unknown_backend_name_is_refused() -> None:
    with pytest.raises(KeyError):
        backends.choose("no-such-backend")


def test_the_training_build_refuses_an_empty_training_batch() -> None:
    backend = OrtTrainingBackend("Net", EngineOptions(), lambda m, *a, **k: m(*a, **k))
    call = signature.flatten_call("Net", (torch.zeros(0, 3),), {}, True)
    with pytest.raises(UnsupportedInputError, match="empty"):
        backend.refuse(call)
    backend.refuse(signature.flatten_call("Net", (torch.zeros(2, 3),), {}, True))


class _TorchProgram:
    """A toy backend's program: the module's forward in torch, on the feeds the entry gathers."""

    runs = 0

    def __init__(self, module: torch.nn.Module, feed_names: list[str], names: list[str]) -> None:
        self.module = module
        self.feed_names = feed_names
        self.state_names = names
        self.torch_nodes: dict[str, int] = {}
        self.saved_graphs: dict[str, bytes] = {}

    def run(self, feeds: list[torch.Tensor], recompute: bool) -> list[torch.Tensor]:
        _TorchProgram.runs += 1
        params = dict(zip(self.state_names, feeds[1:], strict=True))
        return [torch.func.functional_call(self.module, params, (feeds[0],))]


class _Payload:
    def graphs(self) -> dict[str, bytes]:
        return {}

    def meta(self) -> dict[str, object]:
        return {}


class _TorchBackend(backends.Backend):
    """The smallest backend: no ONNX at all, which is what makes it a test of the seam alone."""

    name = "toy"

    @staticmethod
    def unavailable() -> str | None:
        return None

    @staticmethod
    def graph_version() -> str:
        return "toy"

    def build(self, miss, progress):  # type: ignore[no-untyped-def]
        from torch.utils import _pytree as pytree

        from ort_autopatch.engine.recipe import Recipe

        _, spec = pytree.tree_flatten(torch.zeros(1))
        sources = {"x": ("input", 0), **{n: ("state", n) for n in miss.state.names}}
        recipe = Recipe(
            backend=self.name,
            has_backward=miss.grad,
            forward_model=b"",
            payload=_Payload(),
            feed_sources=sources,
            num_user_outputs=1,
            output_spec=calls.OutputSpec(spec, [None], [0]),
            batch_norms=[],
            seeds_dropout=False,
        )
        return recipe, 0.0

    def instantiate(self, recipe, miss, step, settings, progress):  # type: ignore[no-untyped-def]
        return _TorchProgram(miss.module, list(recipe.feed_sources), list(miss.state.names))

    @staticmethod
    def payload_from(meta, graphs):  # type: ignore[no-untyped-def]
        return _Payload()


def test_a_backend_declared_in_the_list_serves_the_engines_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ort_autopatch.engine import ModuleEngine

    # declared first, and available: `choose()`, which every engine asks, picks it
    toy = {"toy": f"{__name__}:_TorchBackend"}
    monkeypatch.setattr(backends, "BACKENDS", {**toy, **backends.BACKENDS})
    backends.choose.cache_clear()
    try:
        assert backends.choose() is _TorchBackend
        _TorchProgram.runs = 0
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
        assert _TorchProgram.runs == 1 and len(engine.records) == 1
        assert engine.records[0].has_backward
    finally:
        backends.choose.cache_clear()
