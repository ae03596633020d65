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


def ran_in_plain_ort(output: torch.Tensor) -> bool:
    """Whether a training output came out of the plain backend's autograd Function."""
    return type(output.grad_fn).__name__ == "GraphFunctionBackward"
