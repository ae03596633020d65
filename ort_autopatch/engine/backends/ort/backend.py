"""The plain backend (`ort`: `onnxruntime`, the maintained inference-only package): forward
and backward graphs from torch's autograd, each run in an InferenceSession.

A build traces the call's joint forward + backward with aot_autograd and the backend's
decomposition table, partitions it, and lowers both graphs to ONNX (this package). A key's
first graph is traced for the call's input shapes; once a second shape comes, the dimensions
that varied are traced as symbols (`symbolic`), and the graph serves every size its guards
admit (`Recipe.size_guards`, the engine's `GuardedSizes` policy). A symbolic trace that fails
falls back to a graph for the call's shapes, and that key stays one graph per shape (when
forward fixed the sizes, its later graphs say where: `hazards` locates the trace's guards in
the user's code, the report's trace hazards). A trace stopped by forward reading tensor data
is refused as data-dependent control flow, with the place. Before a graph's numbers are
trusted, its first call (the call that built it) also runs eagerly and the two are compared
(`verifies_first_call`, the engine's `verify`): a mismatch is a `VerificationError`, and that
key's calls run in PyTorch with the reason. A graph loaded from the persistent cache passed
that check when it was built: loading it traces nothing, imports neither the exporter nor
onnx, and checks nothing. Buffer updates (BatchNorm's statistics) and dropout's seeds are the
program's own business (`program`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ort_autopatch.engine import autocast as amp
from ort_autopatch.engine import budget, random_ops, runtime, sandbox, session
from ort_autopatch.engine.backend import Backend, Progress, RunHooks
from ort_autopatch.engine.backends.ort import hazards as plain_hazards
from ort_autopatch.engine.errors import (
    AutocastUnsupportedError,
    DataDependentError,
    ExportError,
    RuntimeUnavailableError,
    UnsupportedInputError,
    UnsupportedModelError,
)
from ort_autopatch.engine.recipe import EngineOptions, Miss, Recipe
from ort_autopatch.engine.signature import FlatCall
from ort_autopatch.engine.sizes import SizeGuards

if TYPE_CHECKING:
    from ort_autopatch.engine.backends.ort.program import OrtProgram
    from ort_autopatch.engine.shape_policy import ShapePolicy

log = logging.getLogger("ort_autopatch")


@dataclass
class OrtPayload:
    """The plain backend's part of a recipe: both graphs and the maps between them."""

    lowered: Any  # lowered.Lowered
    #: read back from the persistent cache: checked against eager when it was built
    stored: bool = False

    def graphs(self) -> dict[str, bytes]:
        graphs: dict[str, bytes] = self.lowered.graphs()
        return graphs

    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = self.lowered.meta()
        return meta

    def restores_torch_nodes(self) -> bool:
        """Never: a cut graph's torch nodes are this process's callables."""
        return False


def _redraws(lowered: Any) -> bool:
    """Whether the lowered forward draws from random operators ORT seeds once per session."""
    random = lowered.random_operators
    if random is None:  # not recorded when it was lowered: read from the graph
        import onnx

        from ort_autopatch.engine import verify

        random = verify.random_ops(onnx.load_from_string(lowered.forward))
    return not random_ops.ONNX_PER_SESSION.isdisjoint(random)


def _on_cpu(miss: Miss) -> bool:
    """Whether every tensor of the call and of the module is a CPU tensor."""
    return all(t.device.type == "cpu" for t in (*miss.call.tensors, *miss.state.tensors))


def _first_names(miss: Miss) -> dict[str, str]:
    """Every name of a parameter or buffer -> the name the module's state holds it by (a tied
    weight is held once, by its first name)."""
    state = miss.state
    first = {id(tensor): name for name, tensor in zip(state.names, state.tensors, strict=True)}
    found = {}
    for prefix, module in miss.module.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) in first:
                    found[f"{prefix}.{name}" if prefix else name] = first[id(tensor)]
    return found


class OrtBackend(Backend):
    """Graphs from torch's autograd, run by the inference-only `onnxruntime`."""

    name: ClassVar[str] = "ort"
    #: the training build's: its opset (torchlib writes opset 18), its torch-calling nodes
    ignores: ClassVar[tuple[str, ...]] = ("opset", "torch_ops", "no_torch_ops", "compile_executor")
    #: a graph's numbers are trusted once its first call matched eager's (`verify`)
    verifies_first_call: ClassVar[bool] = True
    #: its builds (an aot_autograd trace, the exporter's lowering) cost seconds a short run
    #: would wait for: a child builds them while the calls run in PyTorch
    builds_aside: ClassVar[bool] = True

    @classmethod
    def prepare(cls, options: EngineOptions) -> None:
        """A lowering child forked now imports the exporter while the user's script sets
        up (`offload.prestart`): the process's first build then finds it ready."""
        from ort_autopatch.engine.backends.ort import offload

        offload.prestart()

    @staticmethod
    def graph_version() -> str:
        """The plain backend's own sources and the exporter's op library decide its graphs."""
        return _graph_version()

    @staticmethod
    def payload_from(meta: dict[str, Any], graphs: dict[str, bytes]) -> OrtPayload:
        """No `onnx.checker` pass (nor an onnx import: about 1 s): the store hands back only
        bytes whose checksums it wrote, and it wrote only graphs that ONNX Runtime had
        already loaded and run, and that the first-call check had accepted."""
        from ort_autopatch.engine.backends.ort import lowered

        return OrtPayload(lowered.Lowered.from_stored(meta, graphs), stored=True)

    def random_operators(self, recipe: Recipe) -> list[str] | None:
        """Read when the graph was lowered (None for a stored graph: `verify` reads it)."""
        payload = recipe.payload
        assert isinstance(payload, OrtPayload), f"a {recipe.backend} recipe"
        random: list[str] | None = payload.lowered.random_operators
        return random

    def shape_policy(self) -> ShapePolicy:
        """Each graph says which sizes it serves (`Recipe.size_guards`)."""
        from ort_autopatch.engine.shape_policy import GuardedSizes

        return GuardedSizes(self.options.static_after)

    def refuse(self, call: FlatCall) -> None:
        """A training call under a functorch transform (vmap, grad) is refused: torch's
        autograd cannot trace through the transform's wrapped tensors, and a graph built
        outside it would be refused by `Function.apply` in the user's run. PyTorch runs it
        (the default fallback policy), transform and all."""
        if torch._C._are_functorch_transforms_active():
            raise UnsupportedInputError(
                self.module_class,
                "the call runs under a functorch transform (torch.func.vmap, grad, ...), "
                "which the plain backend's graphs cannot take part in",
                "Keep the default fallback policy (PyTorch runs these calls)",
            )

    def build(self, miss: Miss, progress: Progress) -> tuple[Recipe, float]:
        reason = runtime.plain_build_missing()
        if reason is not None:
            raise RuntimeUnavailableError(self.module_class, reason, "Run the model eagerly")
        start = time.perf_counter()
        cls = self.module_class
        call = miss.call
        built = None
        if miss.dynamic is not None:
            runtime.load(training=False)
            built = self._symbolic(miss, progress)
        if built is None:
            built = self._exact(miss, progress)
        captured, lowered, guards = built
        if amp.lowers_on_cpu(miss.autocast):
            import onnx

            cut = lowered.splits.get("forward")
            models = [s.model for s in cut.segments] if cut is not None else [lowered.forward]
            for model in models:
                refusal = amp.cpu_refusal(onnx.load_from_string(model), miss.autocast)
                if refusal is not None:  # ORT would round otherwise than autocast: a known limit
                    raise AutocastUnsupportedError(cls, refusal, amp.REMEDY)
        names = [n.name for n in captured.forward.graph.nodes if n.op == "placeholder"]
        sources: dict[str, tuple[str, Any]] = {}
        first_names = _first_names(miss)
        for name, feed in zip(names, captured.feeds, strict=True):
            if feed.kind == "input":
                sources[name] = ("input", int(feed.where))
            elif feed.where in miss.state.index:
                sources[name] = ("state", str(feed.where))
            elif str(feed.where) in first_names:  # tied: aot may name it by another name
                sources[name] = ("state", first_names[str(feed.where)])
            else:
                raise UnsupportedModelError(
                    cls,
                    f"the graph reads {feed.where!r}, which is not among the module's tensors",
                    "Report the model; run it eagerly meanwhile",
                )
        recipe = Recipe(
            backend=self.name,
            has_backward=captured.backward is not None,
            forward_model=lowered.forward,
            payload=OrtPayload(lowered),
            feed_sources=sources,
            num_user_outputs=captured.num_user_outputs,
            output_spec=captured.output_spec,
            batch_norms=[],
            seeds_dropout=False,
            redraws=_redraws(lowered),
            traced_shapes=call.shapes(),
            size_guards=guards,
            # nodes run in torch between ORT segments: named in the report, never stored
            torch_nodes=lowered.torch_nodes,
        )
        return recipe, time.perf_counter() - start

    def _exact(self, miss: Miss, progress: Progress) -> tuple[Any, Any, SizeGuards]:
        """The call traced for its shapes and lowered. A child forked first imports the
        exporter and lowers the graphs (`offload`) while this process imports
        aot_autograd and traces, from the operators torchlib is expected to translate; once
        the child has named them, a trace made (or failed) from another table is made again.
        Without a child (no fork, the exporter imported here already, a graph the child
        cannot take, a failed child) the graphs are lowered here."""
        from ort_autopatch.engine.backends.ort import (
            capture,
            decompositions,
            lowered,
            lowering,
            offload,
        )

        call, cls = miss.call, self.module_class
        count = None
        # (a forked child must not touch CUDA, nor join a collective)
        if budget.counts() and _on_cpu(miss) and not sandbox.collective_possible():
            spec = call.spec()
            count = functools.partial(
                capture.count_operators, miss.module, self.forward, spec, call.tensors
            )

        def anyway() -> None:  # what this build needs, made in the fork decision's window
            runtime.load(training=False)
            decompositions.table(offload.Lowerer.expected())

        # what a child forked now shares with this process, and what the training step
        # writes: the module's tensors (their pages are let go of after the count run)
        module = miss.module
        params = list(module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        shared = [*params, *grads, *module.buffers(), *call.tensors]
        lowerer = offload.Lowerer.start(count, anyway, shared)
        if lowerer is not None:  # the child's core idles once its imports are done
            progress.core_free()
        counted = lowerer.verdict(cls) if lowerer is not None and lowerer.counts else None
        graphs = None
        try:
            runtime.load(training=False)
            if lowerer is None:
                captured = self._trace(miss, progress, decompositions.table())
            else:
                capture.load_tracer()  # while the child imports torchlib
                expected = lowerer.expected()
                failed: Exception | None = None
                try:
                    table = decompositions.table(expected)
                    captured = self._trace(miss, progress, table, counted)
                except Exception as exc:  # maybe the table's doing: decided once it is known
                    failed = exc
                else:
                    progress.phase = "lowering to ONNX"
                    # (`meanwhile`: what `alike` reads, made while the child is busy)
                    graphs = lowerer.lower(
                        captured.forward, captured.backward, cls, decompositions.decomposable
                    )
                named = lowerer.implemented() or lowering.implemented()
                if not decompositions.alike(expected, named):
                    log.debug(
                        "%s: torchlib translates other operators than read; traced again", cls
                    )
                    captured = self._trace(miss, progress, decompositions.table(named), counted)
                    progress.phase = "lowering to ONNX"
                    graphs = lowerer.lower(captured.forward, captured.backward, cls)
                elif failed is not None:
                    raise failed
        finally:
            if lowerer is not None:
                lowerer.release()  # kept for the process's next build
        return captured, lowered.lower(captured, cls, graphs), SizeGuards(call.shapes())

    def _trace(
        self,
        miss: Miss,
        progress: Progress,
        table: dict[Any, Any],
        counted: Callable[[bool], None] | None = None,
    ) -> Any:
        """`capture.capture` of the call for its shapes (`counted`: the verdict of the count
        run a child made); forward reading tensor data is refused as data-dependent
        (`_data_dependent`)."""
        from ort_autopatch.engine.backends.ort import capture

        call = miss.call
        progress.phase = "tracing forward and backward"
        try:
            return capture.capture(
                miss.module,
                self.forward,
                call.spec(),
                call.tensors,
                self.module_class,
                table,
                counted,
            )
        except ExportError as exc:
            data_dependent = self._data_dependent(exc)
            if data_dependent is None:
                raise
            raise data_dependent from exc

    def _symbolic(self, miss: Miss, progress: Progress) -> tuple[Any, Any, SizeGuards] | None:
        """The call traced with `miss.dynamic` as symbols, lowered, and its guards; None (and
        the build told: one graph per shape) when the trace fails or fixes every symbol."""
        from ort_autopatch.engine.backends.ort import (
            capture,
            decompositions,
            lowered,
            symbolic,
        )

        assert miss.dynamic is not None
        call, cls = miss.call, self.module_class
        cause = ""
        progress.phase = "tracing forward and backward with symbolic sizes"
        try:
            env, fakes = symbolic.fake_inputs(call.tensors, miss.dynamic)
            plain_hazards.locate_guards(env)
            captured = capture.capture(
                miss.module, self.forward, call.spec(), fakes, cls, decompositions.table()
            )
            found = plain_hazards.size_hazards(env)
            self.found(found)
            guards = symbolic.size_guards(env, fakes, call.shapes())
            if not guards.is_dynamic:
                if found:  # the model's code fixed them: its later graphs say where
                    cause = f"sizes change a traced value ({found[0].where})"
                raise ValueError("the trace fixed every symbolic size")
            progress.phase = "lowering to ONNX"
            made = lowered.lower(captured, cls)
        except Exception as exc:
            log.debug("%s: no graph with symbolic sizes (%s); one per shape", cls, exc)
            progress.specialises(cause)
            return None
        return captured, made, guards

    def _data_dependent(self, exc: ExportError) -> DataDependentError | None:
        """A trace stopped by forward reading tensor data: the hazard kept, and the refusal
        that names its place."""
        hazard = plain_hazards.value_hazard(exc)
        if hazard is None:
            return None
        self.found([hazard])
        return self.data_dependent([hazard])

    def instantiate(
        self,
        recipe: Recipe,
        miss: Miss,
        hooks: RunHooks,
        settings: session.SessionSettings,
        progress: Progress,
    ) -> OrtProgram:
        from ort_autopatch.engine.backends.ort import program

        payload = recipe.payload
        assert isinstance(payload, OrtPayload), f"a {recipe.backend} recipe"
        # its feeds are the forward graph's inputs in order (a stored recipe's feed_sources
        # may come back in another order)
        runnable = program.instantiate(
            payload.lowered, hooks, miss.device, settings, recipe.redraws
        )
        return runnable


#: shared engine modules whose code shapes this backend's graphs, besides its own package
_SHARED_SOURCES = ("tracing", "sizes", "calls", "passes")


@functools.cache
def _graph_version() -> str:
    """A digest of the files that make the plain backend's graphs and of the versions of the
    packages that translate them (read from metadata: nothing is imported)."""
    from importlib import metadata

    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    engine = package.parent.parent
    sources = [*sorted(package.glob("*.py")), *(engine / f"{n}.py" for n in _SHARED_SOURCES)]
    for path in sources:  # every file of the package: none can be forgotten
        digest.update(path.read_bytes())
    for name in ("onnxscript", "onnx-ir", "onnx"):
        try:
            digest.update(f"{name}={metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name}=none".encode())
    return digest.hexdigest()[:16]
