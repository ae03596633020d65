"""The build of a training recipe: export `forward` (falling back to static shapes where ORT
1.19.2 needs them), judge the trace's hazards, route operators ORT cannot differentiate to
torch and export again, apply the graph passes, and let ORT's gradient builder make the
gradient graph (`agent.build_gradient`).

The cold path only: the backend (`backend.OrtTrainingBackend.build`) refuses what it cannot
train first, and makes sessions from the recipe later (`instantiate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine import budget, hazards, random_ops, rng
from ort_autopatch.engine.backend import Progress
from ort_autopatch.engine.backends.ort_training import agent, heap
from ort_autopatch.engine.backends.ort_training.payload import OrtTrainingPayload, payload_of
from ort_autopatch.engine.backends.ort_training.torch_in_graph import nodes
from ort_autopatch.engine.errors import (
    AutocastUnsupportedError,
    ExportError,
    GradientBuildError,
    UnsupportedModelError,
)
from ort_autopatch.engine.recipe import Miss, Recipe
from ort_autopatch.engine.state import ModuleState

if TYPE_CHECKING:
    from ort_autopatch.engine.backends.ort_training import export
    from ort_autopatch.engine.backends.ort_training.backend import OrtTrainingBackend

log = logging.getLogger("ort_autopatch")

#: Operators whose gradients need static shapes in ORT 1.19.2 (see `build`).
_STATIC_SHAPE_OPS = ("MaxPool", "AveragePool", "LpPool")


class _NeedsStaticShapes(Exception):
    pass


def build(backend: OrtTrainingBackend, miss: Miss, progress: Progress) -> tuple[Recipe, float]:
    """The recipe for `miss` and the seconds its export took: one graph with dynamic axes
    when ORT 1.19.2 can differentiate it so, else one for the call's shapes (said through
    `progress.specialises`)."""
    from ort_autopatch.engine.backends.ort_training import graph

    dynamic = miss.shapes is None
    try:
        exported = _export(backend, miss, progress, dynamic=dynamic)
        if dynamic and exported.findings.static:
            # The trace froze sizes: this graph serves one input shape, and ORT gets it with
            # static shapes (its gradient builder can abort on a dynamic graph whose
            # structure was sized for one example, e.g. a Split unrolled over time).
            dynamic = False
            exported = _export(backend, miss, progress, dynamic=False)
        model = graph.load(exported.model_bytes)
        if (
            dynamic
            and miss.has_backward
            and any(graph.has_op(model, op) for op in _STATIC_SHAPE_OPS)
        ):
            raise _NeedsStaticShapes
        budget.check("before its gradient build")
        progress.phase = "gradient build"
        recipe, exported = _routed_recipe(backend, miss, progress, exported, model, dynamic)
        return recipe, exported.seconds
    except (_NeedsStaticShapes, ExportError, GradientBuildError) as exc:
        if not dynamic:
            raise
        # Pooling gradients in ORT 1.19.2 crash the process on dynamic shapes (MaxPoolGrad
        # SIGSEGV, AveragePoolGrad SIGFPE) and adaptive pooling only exports with known
        # sizes: such modules get one graph per input shape instead.
        log.debug("%s: building with static shapes (%s)", backend.module_class, type(exc).__name__)
        progress.phase = "export"
        exported = _export(backend, miss, progress, dynamic=False)
        model = graph.load(exported.model_bytes)
        progress.phase = "gradient build"
        recipe, exported = _routed_recipe(backend, miss, progress, exported, model, dynamic=False)
        progress.specialises()
        return recipe, exported.seconds


def _routed_recipe(
    backend: OrtTrainingBackend,
    miss: Miss,
    progress: Progress,
    exported: export.ExportedGraph,
    model: Any,
    dynamic: bool,
) -> tuple[Recipe, export.ExportedGraph]:
    """The recipe; when ORT cannot differentiate an operator, the ATen operators whose
    export produced it become torch-calling nodes and the call is exported again."""
    from ort_autopatch.engine.backends.ort_training import graph
    from ort_autopatch.engine.backends.ort_training.torch_in_graph import routing

    device = miss.device
    while True:
        try:
            recipe = _recipe(backend, miss, exported, model)
            gradient = payload_of(recipe).gradient
            missing = set()
            if gradient is not None:
                missing = routing.unrunnable_gradients(gradient.model, device)
            if not missing:
                backend.routed = backend.routed | exported.routed
                return recipe, exported
            culprits = set().union(*(routing.producers(op, exported.provenance) for op in missing))
            failure: Exception = GradientBuildError(
                backend.module_class,
                f"ONNX Runtime has no {device.type} kernel for the gradient of "
                + ", ".join(sorted(missing)),
                "Allow the operators producing it to run as torch-calling nodes, or run "
                "this class eagerly",
            )
        except GradientBuildError as exc:
            culprits = routing.culprits(exc.cause, exported.provenance)
            failure = exc
        more = {c for c in culprits if backend.may_route(c)} - exported.routed
        if not more:
            raise failure
        log.debug(
            "%s: %s become torch-calling nodes", backend.module_class, ", ".join(sorted(more))
        )
        routed = exported.routed | more
        exported = _export(backend, miss, progress, dynamic=dynamic, routed=routed)
        model = graph.load(exported.model_bytes)


def _export(
    backend: OrtTrainingBackend,
    miss: Miss,
    progress: Progress,
    dynamic: bool,
    routed: frozenset[str] | None = None,
) -> export.ExportedGraph:
    from ort_autopatch.engine.backends.ort_training import export
    from ort_autopatch.engine.backends.ort_training.torch_in_graph import routing

    forward, module, call = backend.forward, miss.module, miss.call
    chosen = backend.routed if routed is None else routed
    chosen = chosen | {r for r in routing.default_routes(miss.device) if backend.may_route(r)}
    exported = export.export_call(
        module,
        lambda *a, **k: forward(module, *a, **k),
        call.spec(),
        call.tensors,
        opset=backend.options.opset,
        dynamic=dynamic,
        routed=chosen,
        may_route=backend.may_route,
    )
    _judge(backend, progress, exported.findings)
    return exported


def _judge(backend: OrtTrainingBackend, progress: Progress, findings: hazards.Findings) -> None:
    """Decide what a trace's hazards allow: none at all when forward decided something
    from tensor values; a graph per input shape when the graph's structure follows the
    sizes; otherwise one graph that recomputes the size-derived values it froze (checks)."""
    found = findings.hazards
    backend.found(found)
    if hazards.worst(found) == hazards.VALUE:
        raise backend.data_dependent([h for h in found if h.kind == hazards.VALUE])
    if findings.static:
        log.debug(
            "%s: the trace froze sizes (%s); one graph per input shape",
            backend.module_class,
            "; ".join(h.describe() for h in found),
        )
        progress.specialises()


def _recipe(
    backend: OrtTrainingBackend, miss: Miss, exported: export.ExportedGraph, model: Any
) -> Recipe:
    """Apply the graph passes (and the gradient build) to a fresh export."""
    from ort_autopatch.engine.backends.ort_training import graph, passes

    state, call, grad = miss.state, miss.call, miss.has_backward
    refusal = amp.cpu_refusal(model, miss.autocast)
    if refusal is not None:
        raise AutocastUnsupportedError(backend.module_class, refusal, amp.REMEDY)
    padding = _embedding_padding(state, exported.state_names)
    passed = passes.apply_forward(model, grad, padding)
    frozen, stats = passed.frozen, passed.batch_norms

    user_index = {name: k for k, name in enumerate(exported.user_input_names)}
    sources: dict[str, tuple[str, Any]] = {}
    for graph_input in model.graph.input:
        name = graph_input.name
        if name in user_index:
            sources[name] = ("input", user_index[name])
            continue
        base = name[: -len("__frozen")] if name in frozen else name
        qualified = exported.state_names.get(base)
        if qualified is None or qualified not in state.index:
            raise UnsupportedModelError(
                backend.module_class,
                f"graph input {name!r} is neither an argument nor a parameter or buffer",
                "Report the model; run it eagerly meanwhile",
            )
        sources[name] = ("state", qualified)
    outputs = [o.name for o in model.graph.output]
    batch_norms = [
        (
            exported.state_names[s.running_mean].rsplit(".", 1)[0],
            outputs.index(s.mean_output),
            outputs.index(s.var_output),
        )
        for s in stats
    ]
    model_bytes = model.SerializeToString()
    gradient = None
    if grad:
        requiring = [
            n
            for n, (kind, where) in sources.items()
            if kind == "input" and call.tensors[where].requires_grad
        ]
        trainable = [
            n
            for n, (kind, where) in sources.items()
            if kind == "state"
            and n not in frozen
            and state.is_param[state.index[where]]
            and state.tensors[state.index[where]].requires_grad
        ]
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import gradients

        extra = [n for s in stats for n in (s.mean_output, s.var_output)]
        cpu = miss.device.type == "cpu"
        # the first step's activations land in heap pages faulted in while the child builds
        with heap.FirstStepPages() if cpu else contextlib.nullcontext() as pages:
            built = agent.build_gradient(
                model_bytes,
                feed_names=list(sources),
                trainable=trainable + requiring,
                inputs_requiring_grad=requiring,
                user_inputs=exported.user_input_names,
                extra_outputs=extra,
                cls=backend.module_class,
                # ORT's cast propagation would undo autocast's casts (float32 out again)
                propagate_casts=miss.autocast is None,
                meanwhile=gradients.warm_up if cpu else None,
                while_waiting=pages.more if pages is not None else None,
            )
        done = passes.apply_gradient(graph.load(built.model), extra, built.num_forward_outputs)
        gradient = dataclasses.replace(
            built,
            model=done.model.SerializeToString(),
            num_forward_outputs=done.num_forward_outputs,
        )
    return Recipe(
        backend=backend.name,
        has_backward=grad,
        forward_model=model_bytes,
        payload=OrtTrainingPayload(gradient, nodes=nodes.stored_nodes(model)),
        feed_sources=sources,
        num_user_outputs=passed.num_user_outputs,
        output_spec=exported.output_spec,
        batch_norms=batch_norms,
        seeds_dropout=rng.draws_per_run(model),
        redraws=bool(random_ops.per_session(model)),
        torch_nodes=nodes.Inventory.of(model).counts,
        checks=exported.checks,
        traced_shapes=call.shapes(),
    )


def _embedding_padding(state: ModuleState, state_names: dict[str, str]) -> dict[str, int]:
    """Graph input name of each nn.Embedding weight with a padding_idx -> that index."""
    by_qualified = {q: g for g, q in state_names.items()}
    found: dict[str, int] = {}
    for name, module in state.named_modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            weight = f"{name}.weight" if name else "weight"
            index = state.index.get(weight)
            if index is None:  # tied: find the tensor's first name
                matches = [
                    n for n, t in zip(state.names, state.tensors, strict=True) if t is module.weight
                ]
                if not matches:
                    continue
                weight = matches[0]
            graph_name = by_qualified.get(weight)
            if graph_name is not None:
                padding = module.padding_idx
                found[graph_name] = padding if padding >= 0 else padding + module.num_embeddings
    return found
