"""A third backend from outside the package: the seam test of `engine.backend`.

It runs each call's graph with torch itself (no ONNX at all), through the engine's shared
run-time (`graph_function`: the autograd Function and its recomputing variant, a failed
backward told to the engine), so what a test of it checks is the seam alone: keying, caches,
builds, feeds, buffer updates, autograd, reports. Declaring it is one `register` call.

As a pytest plugin (`pytest -p tests.toy_backend ...`) it registers itself ahead of the ORT
backends, so every engine of the session ("auto") runs on it: tests/test_backends.py runs the
parity suite that way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch.utils import _pytree as pytree

from ort_autopatch.engine import backend as registry
from ort_autopatch.engine import graph_function
from ort_autopatch.engine.backend import Backend, Declared, Progress, RunHooks
from ort_autopatch.engine.recipe import Miss, Recipe
from ort_autopatch.engine.session import SessionSettings
from ort_autopatch.engine.shape_policy import DynamicGraphs

NAME = "toy"


class _Payload:
    def graphs(self) -> dict[str, bytes]:
        return {}

    def meta(self) -> dict[str, object]:
        return {}

    def restores_torch_nodes(self) -> bool:
        return False


class ToyProgram:
    """A call as torch runs it: forward under autograd inside the shared Function."""

    runs: ClassVar[int] = 0

    def __init__(
        self, module: torch.nn.Module, forward: Any, feed_names: list[str], recipe: Recipe
    ) -> None:
        self.module = module
        self.call_forward = forward
        self.feed_names = feed_names
        self.recipe = recipe
        self.inputs = [n for n in feed_names if recipe.feed_sources[n][0] == "input"]
        self.hooks = RunHooks(NAME)
        self.redraws = False  # torch's own generators: a rerun can replay them
        self.torch_nodes: dict[str, int] = {}
        self.saved_graphs: dict[str, bytes] = {}

    def _call(self, feeds: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The module's forward on `feeds` (inputs, then its parameters and buffers by
        name); its flat tensor outputs."""
        ToyProgram.runs += 1
        by_name = dict(zip(self.feed_names, feeds, strict=True))
        state = {
            where: by_name[name]
            for name, (kind, where) in self.recipe.feed_sources.items()
            if kind == "state"
        }
        spec = self.recipe.payload.call_spec  # type: ignore[attr-defined]
        args, kwargs = spec.rebuild([by_name[n] for n in self.inputs])
        result = torch.func.functional_call(self.module, state, args, kwargs)
        leaves, _ = pytree.tree_flatten(result)
        return tuple(t for t in leaves if isinstance(t, torch.Tensor))

    def run(self, feeds: list[torch.Tensor], recompute: bool) -> Sequence[torch.Tensor]:
        if torch.is_grad_enabled() and any(f.requires_grad for f in feeds):
            return graph_function.apply(self, feeds, recompute)
        with torch.no_grad():
            return self._call(feeds)

    def undo_point(self, feeds: Sequence[torch.Tensor]) -> Callable[[], None]:
        return lambda: None  # the toy's recipes carry no size checks: never asked

    # -- graph_function.DifferentiableGraph ---------------------------------------------------
    def forward(self, ctx: Any, feeds: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        leaves = [f.detach().requires_grad_(f.requires_grad) for f in feeds]
        with torch.enable_grad():
            outputs = self._call(leaves)
        ctx.leaves, ctx.outputs = leaves, outputs
        return tuple(o.detach() for o in outputs)

    def backward(self, ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[Any]:
        wanted = [k for k, leaf in enumerate(ctx.leaves) if leaf.requires_grad]
        pairs = [
            (o, g)
            for o, g in zip(ctx.outputs, grads, strict=True)
            if g is not None and o.requires_grad
        ]
        found = torch.autograd.grad(
            [o for o, _ in pairs],
            [ctx.leaves[k] for k in wanted],
            [g for _, g in pairs],
            allow_unused=True,
        )
        result: list[Any] = [None] * len(ctx.leaves)
        for k, grad in zip(wanted, found, strict=True):
            result[k] = grad
        return result

    def recomputing_forward(
        self, ctx: Any, feeds: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            outputs = self._call(feeds)
        ctx.save_for_backward(*feeds)
        return outputs

    def recomputing_backward(self, ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[Any]:
        self.forward(ctx, ctx.saved_tensors)
        return self.backward(ctx, grads)


class ToyBackend(Backend):
    """Graphs that are the module itself, run by torch."""

    name: ClassVar[str] = NAME

    @staticmethod
    def graph_version() -> str:
        return "toy-1"

    def shape_policy(self) -> DynamicGraphs:
        return DynamicGraphs(self.options.static_after)

    def build(self, miss: Miss, progress: Progress) -> tuple[Recipe, float]:
        from ort_autopatch.engine.calls import OutputSpec, preserved_state, stepping_aside

        # forward once for the structure of its outputs; buffers and RNG left as they were
        with torch.no_grad(), preserved_state(miss.module), stepping_aside():
            args, kwargs = miss.call.spec().rebuild(miss.call.tensors)
            result = self.forward(miss.module, *args, **kwargs)
        output_spec, outputs = OutputSpec.of(result)
        inputs = {f"input{k}": ("input", k) for k in range(len(miss.call.tensors))}
        payload = _Payload()
        payload.call_spec = miss.call.spec()  # type: ignore[attr-defined]
        recipe = Recipe(
            backend=self.name,
            has_backward=miss.has_backward,
            forward_model=b"",
            payload=payload,
            feed_sources={**inputs, **{n: ("state", n) for n in miss.state.names}},
            num_user_outputs=len(outputs),
            output_spec=output_spec,
            batch_norms=[],
            seeds_dropout=False,
        )
        return recipe, 0.0

    def instantiate(
        self,
        recipe: Recipe,
        miss: Miss,
        hooks: RunHooks,
        settings: SessionSettings,
        progress: Progress,
    ) -> ToyProgram:
        program = ToyProgram(miss.module, self.forward, list(recipe.feed_sources), recipe)
        program.hooks = hooks
        return program

    @staticmethod
    def payload_from(meta: dict[str, Any], graphs: dict[str, bytes]) -> _Payload:
        raise ValueError("the toy backend stores nothing")


DECLARED = Declared(NAME, f"{__name__}:ToyBackend", lambda: None)


def pytest_configure(config: Any) -> None:
    """As a plugin: every engine of the session runs on the toy backend."""
    registry.register(DECLARED, first=True)
