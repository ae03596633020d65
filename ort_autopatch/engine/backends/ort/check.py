"""The first call of every plain-backend graph is also run eagerly and compared.

The backend is young and its lowerings come from an exporter written for inference: one of
them (BatchNorm in training) was found silently wrong. So before a graph's numbers are
trusted, its first call runs through the graph and eagerly on copies of the inputs, and its
outputs and gradients are compared (`verify.verify_call`, the machinery of `--verify`: buffers
and every random generator are restored, no `.grad` is touched). A mismatch is a
`VerificationError` naming what differed; the caller then runs that key in PyTorch. Where
the strict comparison fails, eager's own spread on the call is measured and a difference
within a few times it accepted (`verify`'s docstring): regnet_y_400mf's BatchNorms over 4
images move eager's own gradients by 1 to 13 % under a one-rounding-step nudge, and its graph,
1.1 % away, is right; BatchNorm with training off is still refused, orders beyond the spread.

Graphs with random operators (dropout) draw from ONNX Runtime's generator and cannot equal
eager's numbers; they are reported as unchecked, with the operators named. So is a call whose
eager side fails (a forward that runs only while traced): the comparison cannot be made, and
the graph, which traced and ran, serves the call, as `--verify` treats the same failure.

A graph loaded from the persistent cache is not checked again (`backends.ort`): the store holds
only graphs that passed when they were built, under a key naming everything that decides them.
The check costs about one step of the graph and one eager step (plus the copies), and two
eager steps more where the strict comparison fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ort_autopatch.engine import verify
from ort_autopatch.engine.backends.ort.program import OrtProgram

log = logging.getLogger("ort_autopatch")


class _EagerFailed(Exception):
    """The eager side of the comparison raised (its exception is the cause)."""


def random_operators(program: OrtProgram) -> list[str]:
    if program.lowered.random_operators is not None:  # read when it was lowered
        return program.lowered.random_operators
    import onnx

    found = set(verify.random_ops(onnx.load_from_string(program.lowered.forward)))
    return sorted(found)


def first_call(
    cls: str,
    module: torch.nn.Module,
    program: OrtProgram,
    run_graph: Callable[[list[torch.Tensor]], Any],
    run_eager: Callable[[list[torch.Tensor]], Any],
    inputs: Sequence[torch.Tensor],
    grad: bool,
) -> verify.Verification:
    """Compare the graph with eager on this call (raises `verify.VerificationError`)."""
    random = random_operators(program)
    if random:
        return verify.Verification(unverified=f"random operators ({', '.join(random)})")
    trainable = [p for p in module.parameters() if p.requires_grad] if grad else []

    def eager(tensors: list[torch.Tensor]) -> Any:
        try:
            return run_eager(tensors)
        except Exception as exc:
            raise _EagerFailed() from exc

    try:
        return verify.verify_call(cls, module, run_graph, eager, inputs, trainable, grad)
    except _EagerFailed as failed:
        cause = failed.__cause__
        why = f"verification failed: {type(cause).__name__}: {cause}"
        log.warning("%s: the first call's check against eager could not be made (%s)", cls, why)
        return verify.Verification(unverified=why)
