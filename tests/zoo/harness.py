"""Training one zoo entry eagerly and through the engine, side by side.

The eager reference runs attention on the kernel torch picks, as a user's run does (on CPU
the flash kernel, whose backward is not the softmax's on rows whose keys are all masked); on
the training build, on the math kernel (`_reference_attention`). The entry's class is
patched as a user's allowlist would (ort_autopatch.patcher.patch), and an identical copy
trains through it on the same batches, falling back to eager on an engine error under the
default policy; the eager reference calls torch.nn.Module.__call__, which the patch does not
reach. Losses, every output tensor (a DynamicCache's included), every gradient and every
buffer are compared step by step.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ort_autopatch import config, patcher, report
from ort_autopatch.engine import backend as backend_registry
from ort_autopatch.engine import objects
from tests.zoo.models import Batch, Entry

RTOL = 1e-4
STEPS = 5
LR = 0.1


@dataclass
class Result:
    """One entry's outcome, as written to benchmarks/results/zoo.json."""

    model: str
    status: str  # "ort", "fallback", "eager" or "mismatch"
    reason: str = ""
    steps: int = 0
    loss_rel: float = 0.0  # worst relative difference of the loss over the steps
    grad_rel: float = 0.0  # worst relative difference of any gradient, output or buffer
    worst: str = ""  # where grad_rel was found
    first_call_s: float = 0.0  # first patched forward: export, gradient build, sessions, run
    eager_step_ms: float | None = None
    ort_step_ms: float | None = None
    step_ratio: float | None = None
    builds: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def relative(
    actual: torch.Tensor | None, expected: torch.Tensor | None, floor: float = 0.0
) -> float:
    """max|a - e| / max(max|e|, floor); a missing gradient counts as zeros."""
    if expected is None and actual is None:
        return 0.0
    if expected is None:
        expected = torch.zeros_like(actual)  # type: ignore[arg-type]
    if actual is None:
        actual = torch.zeros_like(expected)
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        return float("inf")
    if not e.is_floating_point():
        return 0.0 if torch.equal(a, e) else float("inf")
    scale = max(e.abs().max().item() if e.numel() else 0.0, floor)
    diff = (a - e).abs().max().item() if e.numel() else 0.0
    if diff != diff:  # NaN
        return float("inf")
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor of a model output, the tensors inside objects (DynamicCache) included."""
    found = []
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        else:
            carried = objects.carrier_of(leaf)
            if carried is not None:
                found.extend(carried[1])
    return found


def _clone(batch: Batch) -> Batch:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _to(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class _Step:
    loss: torch.Tensor
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def _reference_attention() -> contextlib.AbstractContextManager[Any]:
    """Attention in the eager reference: torch's own kernel choice, except on the training
    build, which exports attention as matmuls and a softmax: its reference stays on torch's
    math kernel. Eager's CPU flash kernel's gradients differ from the softmax's on rows whose
    keys are all masked (OPT's entry, left padding at step 1: 0.9 relative), which that build
    does not reproduce yet (issue 35); the plain backend traces the kernel eager takes."""
    if backend_registry.resolve(config.load_config().backend) != "ort-training":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _train_step(
    call: Callable[..., Any],
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    loss_of: Callable[[Any, Batch], torch.Tensor],
) -> tuple[_Step, float]:
    """One step of `model` called through `call`; what it observed and the forward's seconds."""
    opt.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = call(**_clone(batch))
    forward_s = time.perf_counter() - start
    loss = loss_of(out, batch)
    loss.backward()
    step = _Step(
        loss.detach().clone(),
        [t.detach().clone() for t in output_tensors(out)],
        {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        {n: b.detach().clone() for n, b in model.named_buffers()},
    )
    opt.step()
    return step, forward_s


def _timed_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    loss_of: Callable[[Any, Batch], torch.Tensor],
) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss_of(model(**batch), batch).backward()
    opt.step()
    return time.perf_counter() - start


def run(entry: Entry, steps: int = STEPS, timing_steps: int = 0, device: str = "cpu") -> Result:
    """Train `entry` eagerly and through the engine for `steps` steps on `device`; time
    `timing_steps` more of each."""
    torch.manual_seed(0)
    model = entry.build().train().to(device)
    eager_model, ort_model = copy.deepcopy(model), copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [_to(entry.batch(k, gen), torch.device(device)) for k in range(steps)]
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=LR)
    ort_opt = torch.optim.SGD(ort_model.parameters(), lr=LR)

    eager = _Eager(eager_model)
    with _reference_attention():
        expected = [_train_step(eager, eager_model, eager_opt, b, entry.loss)[0] for b in batches]

    result = Result(entry.name, "ort", steps=steps)
    cls = type(ort_model)
    newly_patched = patcher.patch(cls)
    report.reset()
    try:
        for k, batch in enumerate(batches):
            actual, forward_s = _train_step(ort_model, ort_model, ort_opt, batch, entry.loss)
            if k == 0:
                result.first_call_s = round(forward_s, 3)
            _compare(result, k, actual, expected[k])
        stats = report.stats_for(patcher.class_name(cls))
        failure = next(iter(stats.fallbacks), None)
        if timing_steps and failure is None:
            _time(result, eager, ort_model, batches[0], entry, timing_steps)
        result.builds = stats.exports
    finally:
        if newly_patched:
            patcher.unpatch(cls)
    # A first call that set state once (transformers' loss sets `config.problem_type`) runs in
    # PyTorch by design; every later call must reach ORT.
    setup = stats.eager_calls.get("forward changed state: traced again next call", 0)
    if failure is not None:
        result.status = "fallback"
        result.reason = f"{failure[0]}: {failure[1]}"
    elif stats.ort_calls < steps - min(setup, 1):
        result.status = "eager"
        result.reason = ", ".join(stats.eager_calls) or "calls did not reach ONNX Runtime"
    elif max(result.loss_rel, result.grad_rel) > RTOL:
        result.status = "mismatch"
        result.reason = f"{result.worst}: relative difference {result.grad_rel:.2e}"
    elif setup:
        result.reason = "first call in PyTorch: forward set state once"
    return result


class _Eager(torch.nn.Module):
    """The eager reference: torch.nn.Module.__call__, which a patched class's __call__ does
    not reach, so reference and accelerated copies can share one (patched) class."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: Any) -> Any:
        return torch.nn.Module.__call__(self.model, **batch)


def _compare(result: Result, step: int, actual: _Step, expected: _Step) -> None:
    def note(value: float, where: str) -> None:
        if value > result.grad_rel:
            result.grad_rel, result.worst = value, f"step {step} {where}"

    result.loss_rel = max(result.loss_rel, relative(actual.loss, expected.loss))
    if len(actual.outputs) != len(expected.outputs):
        note(float("inf"), "number of output tensors")
    for k, (a, e) in enumerate(zip(actual.outputs, expected.outputs, strict=False)):
        note(relative(a, e), f"output tensor {k}")
    # Gradients that are zero in exact arithmetic (a key projection's bias under softmax) hold
    # rounding noise on both sides: they are measured against the step's largest gradient.
    largest = max(
        (g.abs().max().item() for g in expected.grads.values() if g is not None and g.numel()),
        default=0.0,
    )
    for name, e_grad in expected.grads.items():
        note(relative(actual.grads.get(name), e_grad, 1e-3 * largest), f"grad of {name}")
    for name, e_buf in expected.buffers.items():
        note(relative(actual.buffers.get(name), e_buf), f"buffer {name}")


def _time(
    result: Result,
    eager_model: torch.nn.Module,
    runner: torch.nn.Module,
    batch: Batch,
    entry: Entry,
    steps: int,
) -> None:
    """Median step (forward, loss, backward, SGD) of each side, interleaved; eager uses
    torch's default SDPA backend, as a user's run would."""
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=1e-6)
    ort_opt = torch.optim.SGD(runner.parameters(), lr=1e-6)
    eager_s, ort_s = [], []
    for _ in range(steps):
        eager_s.append(_timed_step(eager_model, eager_opt, batch, entry.loss))
        ort_s.append(_timed_step(runner, ort_opt, batch, entry.loss))
    result.eager_step_ms = round(statistics.median(eager_s) * 1e3, 3)
    result.ort_step_ms = round(statistics.median(ort_s) * 1e3, 3)
    result.step_ratio = round(result.ort_step_ms / result.eager_step_ms, 3)
