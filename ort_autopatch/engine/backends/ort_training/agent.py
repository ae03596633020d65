"""The training build's sessions: ORT's gradient builder over an exported graph (run in a
forked child, `sandbox`), a TrainingAgent over the gradient graph for training calls, and an
InferenceSession over the forward graph for calls that need no gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ort_autopatch.engine import heap, runtime, sandbox
from ort_autopatch.engine.errors import (
    GradientBuildError,
    RuntimeUnavailableError,
    SessionError,
    UnsupportedInputError,
)
from ort_autopatch.engine.session import (
    RunnableSession,
    SessionSettings,
    compute_stream,
    create,
    ort_device,
    ort_message,
    run_scope,
)


@dataclass
class InferenceProgram(RunnableSession):
    """Forward only: eval mode, or train mode with gradients off."""

    optimized: bytes | None = None  # ORT's optimised graph, when asked to capture it


def build_inference(
    model_bytes: bytes,
    device: torch.device,
    settings: SessionSettings,
    cls: str,
    optimized: bool = False,
    capture: bool = False,
) -> InferenceProgram:
    runtime.load(training=False)
    stream = compute_stream(device)
    session, captured = create(
        model_bytes, device, settings, cls, False, optimized, capture, stream
    )
    program = InferenceProgram.of(session, device, stream)  # the graph's outputs, in order
    program.optimized = captured
    return program


@dataclass
class GradientGraph:
    """A built gradient graph and what its agent needs to know: plain data, so the persistent
    cache can store it as ONNX bytes plus JSON."""

    model: bytes
    num_forward_outputs: int  # user outputs + extra (BatchNorm) outputs handed out by the YieldOp
    num_outputs: int  # user outputs
    non_differentiable: list[int]
    full_shape_grads: list[int]
    grad_of: dict[str, str]  # feed name -> its gradient's name


@dataclass
class TrainingProgram:
    """Forward and backward through a TrainingAgent over the gradient graph."""

    agent: Any
    session: Any  # kept alive with the agent, which borrows it
    feed_names: list[str]
    num_outputs: int
    non_differentiable: frozenset[int]
    full_shape_grads: frozenset[int]
    # for each feed, the index of its gradient among backward outputs, or -1
    grad_index: list[int]
    # feeds and user outputs whose buffers the backward pass reads (directly or through an
    # aliasing view): autograd checks their versions as it checks eager's saved tensors
    backward_reads_feeds: tuple[int, ...] = ()
    backward_reads_outputs: tuple[int, ...] = ()
    optimized: bytes | None = None  # ORT's optimised graph, when asked to capture it
    stream: Any = None  # the CUDA stream the session runs on (`compute_stream`), None on CPU
    # the graph has PythonOp nodes (whose contexts a forward collects); ATen nodes keep none
    python_nodes: bool = False
    #: what each forward and backward runs inside (`session.run_scope`)
    scope: contextlib.AbstractContextManager[Any] = heap.NO_SCOPE


def build_gradient(
    model_bytes: bytes,
    *,
    feed_names: Sequence[str],
    trainable: Sequence[str],
    inputs_requiring_grad: Sequence[str],
    user_inputs: Sequence[str],
    extra_outputs: Sequence[str],
    cls: str,
    propagate_casts: bool = True,
    meanwhile: Callable[[], None] | None = None,
    while_waiting: Callable[[], bool] | None = None,
) -> GradientGraph:
    """Differentiate the exported graph with ORT's OrtModuleGraphBuilder.

    `extra_outputs` are graph outputs (BatchNorm statistics) returned by forward after the user
    outputs but kept out of differentiation (the gradient passes, `passes.GRADIENT`, hand them
    out of the gradient graph). `propagate_casts` lets ORT move and merge Casts (ORTModule's
    default); a graph traced under autocast keeps its casts as traced.
    `meanwhile()`, then `while_waiting()` until the child answers, run in this process while
    the forked child builds (`sandbox.run`). ONNX
    Runtime is imported here first, so the child inherits it instead of importing it again.
    """
    import onnx

    model = onnx.load_from_string(model_bytes)
    _refuse_dtypes(model, cls)
    if extra_outputs:
        kept = [o for o in model.graph.output if o.name not in set(extra_outputs)]
        del model.graph.output[:]
        model.graph.output.extend(kept)
        model_bytes = model.SerializeToString()

    build = _Differentiation(
        model_bytes,
        [n for n in feed_names if n not in set(user_inputs)],
        [n for n in trainable if n not in set(user_inputs)],
        list(inputs_requiring_grad),
        propagate_casts,
    )

    remedy = (
        "An operator has no gradient in ONNX Runtime 1.19.2; run this class eagerly "
        "(the default fallback policy does) or exclude it"
    )
    try:
        # In a forked child: ORT's gradient builder aborts the process on some graphs
        # (`torch.diagonal`'s export: a failed libstdc++ assertion), which no fallback catches.
        runtime.load()  # raises RuntimeUnavailableError with its reason, before forking
        gradient_model, info = sandbox.run(build, meanwhile=meanwhile, while_waiting=while_waiting)
    except RuntimeUnavailableError:
        raise
    except sandbox.Crashed as exc:
        raise GradientBuildError(
            cls,
            f"ONNX Runtime's gradient builder crashed on this graph ({exc})",
            "Run this class eagerly (the default fallback policy does) and report the model",
        ) from None
    except sandbox.ChildError as exc:
        raise GradientBuildError(cls, f"no gradient graph ({ort_message(exc)})", remedy) from None
    except Exception as exc:
        raise GradientBuildError(cls, f"no gradient graph ({ort_message(exc)})", remedy) from exc
    num_forward_outputs = len(info.user_output_names) + len(info.frontier_node_arg_map)
    grad_of = dict(info.user_input_grad_names)
    grad_of.update(
        zip(info.initializer_names_to_train, info.initializer_grad_names_to_train, strict=True)
    )
    return GradientGraph(
        model=gradient_model,
        num_forward_outputs=num_forward_outputs,
        num_outputs=len(info.user_output_names),
        non_differentiable=list(info.output_grad_indices_non_differentiable),
        full_shape_grads=list(info.output_grad_indices_require_full_shape),
        grad_of=grad_of,
    )


@dataclass(frozen=True)
class _Differentiation:
    """One call of ORT's gradient builder, as plain data (run in a forked child)."""

    model_bytes: bytes
    initializer_names: list[str]
    initializer_names_to_train: list[str]
    input_names_require_grad: list[str]
    propagate_casts: bool

    def __call__(self) -> tuple[bytes, _GraphInfo]:
        _, capi = runtime.load()
        config = capi.OrtModuleGraphBuilderConfiguration()
        config.initializer_names = self.initializer_names
        config.initializer_names_to_train = self.initializer_names_to_train
        config.input_names_require_grad = self.input_names_require_grad
        config.build_gradient_graph = True
        config.enable_caching = False
        config.use_memory_efficient_gradient = False
        config.loglevel = capi.Severity.FATAL
        transformer = capi.TrainingGraphTransformerConfiguration()
        cast = capi.PropagateCastOpsConfiguration()
        cast.level = 1
        cast.strategy = capi.PropagateCastOpsStrategy.FLOOD_FILL
        if self.propagate_casts:
            transformer.propagate_cast_ops_config = cast
        transformer.enable_compute_optimizer = True
        builder = capi.OrtModuleGraphBuilder()
        builder.initialize(self.model_bytes, config)
        builder.build(transformer)
        return builder.get_gradient_model(), _GraphInfo.of(builder.get_graph_info())


@dataclass
class _GraphInfo:
    """The part of ORT's graph info the engine uses, as plain data (it crosses a pipe)."""

    user_output_names: list[str]
    frontier_node_arg_map: dict[str, str]
    user_input_grad_names: dict[str, str]
    initializer_names_to_train: list[str]
    initializer_grad_names_to_train: list[str]
    output_grad_indices_non_differentiable: list[int]
    output_grad_indices_require_full_shape: list[int]

    @classmethod
    def of(cls, info: Any) -> _GraphInfo:
        return cls(
            list(info.user_output_names),
            dict(info.frontier_node_arg_map),
            dict(info.user_input_grad_names),
            list(info.initializer_names_to_train),
            list(info.initializer_grad_names_to_train),
            list(info.output_grad_indices_non_differentiable),
            list(info.output_grad_indices_require_full_shape),
        )


#: ONNX element types ORT 1.19.2 has too few gradient kernels for: double (SplitTraining,
#: ReluGrad, ... fail at the first backward) and the complex types.
_UNTRAINABLE_TYPES = {11: "float64", 14: "complex64", 15: "complex128"}


def _refuse_dtypes(model: Any, cls: str) -> None:
    """Refuse, before any build, a training graph whose parameters, inputs or outputs have a
    dtype ORT cannot differentiate. Internal float64 scalars (transformers' attention scaling
    constants) and inputs only cast to float32 are fine."""
    found: dict[str, list[str]] = {}
    consumers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def cast_away(value: str) -> bool:
        """Only cast to a trainable type (a float32 model fed float64 inputs)."""
        return all(
            n.op_type == "Cast" and not any(a.i in _UNTRAINABLE_TYPES for a in n.attribute)
            for n in consumers.get(value, [])
        )

    inputs = [v for v in model.graph.input if not cast_away(v.name)]
    for value in [*inputs, *model.graph.output]:
        name = _UNTRAINABLE_TYPES.get(value.type.tensor_type.elem_type)
        if name is not None:
            found.setdefault(name, []).append(value.name)
    if found:
        raise untrainable(cls, found)


def untrainable(cls: str, found: dict[str, list[str]]) -> UnsupportedInputError:
    """The refusal of a training build with dtypes ORT cannot differentiate (`found`: dtype ->
    the names that have it), whether found in the exported graph or before exporting."""
    what = "; ".join(
        f"{dtype} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
        for dtype, names in found.items()
    )
    return UnsupportedInputError(
        cls,
        f"training with {what}: ONNX Runtime 1.19.2 lacks {'/'.join(found)} gradient "
        "kernels for common operators (Concat's SplitTraining, ReluGrad)",
        "Train in float32, or keep the default fallback policy (PyTorch runs this dtype)",
    )


@dataclass(frozen=True)
class GraphFacts:
    """What an agent needs to know of the graph it runs, read from its ONNX (`graph_facts`):
    plain data, so a process that loads a stored graph can be told it without parsing the
    graph (which needs `onnx`, about half a second to import)."""

    feeds: list[str]
    fetches: list[str]
    backward_reads_feeds: tuple[int, ...]
    backward_reads_outputs: tuple[int, ...]
    python_nodes: bool
    torch_nodes: dict[str, int]  # torch-calling nodes by label (`nodes.Inventory`)
    #: every PythonOp node is named by what it calls (`stored`): the facts hold in any process
    storable: bool = True

    def meta(self) -> dict[str, Any]:
        return {
            "feeds": self.feeds,
            "fetches": self.fetches,
            "backward_reads_feeds": list(self.backward_reads_feeds),
            "backward_reads_outputs": list(self.backward_reads_outputs),
            "python_nodes": self.python_nodes,
            "torch_nodes": self.torch_nodes,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> GraphFacts:
        return cls(
            feeds=[str(n) for n in meta["feeds"]],
            fetches=[str(n) for n in meta["fetches"]],
            backward_reads_feeds=tuple(int(k) for k in meta["backward_reads_feeds"]),
            backward_reads_outputs=tuple(int(k) for k in meta["backward_reads_outputs"]),
            python_nodes=bool(meta["python_nodes"]),
            torch_nodes={str(k): int(v) for k, v in dict(meta["torch_nodes"]).items()},
        )


def graph_facts(model: bytes, num_outputs: int) -> GraphFacts:
    """The facts of a gradient graph (or ORT's optimised form of it) whose YieldOp hands
    out `num_outputs` user outputs first."""
    import onnx

    from ort_autopatch.engine.backends.ort_training.torch_in_graph import nodes

    proto = onnx.load_from_string(model)
    feeds = [i.name for i in proto.graph.input]
    read = backward_reads(proto.graph)
    yielded = next((list(n.input) for n in proto.graph.node if n.op_type == "YieldOp"), [])
    return GraphFacts(
        feeds=feeds,
        fetches=[o.name for o in proto.graph.output],
        backward_reads_feeds=tuple(k for k, name in enumerate(feeds) if read(name)),
        backward_reads_outputs=tuple(
            k for k, name in enumerate(yielded[:num_outputs]) if read(name)
        ),
        python_nodes=any(n.op_type == "PythonOp" for n in proto.graph.node),
        torch_nodes=nodes.Inventory.of(proto).counts,
        storable=nodes.described_only(proto),
    )


def build_training(
    gradient: GradientGraph,
    device: torch.device,
    settings: SessionSettings,
    cls: str,
    optimized: bytes | None = None,
    capture: bool = False,
    facts: GraphFacts | None = None,
) -> TrainingProgram:
    """A session and a TrainingAgent over a gradient graph (or ORT's optimised form of it);
    `facts`: the graph's (`graph_facts`), when known without reading it."""
    _, capi = runtime.load()
    model = optimized or gradient.model
    if facts is None:
        facts = graph_facts(model, gradient.num_outputs)
    stream = compute_stream(device)
    session, captured = create(
        model, device, settings, cls, True, optimized is not None, capture, stream
    )
    fw_feeds = facts.feeds
    bw_fetches = facts.fetches
    dev = ort_device(device)
    try:
        agent = capi.TrainingAgent(
            session._sess,
            fw_feeds,
            [dev] * gradient.num_forward_outputs,
            bw_fetches,
            [dev] * len(bw_fetches),
            0,
        )
    except Exception as exc:
        raise SessionError(
            cls, f"TrainingAgent failed: {ort_message(exc)}", "Report the model"
        ) from exc
    position = {name: k for k, name in enumerate(bw_fetches)}
    grad_index = [position.get(gradient.grad_of.get(name, ""), -1) for name in fw_feeds]
    return TrainingProgram(
        agent=agent,
        session=session,
        feed_names=fw_feeds,
        num_outputs=gradient.num_outputs,
        non_differentiable=frozenset(gradient.non_differentiable),
        full_shape_grads=frozenset(gradient.full_shape_grads),
        grad_index=grad_index,
        backward_reads_feeds=facts.backward_reads_feeds,
        backward_reads_outputs=facts.backward_reads_outputs,
        optimized=captured,
        stream=stream,
        python_nodes=facts.python_nodes,
        scope=run_scope(session),
    )


#: Operators whose output ONNX Runtime's CPU kernels may place in their input's buffer.
_ALIASING_OPS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def backward_reads(graph: Any) -> Callable[[str], bool]:
    """Whether the backward half of a gradient graph reads a value's buffer.

    The forward half is every node the `YieldOp` depends on; every other node runs in
    backward. A value counts as read when it, or a value sharing its buffer through an
    aliasing operator, is an input of a backward node.
    """
    from ort_autopatch.engine.backends.ort_training.graph import node_reads

    nodes = list(graph.node)
    producer = {out: k for k, node in enumerate(nodes) for out in node.output}
    yield_at = next((k for k, n in enumerate(nodes) if n.op_type == "YieldOp"), None)
    if yield_at is None:
        return lambda name: False
    forward: set[int] = set()
    pending = list(nodes[yield_at].input)
    while pending:
        k = producer.get(pending.pop(), -1)
        if k >= 0 and k not in forward:
            forward.add(k)
            pending.extend(node_reads(nodes[k]))
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    for node in nodes:
        if node.op_type in _ALIASING_OPS and node.input and node.output:
            parent[root(node.output[0])] = root(node.input[0])
    read = {
        root(name)
        for k, node in enumerate(nodes)
        if k != yield_at and k not in forward
        for name in node_reads(node)
    }
    return lambda name: root(name) in read
