"""Turning an exported graph into something ONNX Runtime can run: a gradient graph and a
TrainingAgent for training calls, a plain InferenceSession for calls that need no gradients."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ort_autopatch.engine import runtime
from ort_autopatch.engine.errors import (
    GradientBuildError,
    SessionError,
    UnsupportedDeviceError,
)


@dataclass(frozen=True)
class SessionSettings:
    """How sessions are created; threads None means torch.get_num_threads()."""

    threads: int | None = None
    spinning: bool = False


def _session_options(settings: SessionSettings, training: bool) -> Any:
    ort, _ = runtime.load()
    options = ort.SessionOptions()
    if training:
        # Forward outputs handed to PyTorch live in ORT's buffers; with memory reuse on, the
        # backward pass would overwrite a loss or logits the user still holds.
        options.enable_mem_pattern = False
        options.enable_mem_reuse = False
    options.use_deterministic_compute = torch.are_deterministic_algorithms_enabled()
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.intra_op_num_threads = settings.threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    spin = "1" if settings.spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    return options


def _providers(device: torch.device) -> list[Any]:
    ort, _ = runtime.load()
    available = ort.get_available_providers()
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in available:
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    raise UnsupportedDeviceError(
        "ort_autopatch",
        f"tensors on {device} but this onnxruntime build offers only {', '.join(available)}",
        "Install onnxruntime-training (the CUDA build) for GPU tensors, or run on CPU",
    )


def ort_device(device: torch.device) -> Any:
    _, capi = runtime.load()
    kind = capi.OrtDevice.cuda() if device.type == "cuda" else capi.OrtDevice.cpu()
    return capi.OrtDevice(kind, capi.OrtDevice.default_memory(), device.index or 0)


def _session(
    model_bytes: bytes, device: torch.device, settings: SessionSettings, cls: str, training: bool
) -> Any:
    ort, _ = runtime.load()
    providers = _providers(device)
    try:
        return ort.InferenceSession(model_bytes, _session_options(settings, training), providers)
    except Exception as exc:
        raise SessionError(
            cls,
            f"ONNX Runtime rejected the graph: {str(exc).strip().splitlines()[0][:300]}",
            "Run this class eagerly (the default fallback policy does) and report the model",
        ) from exc


@dataclass
class InferenceProgram:
    """Forward only: eval mode, or train mode with gradients off."""

    session: Any
    feed_names: list[str]
    fetch_names: list[str]
    fetch_devices: list[Any]
    run_options: Any = field(default=None)


def build_inference(
    model_bytes: bytes, device: torch.device, settings: SessionSettings, cls: str
) -> InferenceProgram:
    import onnx

    _, capi = runtime.load()
    graph = onnx.load_from_string(model_bytes).graph
    session = _session(model_bytes, device, settings, cls, training=False)
    feeds = [i.name for i in session.get_inputs()]
    fetches = [o.name for o in graph.output]
    return InferenceProgram(
        session=session,
        feed_names=feeds,
        fetch_names=fetches,
        fetch_devices=[ort_device(device)] * len(fetches),
        run_options=capi.RunOptions(),
    )


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
    gradient_model: bytes


def build_training(
    model_bytes: bytes,
    *,
    feed_names: Sequence[str],
    trainable: Sequence[str],
    inputs_requiring_grad: Sequence[str],
    user_inputs: Sequence[str],
    extra_outputs: Sequence[str],
    device: torch.device,
    settings: SessionSettings,
    cls: str,
) -> TrainingProgram:
    """Build the gradient graph and its agent.

    `extra_outputs` are graph outputs (BatchNorm statistics) returned by forward after the user
    outputs but kept out of differentiation.
    """
    import onnx

    from ort_autopatch.engine import graph as graph_passes

    _, capi = runtime.load()
    if extra_outputs:
        model = onnx.load_from_string(model_bytes)
        kept = [o for o in model.graph.output if o.name not in set(extra_outputs)]
        del model.graph.output[:]
        model.graph.output.extend(kept)
        model_bytes = model.SerializeToString()
    config = capi.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = [n for n in feed_names if n not in set(user_inputs)]
    config.initializer_names_to_train = [n for n in trainable if n not in set(user_inputs)]
    config.input_names_require_grad = list(inputs_requiring_grad)
    config.build_gradient_graph = True
    config.enable_caching = False
    config.use_memory_efficient_gradient = False
    config.loglevel = capi.Severity.FATAL
    transformer = capi.TrainingGraphTransformerConfiguration()
    cast = capi.PropagateCastOpsConfiguration()
    cast.level = 1
    cast.strategy = capi.PropagateCastOpsStrategy.FLOOD_FILL
    transformer.propagate_cast_ops_config = cast
    transformer.enable_compute_optimizer = True
    builder = capi.OrtModuleGraphBuilder()
    try:
        builder.initialize(model_bytes, config)
        builder.build(transformer)
    except Exception as exc:
        raise GradientBuildError(
            cls,
            f"no gradient graph: {_ort_message(exc)}",
            "An operator has no gradient in ONNX Runtime 1.19.2; run this class eagerly "
            "(the default fallback policy does) or exclude it",
        ) from exc
    info = builder.get_graph_info()
    gradient_model = builder.get_gradient_model()
    proto = onnx.load_from_string(gradient_model)
    num_outputs = len(info.user_output_names) + len(info.frontier_node_arg_map)
    if extra_outputs:
        num_outputs = graph_passes.yield_extra_outputs(proto, list(extra_outputs))
        gradient_model = proto.SerializeToString()
    session = _session(gradient_model, device, settings, cls, training=True)
    fw_feeds = [i.name for i in proto.graph.input]
    bw_fetches = [o.name for o in proto.graph.output]
    dev = ort_device(device)
    try:
        agent = capi.TrainingAgent(
            session._sess, fw_feeds, [dev] * num_outputs, bw_fetches, [dev] * len(bw_fetches), 0
        )
    except Exception as exc:
        raise SessionError(
            cls, f"TrainingAgent failed: {_ort_message(exc)}", "Report the model"
        ) from exc
    grad_of: dict[str, str] = dict(info.user_input_grad_names)
    grad_of.update(
        zip(info.initializer_names_to_train, info.initializer_grad_names_to_train, strict=True)
    )
    position = {name: k for k, name in enumerate(bw_fetches)}
    grad_index = [position.get(grad_of.get(name, ""), -1) for name in fw_feeds]
    return TrainingProgram(
        agent=agent,
        session=session,
        feed_names=fw_feeds,
        num_outputs=len(info.user_output_names),
        non_differentiable=frozenset(info.output_grad_indices_non_differentiable),
        full_shape_grads=frozenset(info.output_grad_indices_require_full_shape),
        grad_index=grad_index,
        gradient_model=gradient_model,
    )


def _ort_message(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]
