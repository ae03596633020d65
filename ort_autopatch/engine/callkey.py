"""The call key: whether a cached graph fits a call, as one frozen structure of named guards.

A graph bakes in the gradient mode, every module's train flag, which parameters require grad,
the input signature (structure, dtypes, ranks, devices and constants; sizes stay dynamic), the
values of the attributes forward read (tensors by identity, version, shape, dtype and device)
and, for a model that specialises on sizes, the input shapes. A hit compares the whole key
(one hash); a miss asks `diff` which guard changed, which is the rebuild reason the report
shows; `persistent` is the part of the key the on-disk graph cache stores.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

#: The guards in the order a miss is explained: the first that differs names the reason.
GUARDS = ("training", "grad", "requires_grad", "inputs", "attributes", "shapes")


@dataclass(frozen=True)
class CallKey:
    """Everything a graph depends on besides the tensors it is fed."""

    grad: bool  # a training graph (forward + backward) or an inference graph
    training: bytes  # the train flag of the root and of every submodule, one byte each
    requires_grad: bytes  # which parameters require grad (training graphs only)
    inputs: Hashable  # the input signature; sizes are dynamic dimensions
    attributes: tuple[Hashable, ...]  # guard values of the attributes forward read
    shapes: tuple[tuple[int, ...], ...] | None = None  # per-shape graphs only

    @property
    def mode(self) -> tuple[bool, bytes]:
        """Gradient mode and train flags: a key's neighbours for explaining a miss."""
        return self.grad, self.training

    def diff(self, before: CallKey | None, labels: Sequence[str] = ()) -> str | None:
        """Why this key misses where `before` (the last key used) would not have: the exact
        rebuild reason, or None when the two are equal. `labels` name the attributes."""
        if before is None:
            return "first call"
        for name in GUARDS:
            if getattr(self, name) != getattr(before, name):
                return _REASONS[name](self, before, labels)
        return None

    def persistent(self) -> dict[str, Any]:
        """The part of the key the persistent graph cache hashes (the attribute values are
        stored by path beside it, so a graph loaded from disk still guards them)."""
        return {
            "grad": self.grad,
            "training": list(self.training),
            "requires_grad": list(self.requires_grad),
            "signature": repr(self.inputs),
            "shapes": None if self.shapes is None else [list(s) for s in self.shapes],
        }


def _attributes(new: CallKey, old: CallKey, labels: Sequence[str]) -> str:
    if len(new.attributes) != len(old.attributes) or len(labels) != len(new.attributes):
        return "attributes forward reads changed"
    changed = [
        label for label, a, b in zip(labels, new.attributes, old.attributes, strict=True) if a != b
    ]
    return f"attribute {', '.join(changed)} written"


_REASONS = {
    "training": lambda new, old, labels: "train/eval mode changed",
    "grad": lambda new, old, labels: "gradient mode changed",
    "requires_grad": lambda new, old, labels: "requires_grad changed",
    "inputs": lambda new, old, labels: "new input signature",
    "attributes": _attributes,
    "shapes": lambda new, old, labels: "new input shape",
}
