"""Running a module's call through the plain backend's pieces directly (capture, lowering,
sessions), for tests written before (and beside) the engine's own path."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from ort_autopatch.engine import session, signature
from ort_autopatch.engine.backend import RunHooks

PLAIN_READY = importlib.util.find_spec("onnxscript") is not None and (
    importlib.util.find_spec("onnxruntime") is not None
)
SKIP_REASON = (
    "the plain backend needs onnxscript beside onnxruntime (ort-autopatch[cpu]); "
    "nox -s tests_plain runs these tests"
)


class PlainCall:
    """One module's calls through one captured graph (per input shapes, as the backend)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *args: Any,
        table: dict[Any, Callable[..., Any]] | None = None,
    ) -> None:
        from ort_autopatch.engine.backends.ort import capture, decompositions, lowered, program

        self.module = module
        call = signature.flatten_call("M", args, {})
        self.captured = capture.capture(
            module,
            lambda m, *a, **k: m(*a, **k),
            call.spec(),
            call.tensors,
            "M",
            decompositions.table() if table is None else table,
        )
        self.lowered = lowered.lower(self.captured, "M")
        self.program = program.instantiate(
            self.lowered, RunHooks("M"), torch.device("cpu"), session.SessionSettings(threads=1)
        )

    def __call__(self, *args: Any) -> Any:
        call = signature.flatten_call("M", args, {})
        # a tied tensor is fed under each module's name for it
        named = dict(self.module.named_parameters(remove_duplicate=False))
        named.update(self.module.named_buffers(remove_duplicate=False))
        feeds = [
            call.tensors[int(f.where)] if f.kind == "input" else named[str(f.where)]
            for f in self.captured.feeds
        ]
        return self.captured.output_spec.rebuild(self.program.run(feeds))


def asked_gradients_equal(got: Any, expected: Any, asked: Any) -> None:
    """An operator's backward against autograd: each gradient asked for equals autograd's,
    each other one is empty (our backward operators return empty tensors for those)."""
    for wanted, a, e in zip(asked, got, expected, strict=True):
        if wanted:
            torch.testing.assert_close(a, e)
        else:
            assert a.numel() == 0


def ran_in_plain_ort(output: torch.Tensor) -> bool:
    """Whether a training output came out of the plain backend's autograd Function."""
    return type(output.grad_fn).__name__ == "GraphFunctionBackward"


def steps_like_eager(
    model: torch.nn.Module,
    eager: torch.nn.Module,
    plain: PlainCall,
    draw: Callable[[], torch.Tensor],
    grad_input: bool = True,
    **tolerance: float,
) -> None:
    """Three calls of `model` through `plain` (ORT) and of its copy `eager`, on inputs
    `draw()` makes, each followed by a backward of one weighted sum: outputs, the input's
    gradient (where `grad_input`), every parameter's gradient (None where eager's is) and
    every buffer equal eager's (within `tolerance`, `assert_close`'s). Each call must run in
    ORT. The last step's gradients are left in place."""
    for step in range(3):
        for p in [*model.parameters(), *eager.parameters()]:
            p.grad = None
        x = draw()
        ours = x.clone().requires_grad_(grad_input)
        theirs = x.clone().requires_grad_(grad_input)
        out, expected = plain(ours), eager(theirs)
        assert ran_in_plain_ort(out), f"step {step} did not run in ORT"
        torch.testing.assert_close(out, expected, **tolerance)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        if grad_input:
            torch.testing.assert_close(ours.grad, theirs.grad, **tolerance)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, q.grad, msg=name, **tolerance)
        for (name, b), e in zip(model.named_buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(b, e, msg=name, **tolerance)


def trains_like_eager(
    model: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype, grad_input: bool = True
) -> PlainCall:
    """`steps_like_eager` through a capture of `model`'s call at `shape` against a copy of
    `model`; the call, for its graphs."""
    import copy

    eager = copy.deepcopy(model)
    plain = PlainCall(model, torch.randn(shape, dtype=dtype, requires_grad=grad_input))
    assert plain.captured.backward is not None
    steps_like_eager(
        model, eager, plain, lambda: torch.randn(shape, dtype=dtype), grad_input=grad_input
    )
    return plain
