"""Branches on a random draw while aot_autograd traces a call on fake tensors.

transformers' LayerDrop (OPT, BART, Whisper, ...) decides in training whether to skip a layer
with `if torch.rand([]) < self.layerdrop:`. A fake tensor has no value, so the trace cannot
take that branch and the whole call used to fall back. The branch is decided here as the
training build's trace hazards decide it (`hazards._never_true`), by what the comparison
proves rather than by any draw:

- `torch.rand(...) < p` (or `rand_like`) with a Python number `p <= 0`: a uniform draw lies
  in [0, 1), so the comparison is False for every draw. The trace takes the branch eager
  always takes, and the graph is right for every call (LayerDrop at transformers' default 0).
- the same comparison with `p > 0`: eager skips layers at random, call by call, which no graph
  traced once can do. It is left to the trace, which stops at the read of a fake tensor's
  value: a VALUE hazard at the user's line (`plain.hazards`), and the class runs in PyTorch
  with eager's semantics exactly, as on the training build.

Any other conversion of a traced tensor to a Python value is left to the trace as well.
The draw itself stays out of the graphs: its value is read by nothing but the branch, so the
capture drops it with the comparison (`drop_unread_draws`, the pass `passes.JOINT` declares).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: torch functions that draw uniformly from [0, 1)
_UNIFORM = frozenset({torch.rand, torch.rand_like})
#: `draw < bound`, however written (`p > draw` reaches torch as `draw.__lt__(p)`)
_BELOW = frozenset({torch.Tensor.lt, torch.Tensor.__lt__, torch.lt, torch.less})
#: a tensor's value asked for as a Python bool (FunctionalTensor's `__bool__` asks `item()`)
_CONVERSIONS = frozenset({torch.Tensor.__bool__, torch.Tensor.item})


class _Comparisons(TorchFunctionMode):
    """Notes uniform draws and their comparisons below a number <= 0; answers the conversion
    of such a comparison to a Python value: False."""

    def __init__(self) -> None:
        super().__init__()
        # by id, holding the tensor for the trace's duration (so an id cannot be reused)
        self.draws: dict[int, torch.Tensor] = {}
        self.never: dict[int, torch.Tensor] = {}  # comparisons False for every draw
        self.decided = 0  # conversions answered

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _CONVERSIONS and args and id(args[0]) in self.never:
            self.decided += 1
            return False
        result = func(*args, **(kwargs or {}))
        if func in _UNIFORM and isinstance(result, torch.Tensor):
            self.draws[id(result)] = result
        elif (
            func in _BELOW
            and len(args) == 2
            and id(args[0]) in self.draws
            and isinstance(args[1], (int, float))
            and not isinstance(args[1], bool)
            and args[1] <= 0  # a draw from [0, 1) is never below it
            and isinstance(result, torch.Tensor)
        ):
            self.never[id(result)] = result
        return result


class Decisions:
    """What one trace decided: whether any branch on a draw was answered (the draw then
    stays unread in the graph). `deciding()` is entered around each run of the user's
    forward in the trace (torch function modes are per thread), not around the whole trace:
    aot's own machinery, its backward above all, calls torch functions in Python by the ten
    thousand, none of them a user's branch."""

    def __init__(self) -> None:
        self._mode = _Comparisons()

    @property
    def any(self) -> bool:
        return self._mode.decided > 0

    def deciding(self) -> contextlib.AbstractContextManager[Any]:
        """Decide branches on uniform draws, as above, while the block runs."""
        return self._mode


def drop_unread_draws(gm: torch.fx.GraphModule) -> bool:
    """Remove the draws whose value nothing reads (and what only they read). FX keeps them,
    as a draw advances a generator; in a graph the generator is ONNX Runtime's, never the
    user's, and a graph with a random operator could not be checked against eager."""
    changed = gm.graph.eliminate_dead_code(
        is_impure_node=lambda node: node.is_impure(impure_random=False)
    )
    if changed:
        gm.recompile()
    return changed
