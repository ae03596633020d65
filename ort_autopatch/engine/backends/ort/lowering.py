"""FX graph to ONNX, with the exporter's own translator and without re-tracing.

`torch.onnx.export` would trace the graph again with torch.export and decompose it again
(2 to 6 s a graph); the graphs the capture produces are already ATen-level and decomposed
into what the exporter's op library (torchlib) translates, so each node goes straight through
the exporter's translator. An operator the library lacks is an `ExportError` naming it.

The exporter's registry (`ONNXRegistry.from_torchlib`) infers the ONNX signature of all ~500
torchlib functions (about 2 s in a fresh process); a graph has a few dozen operators, so this
module registers only those (`registry_for`), the same functions in the same order as the
full registry would hold them, and names what torchlib covers (`implemented`, which the
decomposition table needs) without inferring any signature. Importing torchlib at all costs a
fresh process about 0.6 s after torch (1.2 s with `ml_dtypes` 0.7.0), so `read_implemented` reads
the same names from torchlib's sources, for a trace that cannot wait for that import (its
answer is confirmed by `implemented` before a graph it decided is used: `offload`).

The exporter's type promotion (`promote_types`, or `to_onnx` itself) rewrites a graph, yet it
is no pass over the captured graph (`passes`): it is the exporter's own step of translating,
run where the translation runs (here or in the lowering child), and marked so it runs once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import operator
import re
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ort_autopatch.engine.calls import EXPORT_LOCK
from ort_autopatch.engine.errors import ExportError

OPSET = 18  # torchlib's own opset: its functions are written for it


@functools.cache
def _torchlib() -> tuple[dict[str, list[tuple[Any, bool]]], tuple[Any, ...]]:
    """onnxscript's torchlib functions by qualified ATen name ("aten::add.Tensor"; a default
    overload without its suffix), each with whether it takes complex inputs, and torch's own
    additions (`OnnxDecompMeta`s with their targets): what `from_torchlib` reads."""
    from onnxscript.function_libs.torch_lib import ops, registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    del ops  # imported for its registrations
    functions = {
        name: [(f, False) for f in overloaded.overloads] + [(f, True) for f in overloaded.complex]
        for name, overloaded in registration.default_registry.items()
        if not name.startswith("internal::")
    }
    return functions, _torchlib_registry.get_torchlib_ops()


def _name(target: Any) -> str | None:
    """torchlib's name of an FX target (None: a callable named by itself)."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target.name())
    return None


@functools.cache
def _callables() -> dict[Any, str]:
    """torchlib's Python-callable targets (`_operator::mul`, `math::ceil`) by callable."""
    from torch.onnx._internal.exporter import _registration

    functions, _ = _torchlib()
    found = {}
    for name in functions:
        if name.startswith(("_operator::", "math::")):
            target = _registration._get_overload(name)
            if target is not None:
                found[target] = name
    return found


@functools.cache
def implemented() -> frozenset[Any]:
    """The targets torchlib translates at `OPSET`: the keys of the full registry."""
    from torch.onnx._internal.exporter import _registration

    functions, own = _torchlib()
    found = {meta.fx_target for meta in own if meta.opset_introduced <= OPSET}
    # (without torchvision its operators do not exist; `_get_overload` would warn of each)
    vision = importlib.util.find_spec("torchvision") is not None
    for name in functions:
        if name.startswith("torchvision::") and not vision:
            continue
        target = _registration._get_overload(name)
        if target is not None:
            found.add(target)
    return frozenset(found)


#: a torchlib registration and its arguments: onnxscript's `@torch_op(names, ...)`, torch's
#: own `@onnx_impl(targets, ...)`
_REGISTRATION = re.compile(r"@(torch_op|onnx_impl)\(")
_QUALIFIED = re.compile(r"""["']([A-Za-z0-9_]+)::([A-Za-z0-9_]+)(?:\.([A-Za-z0-9_.]+))?["']""")
_OVERLOAD = re.compile(r"(?<![\w.])(?:torch\.ops\.)?(aten|prims)\.(\w+)\.(\w+)")
_PRIVATE = re.compile(r"\bprivate\s*=\s*True")
_INTRODUCED = re.compile(r"\bopset_introduced\s*=\s*(\d+)")


def _arguments(text: str, start: int) -> str:
    """The text up to the parenthesis closing the one opened just before `start`."""
    depth, end = 1, start
    while depth and end < len(text):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    return text[start : end - 1]


def _aten(namespace: str, name: str, overload: str | None) -> Any:
    """`namespace::name[.overload]` as torch's operator (as the exporter resolves it), or None."""
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        if overload is None:
            if "default" not in packet._overload_names and "" not in packet._overload_names:
                return None
            overload = "default"
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None


def _sources() -> list[Path]:
    """torchlib's operator modules (onnxscript's and torch's own), found without importing."""
    roots = [Path(torch.__file__).parent / "onnx" / "_internal" / "exporter" / "_torchlib"]
    spec = importlib.util.find_spec("onnxscript")
    if spec is not None and spec.submodule_search_locations:
        roots.append(Path(next(iter(spec.submodule_search_locations))) / "function_libs")
        roots[-1] /= "torch_lib"
    return [path for root in roots for path in sorted((root / "ops").glob("*.py"))]


@functools.cache
def read_implemented() -> frozenset[Any]:
    """The ATen and prims operators torchlib translates at `OPSET`, read from its sources
    (about 15 ms, no import) rather than from its registry (`implemented`): the registrations
    of public functions, torch's own up to `OPSET`. All the decomposition table reads of
    `implemented` (a test holds the two to one table); a registration these patterns misread
    (a torchlib rewritten) costs one more trace, never a wrong graph (`offload`)."""
    found: set[Any] = set()
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for match in _REGISTRATION.finditer(text):
            arguments = _arguments(text, match.end())
            if _PRIVATE.search(arguments):
                continue
            if match[1] == "torch_op":
                names = [
                    (namespace, name, overload or None)
                    for namespace, name, overload in _QUALIFIED.findall(arguments)
                    if namespace in ("aten", "prims")
                ]
            else:
                introduced = _INTRODUCED.search(arguments)
                if introduced is not None and int(introduced[1]) > OPSET:
                    continue
                names = _OVERLOAD.findall(arguments)
            found.update(_aten(*name) for name in names)
    found.discard(None)
    return frozenset(found)


def _floordiv(self: Any, other: Any) -> Any:
    """Python's floor division of sizes (`operator.floordiv` on symbolic ints): a - (a mod b)
    is a multiple of b, so dividing it is exact, and ONNX's Mod (fmod=0) takes the divisor's
    sign as Python's %. torchlib's translation is ONNX's integer Div, which truncates toward
    zero: right for sizes that stay positive, but `-(-n // 2)` (a ceiling) came out one short
    for odd n, and the graph returned tensors of the wrong size."""
    from onnxscript import opset18 as op

    return op.Div(op.Sub(self, op.Mod(self, other)), other)


#: translations of ours for the exporter's own operators, preferred to torchlib's (custom)
OWN: dict[Any, Any] = {operator.floordiv: _floordiv}


def our_translations() -> dict[Any, Any]:
    """Our own operators and their ONNX translations, from the modules that define them:
    `recurrent`'s scans, `windows`' SpaceToDepth, `norms`' BatchNorm and LayerNorm,
    `convolutions`' backward, `linears`' linear, `matmuls`' batched product and
    `activations`' ReLU and LeakyReLU gradients."""
    from ort_autopatch.engine.backends.ort import (
        activations,
        convolutions,
        linears,
        losses,
        matmuls,
        norms,
        recurrent,
        windows,
    )

    return {
        **activations.TRANSLATIONS,
        **linears.TRANSLATIONS,
        **losses.TRANSLATIONS,
        **matmuls.TRANSLATIONS,
        **recurrent.TRANSLATIONS,
        **windows.TRANSLATIONS,
        **norms.TRANSLATIONS,
        **convolutions.TRANSLATIONS,
    }


_lock = threading.Lock()
_registry: list[Any] = []  # the one partial registry of this process
_registered: set[Any] = set()  # the targets it has been given (with or without functions)


def registry_for(targets: Iterable[Any]) -> Any:
    """The exporter's registry with (at least) `targets` registered, as `from_torchlib` would
    register them: torch's own functions first, then onnxscript's, the highest opset up to
    `OPSET` kept. Grows as graphs bring new operators."""
    from torch.onnx._internal.exporter import _registration

    with _lock:
        translations = our_translations()
        if not _registry:
            _registry.append(_registration.ONNXRegistry())
            _registry[0]._opset_version = OPSET
        registry = _registry[0]
        functions, own = _torchlib()
        callables = _callables()
        for target in set(targets) - _registered:
            _registered.add(target)
            metas = [meta for meta in own if meta.fx_target == target]
            ours = translations.get(target) or OWN.get(target)
            if ours is not None:  # a Python function adding its nodes: no signature
                metas.append(
                    _registration.OnnxDecompMeta(
                        onnx_function=ours,
                        fx_target=target,
                        signature=None,
                        is_custom=True,
                        skip_signature_inference=True,
                    )
                )
            name = _name(target) or callables.get(target)
            for function, is_complex in functions.get(name, []) if name else []:
                metas.append(
                    _registration.OnnxDecompMeta(
                        onnx_function=function,
                        fx_target=target,
                        signature=None,
                        is_custom=False,
                        is_complex=is_complex,
                    )
                )
            metas = [meta for meta in metas if meta.opset_introduced <= OPSET]
            if metas:
                highest = max(meta.opset_introduced for meta in metas)
                for meta in metas:
                    if meta.opset_introduced == highest:
                        registry._register(target, meta)
        return registry


def _targets(gm: torch.fx.GraphModule) -> set[Any]:
    """The graph's call targets; `operator.getitem` among them, which the translator looks up
    for an item of a list output (`split`'s, in an LSTM or GRU)."""
    return {node.target for node in gm.graph.nodes if node.op == "call_function"}


def missing_targets(gm: torch.fx.GraphModule) -> set[Any]:
    """The graph's call targets the exporter has no translation for."""
    targets = _targets(gm)
    found = registry_for(targets)
    return {target for target in targets if not found.is_registered(target)}


def missing_operators(gm: torch.fx.GraphModule) -> list[str]:
    """Operators of the graph the exporter has no translation for."""
    return sorted(str(target) for target in missing_targets(gm))


@contextlib.contextmanager
def _without_node_metadata() -> Iterator[None]:
    """The translator's metadata of each node left out (`_core._set_node_metadata`: the FX
    node printed, its stack trace, its module path and classes), within the block.

    Nothing reads them (ONNX Runtime neither), and they were most of a graph's bytes: 838 of
    ResNet-50's forward's 1078 kB, 1040 of its backward's 2595 kB, formatted per node, then
    serialised, sent from the lowering child, parsed by ONNX Runtime and stored on disk."""
    from torch.onnx._internal.exporter import _core

    written = _core.__dict__.get("_set_node_metadata")
    if written is None:  # a torch that writes them otherwise: written, as it writes them
        yield
        return
    _core._set_node_metadata = lambda fx_node, ir_node: None
    try:
        yield
    finally:
        _core._set_node_metadata = written


@contextlib.contextmanager
def _number_lists_typed_first() -> Iterator[None]:
    """onnx_ir's type of an attribute given as a list of ints or of floats (axes, perms,
    pads, shapes: most of a graph's attributes) found first, within the block.

    onnx_ir asks whether the value is a graph, a tensor or a type, each a runtime-checkable
    Protocol (a walk over the protocol's members per check), before it asks whether it is a
    sequence: 12 % of the translation of ResNet-50's backward. A list of Python ints or
    floats is none of those, so the answer is the one onnx_ir gives; every other value is
    asked as before."""
    from onnx_ir import _convenience as convenience
    from onnx_ir import _enums

    infer = convenience.__dict__.get("_infer_attribute_type")
    if infer is None:  # an onnx_ir that types attributes otherwise: typed as it types them
        yield
        return
    ints, floats = _enums.AttributeType.INTS, _enums.AttributeType.FLOATS

    def inferred(attr: Any) -> Any:
        if type(attr) in (list, tuple) and attr:
            if all(type(x) is int for x in attr):
                return ints
            if all(type(x) is float for x in attr):
                return floats
        return infer(attr)

    convenience._infer_attribute_type = inferred
    try:
        yield
    finally:
        convenience._infer_attribute_type = infer


#: set in a graph's meta once `promote_types` has run on it (in place)
PROMOTED = "ort_autopatch_promoted"


def promote_types(gm: torch.fx.GraphModule) -> None:
    """The exporter's type-promotion pass (casts where ATen promotes implicitly), in place,
    as `to_onnx` runs it, but reading each node's value from the trace's fake value in its
    meta rather than running the node again on fake tensors (`_promoter`): only the nodes the
    pass changes run (0.4 of BERT-base's 0.5 s were the fake runs of nodes it left alone).
    It needs no more of the exporter than this pass (`offload` runs it before sending a
    graph). The graph is marked, so that `to_onnx` does not run it twice."""
    from torch.onnx._internal.fx.passes import type_promotion

    from ort_autopatch.engine.backends.ort.trace_context import real_constants_allowed

    promotion = type_promotion.InsertTypePromotion(gm)
    promotion.interpreter = _promoter()(gm, promotion.interpreter.type_promotion_table)
    with EXPORT_LOCK, real_constants_allowed():  # see `to_onnx`
        promotion.run()
    gm.meta[PROMOTED] = True


@functools.cache
def _promoter() -> type:
    """The exporter's type-promotion interpreter, with each node's value taken from its meta
    (`val`, the trace's fake value, which the translator reads too) where the pass leaves
    the node as it is. A node the pass changes, or one without a value (a placeholder, a
    constant), runs as in the exporter's pass."""
    from torch.onnx._internal.fx.passes import type_promotion

    class Promoter(type_promotion._TypePromotionInterpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op != "call_function" or "val" not in n.meta:
                return super().run_node(n)
            with self._set_current_node(n):
                rule = type_promotion.get_type_promotion_rule(n, self.type_promotion_table)
                if rule is not None:
                    before = (n.target, n.args, n.kwargs)
                    self._maybe_promote_node(n, rule)
                    if (n.target, n.args, n.kwargs) != before:
                        # rerun by the pass, whose value it kept (and put in the meta)
                        return self.env[n]
            return n.meta["val"]

    return Promoter


#: Each ONNX operator's signature, made once a process (`_signatures_reused`).
_signatures: dict[tuple[Any, str, str, int], Any] = {}


@contextlib.contextmanager
def _signatures_reused() -> Iterator[None]:
    """The translator's signatures of ONNX operators made once per operator and version.

    The exporter asks onnx_ir for an operator's signature (`OpSignature.from_op_schema`,
    which parses every type constraint of the schema) at each ONNX operator a torchlib
    function calls: 480 times for a TransformerEncoderLayer's two graphs, 208 of them for
    `Constant`, 29 % of its translation. Within the block the first one made per (domain,
    name, version) is kept and each call gets a copy: its own parameter lists and default
    attributes (which nodes take in as they are), the immutable parameters shared. The
    exporter's translation of the same graph gives the same bytes (a test holds them)."""
    import copy
    import dataclasses

    from onnx_ir import schemas

    made = schemas.OpSignature.__dict__["from_op_schema"]
    make = made.__func__

    def reused(kind: type, op_schema: Any) -> Any:
        key = (kind, op_schema.domain, op_schema.name, op_schema.since_version)
        signature = _signatures.get(key)
        if signature is None:
            signature = _signatures[key] = make(kind, op_schema)
        params = [
            dataclasses.replace(p, default=copy.copy(p.default))
            if isinstance(p, schemas.AttributeParameter) and p.default is not None
            else p
            for p in signature.params
        ]
        return dataclasses.replace(signature, params=params, outputs=list(signature.outputs))

    schemas.OpSignature.from_op_schema = classmethod(reused)  # type: ignore[assignment]
    try:
        yield
    finally:
        schemas.OpSignature.from_op_schema = made  # type: ignore[method-assign]


def warm_signatures() -> None:
    """Make the signature of each standard ONNX operator at `OPSET` now (the lowering child,
    waiting for its first graph, has the time): 0.04 s of a first translation otherwise."""
    import onnx
    from onnx_ir import schemas

    with _signatures_reused():
        for name in sorted({s.name for s in onnx.defs.get_all_schemas() if s.domain == ""}):
            try:
                schema = onnx.defs.get_schema(name, OPSET, "")
            except onnx.defs.SchemaError:  # introduced after OPSET
                continue
            if not schema.deprecated:
                schemas.OpSignature.from_op_schema(schema)


#: the ONNX model's metadata: the outputs returned unreshaped, with the shape each is to be
#: viewed as (JSON, by output name; `onnx_passes.reshapes_into_outputs_left_to_torch`)
VIEWED = "ort_autopatch_viewed_outputs"
#: ... and the outputs torch adds rows into, with their rows' and values' outputs
#: (`onnx_passes.accumulations_into_outputs_left_to_torch`)
ADDED = "ort_autopatch_added_rows"


def to_onnx(
    gm: torch.fx.GraphModule,
    cls: str,
    what: str,
    promoted: bool = False,
    finished_in_torch: bool = False,
) -> bytes:
    """The ONNX bytes of one graph: its placeholders are the inputs, its outputs (no None,
    none twice) the outputs, all named after their FX nodes. `promoted` (or the graph's
    `PROMOTED` mark): `promote_types` has run (the graph's values need not be fake tensors
    then: shapes and dtypes do). `finished_in_torch`: an output ORT would copy is left for
    torch to finish over its memory, as the model's metadata says: one made by a Reshape is
    its source (`VIEWED`), one made by adding rows is the tensor before (`ADDED`). For a
    graph whose every output the program reads: not a segment of a cut graph, whose torch
    nodes read them as they are."""
    import json

    import onnx_ir as ir
    from torch.onnx._internal.exporter import _constants, _core, _fx_passes, _ir_passes

    from ort_autopatch.engine.backends.ort import onnx_passes
    from ort_autopatch.engine.backends.ort.trace_context import real_constants_allowed

    missing = missing_operators(gm)
    if missing:
        raise ExportError(
            cls,
            f"the {what} graph has operators ONNX cannot express: {', '.join(missing)}",
            "Run this class eagerly (the default fallback policy does) and report the model",
        )
    model = ir.Model(
        graph=ir.Graph([], [], nodes=[], name=what),
        ir_version=_constants.ONNX_IR_VERSION,
        producer_name="ort_autopatch",
    )
    try:
        # Under the export lock, as every trace: the type-promotion pass sets torch.fx's
        # process-wide `preserve_node_meta` flag and puts back what it found, which ended
        # another thread's aot trace under way ("expected preserved node meta"), and the
        # blocks below rebind functions of the exporter; real constants pass, as type
        # promotion runs the graph on fakes.
        with (
            EXPORT_LOCK,
            real_constants_allowed(),
            _signatures_reused(),
            _without_node_metadata(),
            _number_lists_typed_first(),
        ):
            if not (promoted or gm.meta.get(PROMOTED)):
                _fx_passes.insert_type_promotion_nodes(gm)
            _core._translate_fx_graph(
                gm.graph,
                model,
                graph_like=model.graph,
                owned_graphs={},
                lower="at_conversion",
                registry=registry_for(_targets(gm)),
            )
    except Exception as exc:
        raise ExportError(
            cls,
            f"translating the {what} graph to ONNX failed: {_operator_of(exc)}",
            "Run this class eagerly (the default fallback policy does) and report the model",
        ) from exc
    try:  # a rewrite's failure is this graph's, not the user's run's
        onnx_passes.cleaned(model.graph)
        if finished_in_torch:
            added = onnx_passes.accumulations_into_outputs_left_to_torch(model.graph)
            if added:
                model.metadata_props[ADDED] = json.dumps(added)
            shapes = onnx_passes.reshapes_into_outputs_left_to_torch(model.graph)
            if shapes:
                model.metadata_props[VIEWED] = json.dumps(shapes)
    except Exception as exc:
        raise ExportError(
            cls,
            f"rewriting the {what} graph in ONNX failed: {type(exc).__name__}: {exc}"[:400],
            "Run this class eagerly (the default fallback policy does) and report the model",
        ) from exc
    _ir_passes.add_opset_imports(model)
    # a graph whose operators all folded away (casts to the type a value has) names no
    # opset, which ONNX Runtime refuses ("Missing opset in the model")
    model.opset_imports.setdefault("", OPSET)
    proto = ir.serde.serialize_model(model)
    return bytes(proto.SerializeToString())


def _operator_of(exc: BaseException) -> str:
    """The failing node's operator and the translator's reason, in one line."""
    text = str(exc)
    node = re.search(r"torch\.ops\.(aten\.\w+(?:\.\w+)?)", text)
    cause = exc.__cause__
    reason = f"{type(cause).__name__}: {cause}" if cause is not None else text
    reason = " ".join(reason.split())[:300]
    return f"{node[1]}: {reason}" if node else reason
