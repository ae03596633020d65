"""`--verify N`: the user's own proof that a graph gives eager's numbers on their script.

The first N calls of each new graph key run twice more before the real call: once through the
graph and once eagerly, on copies of the inputs and the same parameters, each followed by a
backward with one fixed cotangent through `torch.autograd.grad` (so no `.grad` is touched).
Buffers (BatchNorm statistics) and every RNG are restored after each run, so the user's state
and random stream are exactly as without verification. Outputs and the gradients of every
trainable parameter and input are compared; a difference beyond the tolerance is a
`VerificationError`, which sends that key's calls to PyTorch with the reason.

Some models are more sensitive to rounding than any fixed tolerance allows: BatchNorm over a
few values amplifies it layer by layer (regnet_y_400mf's gradients differ by 8 % between eager
on 1 and 2 threads), and no graph, whose kernels round otherwise, can be held closer to eager
than eager is to itself. So only where the strict comparison fails, eager runs the call again,
up to twice, from inputs and parameters nudged by about one float32 rounding step (`NUDGE`) and
with every operator's result moved by about one rounding step (Monte Carlo arithmetic: another
runtime's kernels round every operator otherwise), and a tensor that differs by no more than
`SPREAD` times what eager itself moved is eager's own sensitivity, not the graph's error (the
second run only where the first's spread does not cover the graph: a spread only grows). A
wrong graph (BatchNorm with training off) differs by the size of the values, orders beyond any
rounding spread, and is still refused; an ordinary call never pays for the measurement.

The spread is an estimate, and it can fall short of eager's real float32 error: rounding that
errs the same way every time (a long accumulation) moves little under random nudges, and two
nudged runs are few. ResNet-50 at batch 2 in training was refused in one run of two with a
gradient 19 % off eager's where the spread said 4 %, while against the same call in float64
eager's gradient was 21 % off and the graph's 21 % too. So where a tensor still differs, the
call runs once more eagerly in float64 (`_float64_side`: parameters, buffers and inputs
promoted for the run, the user's tensors untouched) and the tensor matches when the graph is
no further from that reference than `REFERENCE_RATIO` times eager's own float32 error (or its
spread): on ResNet-50 the graph's error was at most 1.6 times eager's on any gradient.
A wrong graph is as far off the float64 values as off eager's and is still refused. The
reference costs one float64 run, only on such calls, and none for models past
`REFERENCE_BYTES`.

The plain backend's check of each graph's first call is this comparison too; its eager runs
(the plain one and the first seed's) may come from a child that made them from the same state
while the graph was traced (`Made`, `eager_child`), and are made here wherever it did not.

Graphs with random operators (dropout with p > 0, random fills) draw from ONNX Runtime's
generator, not PyTorch's: their numbers cannot equal eager's bit for bit, so such calls are
reported as not verified, with the operators named.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ort_autopatch.engine import calls, trees
from ort_autopatch.engine.errors import EngineError, FailureKind
from ort_autopatch.engine.random_ops import ONNX as RANDOM_ONNX_OPS

if TYPE_CHECKING:
    from ort_autopatch.engine.entry import Entry
    from ort_autopatch.engine.signature import FlatCall
    from ort_autopatch.engine.state import ModuleState

#: A difference is a mismatch beyond max|expected| * RTOL + ATOL, per tensor...
RTOL = 1e-4
ATOL = 1e-6
#: ...and beyond SPREAD times eager's own largest movement on that tensor from nudged runs
SPREAD = 4.0
#: the nudge: inputs and parameters times (1 + NUDGE * N(0, 1)), about one float32 rounding
#: step; one run per seed (a fixed generator: no RNG of the user's is drawn from)
NUDGE = 2e-7
NUDGE_SEEDS = (1, 2)
#: the float64 reference is skipped for modules whose floating-point parameters and buffers
#: would take more than this in float64 (the copy lives for one run)
REFERENCE_BYTES = 2**31
#: a graph's float32 error may be this many times eager's (both measured against float64)
REFERENCE_RATIO = 2.0


class VerificationError(EngineError):
    """A graph's numbers differ from eager PyTorch's on the user's own call."""

    kind = FailureKind.UNSUPPORTED_ONNX_MODEL
    reason = "verification mismatch"
    verification: Verification | None = None


@dataclass
class Verification:
    """One verified call (or one that could not be verified, with `unverified` saying why)."""

    output_diff: float = 0.0  # worst max|graph - eager| over outputs
    output_rel: float = 0.0  # the same relative to max|eager| of that tensor
    grad_diff: float = 0.0
    grad_rel: float = 0.0
    mismatch: str | None = None  # what differed beyond tolerance
    unverified: str | None = None
    #: eager's own largest relative movement under the nudges (outputs, and gradients above
    #: rounding noise), measured only when the strict comparison failed
    spread_rel: float | None = None
    #: eager's own largest relative float32 error against the call run in float64, measured
    #: only where a tensor still differed beyond the spread
    float64_rel: float | None = None


def random_ops(model: Any) -> list[str]:
    """Operators of an ONNX model that draw random numbers (dropout with a ratio of 0 does
    not), at the top level or inside its local functions and subgraphs."""
    from ort_autopatch.engine import random_ops as draws

    found = set()
    for body in draws.bodies(model):
        # a ratio is a constant of the same body (a function's names are its own)
        constants = {out: n for n in body if n.op_type == "Constant" for out in n.output}
        for node in body:
            if node.op_type not in RANDOM_ONNX_OPS:
                continue
            if node.op_type == "Dropout" and _zero_ratio(node, constants):
                continue
            found.add(node.op_type)
    return sorted(found)


def _zero_ratio(node: Any, constants: dict[str, Any]) -> bool:
    import onnx

    if len(node.input) < 2 or not node.input[1]:
        return True  # ratio defaults to 0.5 only when given; no ratio input: opset-7 style
    producer = constants.get(node.input[1])
    if producer is None:
        return False
    for attribute in producer.attribute:
        if attribute.name == "value":
            return bool((onnx.numpy_helper.to_array(attribute.t) == 0).all())
    return False


class _Saved:
    """Every buffer of the module and every RNG, restored after each verification run."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.torch_rng = torch.random.get_rng_state()
        self.cuda_rng = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        self.py_rng = random.getstate()
        np_random = sys.modules.get("numpy.random")
        self.np_rng = np_random.get_state() if np_random is not None else None

    def now(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The buffers' values as they are now (a run's updates), to be put back with
        `put`."""
        return [(b, b.detach().clone()) for b, _ in self.buffers]

    @staticmethod
    def put(values: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for buffer, value in values:
                if not torch.equal(buffer, value):
                    buffer.copy_(value)

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                # (a buffer promoted for the float64 reference is a copy: left as it is)
                if (
                    buffer.shape == saved.shape
                    and buffer.dtype == saved.dtype
                    and not torch.equal(buffer, saved)
                ):
                    buffer.copy_(saved)
        torch.random.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        np_random = sys.modules.get("numpy.random")
        if np_random is not None and self.np_rng is not None:
            np_random.set_state(self.np_rng)


@contextlib.contextmanager
def _hooks_silenced(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The tensors' own gradient hooks (`Tensor.register_hook`) off: the runs here take
    gradients of the parameters themselves, and the user's hooks (gradient clipping,
    logging, counting) must see only the user's backward. Autograd reads each hook dict
    when it fires, so emptying it and refilling it (in order, same keys: handles still
    remove) is enough."""
    emptied: list[tuple[dict[int, Any], list[tuple[int, Any]]]] = []
    for tensor in tensors:
        hooks = tensor._backward_hooks
        if hooks:
            emptied.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in emptied:
            hooks.update(items)


def _copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _float_leaves(output: Any) -> list[torch.Tensor]:
    # trees.flatten: the tensors inside dataclasses (the user's, and the patcher's Replay of
    # attribute writes) are compared too; pytree would see one opaque leaf
    return [
        t
        for t in trees.flatten(output)[0]
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]


class _Measured:
    """Each tensor's largest magnitude and each pair's distance, measured once per check:
    a strict comparison that fails is made again within eager's spread, and maybe against
    the float64 reference, over the same tensors (ResNet-50's 25 M gradients: 0.05 s a
    comparison). Each measured tensor is held, so that its id names it."""

    def __init__(self) -> None:
        self._largest: dict[int, tuple[torch.Tensor, float]] = {}
        self._distance: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, float]] = {}

    def largest(self, tensor: torch.Tensor) -> float:
        known = self._largest.get(id(tensor))
        if known is None or known[0] is not tensor:
            known = self._largest[id(tensor)] = (tensor, _largest(tensor))
        return known[1]

    def distance(self, actual: torch.Tensor, exact: torch.Tensor) -> float:
        key = (id(actual), id(exact))
        known = self._distance.get(key)
        if known is None or known[0] is not actual or known[1] is not exact:
            known = self._distance[key] = (actual, exact, _distance(actual, exact))
        return known[2]


def _difference(
    actual: torch.Tensor,
    expected: torch.Tensor,
    zero: float = 0.0,
    scale: float | None = None,
    measured: _Measured | None = None,
) -> tuple[float, float, bool]:
    """(max abs difference, relative to max|expected| (`scale`, if measured already), beyond
    tolerance?); two tensors that both stay within `zero` match (see `_rounding_zero`)."""
    if actual.shape != expected.shape:
        return float("inf"), float("inf"), True
    if actual.numel() == 0:
        return 0.0, 0.0, False
    measured = measured or _Measured()
    diff = measured.distance(actual, expected)
    if scale is None:
        scale = measured.largest(expected)
    beyond = diff > scale * RTOL + ATOL and not max(scale, measured.largest(actual)) <= zero
    return diff, diff / scale if scale > 0 else diff, beyond


def _largest(tensor: torch.Tensor) -> float:
    """max|tensor| (0 for no elements, NaN where any element is), in one pass over it: the
    check measures the call's every gradient (BERT-base's: 110 M values) several times, and
    `abs().max()` writes a copy and reads it again (4.5 times as long here)."""
    value = tensor.detach()
    if value.numel() == 0:
        return 0.0
    if value.is_complex():
        return float(value.abs().max())
    low, high = (float(v) for v in torch.aminmax(value))
    return float("nan") if low != low or high != high else max(-low, high)


def _rounding_zero(largest: Iterable[float]) -> float:
    """The size below which a gradient of this call is zero up to rounding.

    A gradient that is zero in exact arithmetic comes out as rounding noise whose size
    follows the call's other gradients, not its own: a convolution's bias before BatchNorm
    (which cancels it) got 3e-6 from eager and 7e-6 from ORT beside weight gradients of 20,
    and a relative comparison of two noises fails. Such a pair matches when both lie within
    RTOL of the call's largest gradient; a gradient the graph makes any larger still does not.
    `largest`: each gradient's largest magnitude.
    """
    return max(largest, default=0.0) * RTOL


#: one run's float outputs and its gradients (of the trainable tensors, then of the inputs
#: that require grad)
Side = tuple[list[torch.Tensor], list[torch.Tensor | None]]


class Kept:
    """The graph's run of the call itself, kept as the call's result (`verify_call`'s
    `kept`): the check's graph side then runs on the call's own tensors rather than copies
    and keeps its autograd graph for the user's backward, so the call needs no second
    forward (BERT-base: 0.36 s of its first call). Made only where that run is exactly the
    call's: no input requires grad (its gradient would be taken, and its hooks fired, by the
    check), and the graph writes no input (inputs found written are put back, and nothing is
    kept). The check leaves the module's buffers as the call found them: `take` puts back
    the run's updates (BatchNorm's statistics) as it hands the output over, so a result
    nobody takes (a build that fails after its check, another thread's call) changes
    nothing, and the call then runs as if nothing were kept."""

    def __init__(self) -> None:
        self.made = False
        self.output: Any = None
        #: the module's buffers as the graph's run left them
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self) -> Any:
        """The run's output, the module's buffers updated as that run updated them."""
        _Saved.put(self.buffers)
        output, self.output, self.buffers, self.made = self.output, None, [], False
        return output


class Made(Protocol):
    """Eager's runs of one check made elsewhere, from the state the check runs from
    (`eager_child`); each None where it was not made."""

    def side(self) -> Side | None:
        """Eager's plain run (`_side`)."""
        ...

    def nudged(self, seed: int) -> Side | None:
        """Eager's run for `seed`'s spread (`_nudged_side`), asked after `side`."""
        ...


def _side(
    run: Callable[[list[torch.Tensor]], Any],
    inputs: Sequence[torch.Tensor],
    trainable: Sequence[torch.Tensor],
    grad: bool,
    saved: _Saved,
    kept: Kept | None = None,
) -> Side:
    """One run on copies of `inputs`, with a backward of one fixed cotangent; the saved
    state restored after it. With `kept` (inputs none of which requires grad), the run is on
    `inputs` themselves and is kept as the call's (`Kept`)."""
    if kept is not None:
        leaves = list(inputs)
        # (the copies the other runs make anyway: what to put back if the graph writes one)
        before = [t.detach().clone() for t in leaves]
        versions = [t._version for t in leaves]
    else:
        leaves = _copies(inputs)
    with torch.enable_grad() if grad else torch.no_grad():
        # the call gets non-leaf copies: a forward writing into its input (`index_fill_`)
        # may, as it may into the caller's non-leaf tensors; gradients are the leaves'
        copies = [t.clone() if t.requires_grad else t for t in leaves]
        output = run(copies)
    if kept is not None:
        written = [k for k, t in enumerate(leaves) if t._version != versions[k]]
        if not written:
            kept.made, kept.output, kept.buffers = True, output, saved.now()
        else:  # the graph wrote the caller's tensors: put back, and the call runs again
            with torch.no_grad():
                for k in written:
                    leaves[k].copy_(before[k])
    # Buffers are restored after the backward, not before: eager's BatchNorm saves its
    # running statistics for backward, and restoring them in place before
    # `autograd.grad` raised autograd's "modified by an inplace operation".
    if not grad:
        saved.restore()
    outputs = _float_leaves(output)
    gradients: list[torch.Tensor | None] = []
    if grad:
        targets = list(trainable) + [t for t in leaves if t.requires_grad]
        differentiable = [t for t in outputs if t.requires_grad]
        if targets and differentiable:
            gen = torch.Generator(device="cpu").manual_seed(0)
            # drawn in float32 whatever the dtype: the float64 reference gets the same values
            cotangents = [
                torch.randn(t.shape, generator=gen).to(t.device, t.dtype) for t in differentiable
            ]
            gradients = list(
                torch.autograd.grad(
                    differentiable,
                    targets,
                    cotangents,
                    allow_unused=True,
                    retain_graph=kept is not None and kept.made,  # the user's backward's
                )
            )
        saved.restore()
    return [t.detach() for t in outputs], gradients


class _Noise:
    """Standard normal noise for one seed's run, shaped like any tensor: a window at a random
    offset into one pool of draws per device and dtype, at least twice the largest tensor's
    size. Drawing fresh noise for every parameter and every operator's result cost more than
    the run itself (ResNet-50's noisy eager run took 1.9 s against 0.6 s without noise);
    windows of one pool are not independent, but the spread is an estimate either way."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen
        self.pools: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def like(self, tensor: torch.Tensor) -> torch.Tensor:
        key, size = (tensor.device, tensor.dtype), tensor.numel()
        pool = self.pools.get(key)
        if pool is None or pool.numel() < 2 * size:
            drawn = torch.randn(max(2 * size, 1 << 16), generator=self.gen)
            pool = self.pools[key] = drawn.to(tensor.device, tensor.dtype)
        start = int(torch.randint(pool.numel() - size + 1, (), generator=self.gen))
        return pool[start : start + size].view(tensor.shape)


def _nudge(tensor: torch.Tensor, noise: _Noise) -> torch.Tensor:
    """`tensor * (1 + NUDGE * N(0, 1))`, a new tensor."""
    value = tensor.detach()
    return torch.addcmul(value, value, noise.like(value), value=NUDGE)


@contextlib.contextmanager
def _nudged_parameters(module: torch.nn.Module, noise: _Noise) -> Iterator[None]:
    """The module's floating-point parameters nudged and put back bit for bit: each
    parameter's `.data` is swapped for a nudged copy and swapped back, so its own storage is
    never written and its version counter never moves (a backward the user has pending that
    saved one of them sees no in-place change). (Sharded parameters, DTensors, are left as
    they are: the inputs' nudge still disturbs the call.)"""
    originals = [
        (p, p.data)
        for p in module.parameters()
        if p.is_floating_point() and type(p.detach()) is torch.Tensor
    ]
    try:
        for p, original in originals:
            p.data = _nudge(original, noise)
        yield
    finally:
        for p, original in originals:
            p.data = original


def _spreads(
    module: torch.nn.Module,
    run_eager: Callable[[list[torch.Tensor]], Any],
    inputs: Sequence[torch.Tensor],
    trainable: Sequence[torch.Tensor],
    grad: bool,
    saved: _Saved,
    eager: Side,
    made: Made | None = None,
) -> Iterator[tuple[list[float], list[float]] | None]:
    """Eager's own largest movement per output and per gradient against its plain run
    `eager`, so far: eager run again, once per seed, from nudged inputs and parameters and
    with rounding noise in every operator's result (`_nudged_side`; `made`'s, where it has
    that seed's run), yielding the spreads measured up to each seed. Yields None (and stops)
    when such a run fails or gives other outputs: then only the strict comparison counts.

    A spread only grows from seed to seed, so a graph within the spreads of the first seeds is
    within those of all: the caller stops at the first that covers it (ResNet-50's check took
    4.7 s for both seeds, one eager run with noise in every operator each)."""
    outputs, gradients = [0.0] * len(eager[0]), [0.0] * len(eager[1])
    for seed in NUDGE_SEEDS:
        moved = made.nudged(seed) if made is not None else None
        try:
            if moved is None:
                moved = _nudged_side(module, run_eager, inputs, trainable, grad, saved, seed)
        except Exception:
            yield None
            return
        if len(moved[0]) != len(outputs) or len(moved[1]) != len(gradients):
            yield None
            return
        for spreads, new, old in ((outputs, moved[0], eager[0]), (gradients, moved[1], eager[1])):
            for k, (a, e) in enumerate(zip(new, old, strict=True)):
                if a is None or e is None or a.shape != e.shape:
                    continue
                # a NaN moved nothing measurable: it widens no spread
                spreads[k] = max(spreads[k], _distance(a, e, nan=0.0))
        yield list(outputs), list(gradients)


def _nudged_side(
    module: torch.nn.Module,
    run_eager: Callable[[list[torch.Tensor]], Any],
    inputs: Sequence[torch.Tensor],
    trainable: Sequence[torch.Tensor],
    grad: bool,
    saved: _Saved,
    seed: int,
) -> Side:
    """Eager's run of the call from inputs and parameters nudged by `seed`'s noise, with
    rounding noise in every operator's result (`_RoundingNoise`)."""
    noise = _Noise(torch.Generator(device="cpu").manual_seed(seed))
    nudged = [
        _nudge(t, noise).requires_grad_(t.requires_grad) if t.is_floating_point() else t
        for t in inputs
    ]
    with _nudged_parameters(module, noise), _RoundingNoise(noise):
        return _side(run_eager, nudged, trainable, grad, saved)


@contextlib.contextmanager
def _promoted(module: torch.nn.Module) -> Iterator[bool]:
    """The module's float32 (and half) parameters and buffers as float64 copies while the
    block runs, the originals put back after it (the same tensor objects and storage: bit for
    bit, and a buffer the run updates updates only its copy). Yields whether anything was
    promoted and the copies fit `REFERENCE_BYTES`."""
    tensors = [
        t
        for t in itertools.chain(module.parameters(), module.buffers())
        if t.is_floating_point() and t.dtype != torch.float64 and type(t.detach()) is torch.Tensor
    ]
    size = sum(t.numel() for t in tensors) * 8
    if not tensors or size > REFERENCE_BYTES:
        yield False
        return
    originals = [t.data for t in tensors]
    try:
        for t in tensors:
            t.data = t.data.double()
        yield True
    finally:
        for t, original in zip(tensors, originals, strict=True):
            t.data = original


def _float64_side(
    module: torch.nn.Module,
    run_eager: Callable[[list[torch.Tensor]], Any],
    inputs: Sequence[torch.Tensor],
    trainable: Sequence[torch.Tensor],
    grad: bool,
    saved: _Saved,
) -> Side | None:
    """The call run eagerly in float64 (with the same cotangents): the reference both sides'
    float32 errors are measured against. None where there is nothing to promote, the module
    is too large, or the run fails (code that mixes in float32 tensors of its own)."""
    promoted_inputs = [
        t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
        for t in inputs
    ]
    try:
        with _promoted(module) as promoted:
            if not promoted:
                return None
            return _side(run_eager, promoted_inputs, trainable, grad, saved)
    except Exception:
        return None


class _RoundingNoise(TorchDispatchMode):
    """Every floating-point result of an ATen operator, forward and backward, moved by about
    one rounding step (times 1 + eps * N(0, 1)), as Monte Carlo arithmetic estimates a
    computation's sensitivity to rounding: another library's kernels round every operator
    otherwise, not only the inputs, and a nudge of the inputs alone moved regnet_y_400mf's
    gradients by 2 % where eager's own float32 error (against float64) is 8 % and ORT's 4 %.
    In-place and aliasing operators are left as they are. Only this thread's operators.
    One `addcmul` pass per result, with `_Noise`'s windows."""

    def __init__(self, noise: _Noise) -> None:
        super().__init__()
        self.noise = noise

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
            return out
        return pytree.tree_map(self._round, out)

    def _round(self, value: Any) -> Any:
        if (
            not isinstance(value, torch.Tensor)
            or not value.is_floating_point()
            or not value.numel()
        ):
            return value
        eps = torch.finfo(value.dtype).eps
        return torch.addcmul(value, value, self.noise.like(value), value=eps)


def _compare(
    graph: Side,
    eager: Side,
    spreads: tuple[list[float], list[float]] | None = None,
    reference: Side | None = None,
    measured: _Measured | None = None,
) -> Verification:
    """Outputs and gradients, tensor by tensor; with eager's own `spreads`, a tensor beyond
    the strict tolerance still matches within SPREAD times its spread; with the call's
    float64 `reference`, when the graph's distance from it is within REFERENCE_RATIO times
    eager's own (or its spread)."""
    result = Verification()
    measured = measured or _Measured()
    (graph_out, graph_grads), (eager_out, eager_grads) = graph, eager
    output_spreads, grad_spreads = spreads or ([], [])
    reference_out, reference_grads = reference or ([], [])
    # (what, graph's, eager's, eager's largest magnitude, its spread, the float64 reference)
    pairs: list[tuple[str, torch.Tensor, torch.Tensor, float, float, torch.Tensor | None]] = []
    if len(graph_out) != len(eager_out):
        result.mismatch = f"{len(graph_out)} outputs, eager has {len(eager_out)}"
    for k, (a, e) in enumerate(zip(graph_out, eager_out, strict=False)):
        spread = output_spreads[k] if k < len(output_spreads) else 0.0
        exact = reference_out[k] if k < len(reference_out) else None
        pairs.append((f"output {k}", a, e, measured.largest(e), spread, exact))
    outputs = len(pairs)
    for k, (ga, ge) in enumerate(zip(graph_grads, eager_grads, strict=False)):
        if ga is None and ge is None:
            continue
        if ga is None:
            assert ge is not None
            ga = torch.zeros_like(ge)
        if ge is None:
            ge = torch.zeros_like(ga)
        spread = grad_spreads[k] if k < len(grad_spreads) else 0.0
        exact = reference_grads[k] if k < len(reference_grads) else None
        pairs.append((f"gradient {k}", ga, ge, measured.largest(ge), spread, exact))
    zero = _rounding_zero(scale for _, _, _, scale, _, _ in pairs[outputs:])
    floors = [0.0] * outputs + [zero] * (len(pairs) - outputs)
    for (what, a, e, scale, spread, exact), floor in zip(pairs, floors, strict=True):
        diff, rel, beyond = _difference(a, e, floor, scale, measured)
        if what.startswith("output"):
            result.output_diff = max(result.output_diff, diff)
            result.output_rel = max(result.output_rel, rel)
        else:
            result.grad_diff = max(result.grad_diff, diff)
            result.grad_rel = max(result.grad_rel, rel)
        if not beyond:
            continue
        note = ""
        if spreads is not None:
            if diff <= SPREAD * spread:
                continue
            note = f"; eager's own spread {spread / scale if scale > 0 else spread:.3g}"
        if exact is not None and exact.shape == e.shape:
            own = measured.distance(e, exact)
            if measured.distance(a, exact) <= REFERENCE_RATIO * max(own, spread):
                continue
            note += f"; eager's float32 error {own / scale if scale > 0 else own:.3g}"
        if result.mismatch is None:
            result.mismatch = f"{what} differs by {diff:.3g} (relative {rel:.3g}{note})"
    if spreads is not None:
        # relative to each tensor's largest value, as the differences; gradients eager
        # leaves at rounding noise (relative to themselves, noise moves by their size) aside
        result.spread_rel = max(
            (
                spread / scale
                for (_, _, _, scale, spread, _), floor in zip(pairs, floors, strict=True)
                if scale > floor and scale > 0
            ),
            default=0.0,
        )
    if reference is not None:
        result.float64_rel = max(
            (
                measured.distance(e, exact) / scale
                for (_, _, e, scale, _, exact), floor in zip(pairs, floors, strict=True)
                if exact is not None and exact.shape == e.shape and scale > floor and scale > 0
            ),
            default=0.0,
        )
    return result


def _distance(actual: torch.Tensor, exact: torch.Tensor, nan: float = float("inf")) -> float:
    """max|actual - exact|, `nan` where any element's difference is NaN.

    In the wider of the two dtypes, float32 at least: the difference of two close float32
    values is exact in float32 (Sterbenz), and a far one is beyond any tolerance either way.
    Converting both to float64 first, as this did, took 0.5 s of BERT-base's first call (its
    check compares 110 M gradients) for the same verdicts."""
    a, e = actual.detach(), exact.detach()
    if a.dtype in _NARROW:
        a = a.float()
    if e.dtype in _NARROW:
        e = e.float()
    if a.numel() == 0:
        return 0.0
    largest = _largest(torch.sub(a, e))
    return nan if largest != largest else largest


#: floating types whose differences are taken in float32 (`_distance`)
_NARROW = (torch.float16, torch.bfloat16)


def verify_call(
    cls: str,
    module: torch.nn.Module,
    run_graph: Callable[[list[torch.Tensor]], Any],
    run_eager: Callable[[list[torch.Tensor]], Any],
    inputs: Sequence[torch.Tensor],
    trainable: Sequence[torch.Tensor],
    grad: bool,
    made: Made | None = None,
    kept: Kept | None = None,
) -> Verification:
    """Run the call through the graph and eagerly, compare, restore the user's state.

    `run_graph(tensors)` and `run_eager(tensors)` take the flat input tensors. No gradient
    hook of a parameter fires. `made`, asked once the graph has run, may give eager's runs
    already made elsewhere from the same state (`eager_child`); eager runs here where it
    gives None. Where the strict comparison fails, eager's own spread is measured on the
    call and the comparison made again within it (see the module's docstring). Raises
    `VerificationError` on a mismatch (the state is restored first). `kept`: the graph's run
    kept as the call's own where it can be (`Kept`), and only where the call matched.
    """
    saved = _Saved(module)
    if kept is not None and any(t.requires_grad for t in inputs):
        kept = None
    matched = False
    with _hooks_silenced(trainable):
        try:
            graph: Side | None = None
            try:
                graph = _side(run_graph, inputs, trainable, grad, saved, kept)
            except EngineError:
                raise
            except Exception as exc:
                # The graph's run (its backward, say) failed: the graph's fault where eager's
                # run of the same copies succeeds below (a symbolic-size graph computing a
                # size otherwise than eager raised here, and was used as if the check could
                # not be made); where eager's fails too, the comparison cannot be made.
                saved.restore()
                failure = f"{type(exc).__name__}: {exc}"
            eager = made.side() if made is not None else None
            if eager is None:
                eager = _side(run_eager, inputs, trainable, grad, saved)
            if graph is None:
                result = Verification(
                    mismatch=f"the graph's run failed where eager's did not ({failure})"
                )
            else:
                measures = _Measured()
                strict = result = _compare(graph, eager, measured=measures)
                spreads: tuple[list[float], list[float]] | None = None
                if result.mismatch is not None:
                    measured = _spreads(
                        module, run_eager, inputs, trainable, grad, saved, eager, made
                    )
                    for spreads in measured:
                        if spreads is None:  # not measurable: the strict verdict stands
                            result = strict
                            break
                        result = _compare(graph, eager, spreads, measured=measures)
                        if result.mismatch is None:
                            break
                if result.mismatch is not None:
                    # the spread may fall short of eager's float32 error: measure that error
                    reference = _float64_side(module, run_eager, inputs, trainable, grad, saved)
                    if reference is not None:
                        result = _compare(graph, eager, spreads, reference, measures)
            matched = result.mismatch is None
        finally:
            saved.restore()
            if kept is not None and not matched:
                kept.made, kept.output, kept.buffers = False, None, []
    if result.mismatch is not None:
        error = VerificationError(
            cls,
            f"ONNX Runtime's numbers differ from eager PyTorch's on this call: {result.mismatch}",
            "This graph's calls run in PyTorch; report the model (ORT_AUTOPATCH_SAVE_ONNX "
            "writes the graph)",
        )
        error.verification = result
        raise error
    return result


def verify_entry(
    cls: str,
    module: torch.nn.Module,
    entry: Entry,
    state: ModuleState,
    call: FlatCall,
    grad: bool,
    forward: Callable[..., Any],
    random: list[str] | None = None,
    made: Made | None = None,
    kept: Kept | None = None,
) -> Verification:
    """`verify_call` for one call of a cached graph (`forward(module, *args, **kwargs)` is the
    eager side, or `made`'s where it gives one); a graph with random operators (`random`,
    or read from the graph when None) is reported as not verified (and nothing is `kept`)."""
    from ort_autopatch.engine import signature

    if random is None:
        import onnx

        random = random_ops(onnx.load_from_string(entry.recipe.forward_model))
    if random:
        return Verification(unverified=f"random operators ({', '.join(random)})")
    spec = call.spec()

    def run_graph(tensors: list[torch.Tensor]) -> Any:
        copy = signature.FlatCall(tensors, call.signature, spec, call.args, call.kwargs)
        return entry.run(state, copy)

    run_eager = eager_runner(module, call, forward)
    trainable = trainable_of(state, grad)
    return verify_call(cls, module, run_graph, run_eager, call.tensors, trainable, grad, made, kept)


def trainable_of(state: ModuleState, grad: bool) -> list[torch.Tensor]:
    """The parameters whose gradients a check compares: the trainable ones, in a training
    call."""
    return [p for p in state.params if p.requires_grad] if grad else []


def eager_runner(
    module: torch.nn.Module, call: FlatCall, forward: Callable[..., Any]
) -> Callable[[list[torch.Tensor]], Any]:
    """The call's eager side as `verify_call` runs it: `forward(module, *args, **kwargs)` on
    flat input tensors (copies), with the call's other arguments."""
    from ort_autopatch.engine import tracing

    spec = call.spec()

    def run_eager(tensors: list[torch.Tensor]) -> Any:
        args, kwargs = spec.rebuild(tensors)
        # selected submodules run their eager code too; its reads guard nothing. Reentrant
        # checkpointing refuses the comparison's `autograd.grad`: the wrapped function runs as
        # it is (the same values), as in a trace (a process-wide rebinding: under the lock)
        with (
            calls.EXPORT_LOCK,
            calls.stepping_aside(),
            calls.untraced_run(),
            tracing.checkpoint_through_function(),
        ):
            return forward(module, *args, **kwargs)

    return run_eager


def eager_side(
    module: torch.nn.Module,
    call: FlatCall,
    forward: Callable[..., Any],
    trainable: Sequence[torch.Tensor],
    grad: bool,
    forward_done: Callable[[], None] | None = None,
    seed: int | None = None,
) -> Side:
    """The call's eager side of a check (`verify_call`'s), made on its own: in a child
    forked for it (`eager_child`), whose state is the user's as the call found it; with a
    `seed`, the run that measures eager's spread (`_spreads`) for that seed. The tensors'
    gradient hooks stay silent, and the module's buffers and RNGs are restored.
    `forward_done()` is called between the forward and the backward."""
    run_eager = eager_runner(module, call, forward)

    def run(tensors: list[torch.Tensor]) -> Any:
        output = run_eager(tensors)
        if forward_done is not None:
            forward_done()
        return output

    with _hooks_silenced(trainable):
        saved = _Saved(module)
        try:
            if seed is None:
                return _side(run, call.tensors, trainable, grad, saved)
            return _nudged_side(module, run, call.tensors, trainable, grad, saved, seed)
        finally:
            saved.restore()
