"""The one decomposition table of the plain backend: which ATen operators are rewritten, at
trace time, into operators the ONNX exporter translates faithfully.

ONNX's op library (onnxscript's torchlib) has no backward operators, so every backward
operator in a joint graph must be decomposed. The base is the exporter's own choice (each
operator torchlib lacks gets torch's decomposition); on top of it, declared here once:

- `_native_batch_norm_legit_functional`: torchlib's translation hard-codes training off, so a
  BatchNorm in train mode would silently normalise with the running statistics. In train
  mode one operator of ours (`norms`: a trace records one node, not fifteen), its backward
  (`native_batch_norm_backward`) another; where those do not apply, decomposed (ours: in
  fewer passes over the input than torch's; the backward torch's).
- `native_layer_norm_backward`: one operator of ours (`norms`), with torch's decomposition's
  arithmetic; torch's decomposition where it does not apply. `native_layer_norm` in float64:
  torch's decomposition (ONNX's LayerNormalization keeps its statistics in float32 at most,
  and ORT refused the graphs whose backward read them); torchlib's elsewhere.
- `nll_loss_forward`: torchlib's translation returns a total weight of 1 where ATen returns
  the number of counted targets (the backward divides by it): with the mean reduction every
  gradient came out batch-size times too large, again without an error. Decomposed.
- `convolution_backward`: torch has no decomposition; ours (`windows`) covers every stride,
  padding, dilation, groups and transposed convolution (1-d to 3-d). The weight's gradient is
  a matrix product with the input's patches (for one group, where it pays, taken by one
  convolution with constant one-hot kernels), not a convolution with the gradient as its
  kernel (which ORT ran slowly). Where its ONNX nodes can be written directly (one group's
  weight gradient from the input itself or the one-hot convolution, static sizes), one
  operator of ours (`convolutions`: a trace records one node, not five to fifteen).
- `max_pool2d_with_indices` and its backward, for pools whose windows tile the input: an
  elementwise maximum over the windows' slots (square windows' from one `SpaceToDepth`, an
  operator of ours, `windows.window_slots`; others' strided slices), with no indices (ORT's
  MaxPool with indices is nine times slower than without), no scatter and no small trailing
  window axis.
- `threshold_backward` (ReLU's) and `leaky_relu_backward`: a product with the mask instead of
  ORT's slow `Where` (ten times a Greater, a Cast and a Mul on a CNN's activations), one
  operator of ours each where its values can be declared (`activations`).
- `nll_loss_backward` over a batch of rows and `_log_softmax_backward_data`: one operator of
  ours each (`losses`), made one where the first feeds the second
  (`fx_passes.cross_entropy_backward_fused`): a cross entropy's gradient in two passes over
  (tokens, vocabulary) and a scatter of one value a row, where torch's decompositions made
  eight passes; torch's decompositions elsewhere.
- `_safe_softmax` (attention's math kernel: with dropout, or a mask the flash kernel does not
  take): its rows of -inf found by one ReduceMax rather than a comparison cast to int64 and
  a ReduceMin.
- `select_backward` and `slice_backward`: as pads rather than torch's scatters into zeros,
  which ORT runs as ScatterElements (a quarter of a transformer layer's step).
- `avg_pool2d_backward`, `avg_pool3d_backward` (every padding, divisor and ceil mode, as a
  transposed convolution with a kernel of ones) and `_adaptive_avg_pool2d_backward` (the
  cases an average pool is a convolution with a constant kernel; other adaptive sizes as one
  matrix product per dimension with the windows' weights): torch has none either.
  `_adaptive_avg_pool3d` and its backward the same way (torchlib has no 3-d adaptive pool).
- `avg_pool2d` and `avg_pool3d` with `divisor_override`: torchlib's translation ignores the
  override (its results were off by the window's size over the divisor). Each window's sum
  over the divisor; other average pools keep the exporter's AveragePool.
- `max_pool3d_with_indices_backward` (neither torch nor torchlib has one): a scatter-add of
  each window's gradient at its index.
- Transposed convolutions in these backwards whose `output_padding` depends on symbolic
  sizes: ONNX takes it as a constant attribute, so they are computed whole, padded and cut
  (`_transposed`); every convolution's backward had been traced once per input shape.
- `linear` (`BEFORE_AUTOGRAD`): one operator of ours each way (`linears`: ATen's composite is
  four operators forward, and autograd makes about eight more of them backward), for float
  inputs of static sizes; ATen's composite elsewhere.
- `matmul` (`BEFORE_AUTOGRAD`): one operator of ours each way for two tensors of one batch
  shape (`matmuls`: attention's products; ATen's composite expands, copies and reshapes each
  side around a `bmm`, and autograd doubles that), float inputs of static sizes; ATen's
  composite elsewhere.
- `max_pool1d` (`BEFORE_AUTOGRAD`): ATen's composite pools over the sizes as plain integers
  for the untracked tensors of a trace, fixing the length; ours is the 2-d pool over a
  height of one.
- pooling, normalisation, embedding, dropout and loss backwards: torch's decompositions,
  named so the tests can hold each one to eager.
- `bernoulli.p` (feature dropout's mask: `dropout1d/2d/3d`, `Dropout2d` on any rank):
  torchlib's translation draws from `RandomUniformLike` inside a local function, whose
  generator ORT seeds once per session: unseen by the tool's seeding and by the first-call
  check (which then compared a random mask with eager's and refused every such graph), and
  drawing another mask where a graph is run again with the forward's seed. Ours is the mask
  of an ONNX `Dropout` over ones, drawn per run from the tool's stream like `nn.Dropout`'s.
- `uniform` (`Tensor.uniform_`) and `rrelu_with_noise_functional` (`nn.RReLU` in training):
  torch's decompositions end in `prims.uniform`, which nothing translates; ours draw with
  `rand_like` (ONNX `RandomUniformLike`, seeded per session as a user's `rand_like` is).
- `adaptive_avg_pool2d` (`BEFORE_AUTOGRAD`): ATen's composite kernel, for an output of 1x1
  over a channels-last input, re-strides the mean it computes in place (`as_strided_`, a
  change of strides alone: every size-1 layout is both contiguous and channels-last), and
  autograd differentiates that as any `as_strided`, by scattering into a zero storage
  (`prims.as_strided_scatter`, which ONNX cannot express: convnext and swin_t failed on it).
  Ours is the same mean without the re-striding.
- `_scaled_dot_product_flash_attention_for_cpu` and its backward (torch has no backward):
  attention is traced with the kernel eager picks, and the flash kernel's backward is not the
  softmax's (see its docstring): tracing every attention with the math kernel instead gave
  BERT with padding masks gradients 0.35 % off eager's. Ours compute what the kernel computes
  (equal to ATen's in float32 and float64 at every mask, causal, GQA and layout it takes; OPT's
  zoo entry, once 3.4x off, had been held to a reference run on the math kernel: issue 35).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ort_autopatch.engine.backends.ort import (
    activations,
    convolutions,
    linears,
    losses,
    matmuls,
    norms,
    windows,
)

aten = torch.ops.aten

#: torch's own decompositions this backend relies on, declared so each has a test.
TORCH_DECOMPOSED = (
    aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default,
    aten.embedding_dense_backward.default,
    aten.native_group_norm_backward.default,
    aten.native_dropout_backward.default,
    aten.nll_loss2d_backward.default,
    aten._softmax_backward_data.default,
    aten.mse_loss_backward.default,
    aten.binary_cross_entropy_backward.default,
    aten.smooth_l1_loss_backward.default,
    aten.gelu_backward.default,
    aten.tanh_backward.default,
    aten.sigmoid_backward.default,
    aten.silu_backward.default,
)


#: operators the exporter's table decomposes that a trace must keep: `lift` and `lift_fresh`
#: turn a constant made in forward (`torch.tensor(1.0)`) into the trace's fake tensor, and
#: their decomposition (an alias of the real tensor) fails the trace.
KEPT = (aten.lift.default, aten.lift_fresh.default)


def bernoulli_p(
    input: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Ones with probability `p`, zeros elsewhere, in the input's shape and dtype: the kept
    mask of a dropout of ones at rate 1 - p (ONNX `Dropout`, whose mask is boolean, so the
    values are exactly 0 and 1 as ATen's). Dropout's rate must lie in [0, 1): the two
    certain cases are constants."""
    if generator is not None:
        return NotImplemented
    if p >= 1:
        return torch.ones_like(input)
    if p <= 0:
        return torch.zeros_like(input)
    _, kept = aten.native_dropout(torch.ones_like(input), 1 - p, True)
    return kept.to(input.dtype)


def uniform(
    input: torch.Tensor,
    low: float = 0.0,
    high: float = 1.0,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`Tensor.uniform_`: torch's own decomposition ends in `prims.uniform`, which nothing
    translates; a uniform draw in [0, 1) scaled to [low, high) is ONNX's `RandomUniformLike`
    (seeded as every graph's random operators are, `random_ops`)."""
    if generator is not None:
        return NotImplemented
    return torch.rand_like(input) * (high - low) + low


def rrelu_with_noise_functional(
    input: torch.Tensor,
    noise: torch.Tensor,
    lower: float = 0.125,
    upper: float = 1.0 / 3.0,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RReLU as ATen computes it: in training, each input at or below zero is multiplied by
    its own slope drawn uniformly from [lower, upper) and the slopes (1 elsewhere) are the
    noise the backward multiplies by; in eval, a leaky ReLU with the mean slope (the noise
    left as it was)."""
    if generator is not None:
        return NotImplemented
    if not training:
        return aten.leaky_relu(input, (lower + upper) / 2), noise
    slopes = torch.rand_like(input) * (upper - lower) + lower
    drawn = torch.where(input <= 0, slopes, torch.ones_like(input))
    return input * drawn, drawn


def _attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """The flash kernel's scores: q k^T times the scale, then the mask added (a boolean one as
    0 or -inf, as the kernel converts it; a causal one from the top left)."""
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), -math.inf)
        else:
            scores = scores + attn_mask.to(scores.dtype)
    if is_causal:
        rows, cols = query.shape[-2], key.shape[-2]
        above = torch.ones(rows, cols, dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(above, -math.inf)
    return scores


def _flash_supported(query: torch.Tensor, key: torch.Tensor, dropout_p: float) -> bool:
    """No dropout, (batch, heads, length, dim), and key heads that divide the query's (grouped
    query attention, `enable_gqa`: query head h reads key and value head h // group)."""
    return dropout_p == 0 and query.dim() == 4 and query.shape[1] % key.shape[1] == 0


def _heads_as_query(t: torch.Tensor, heads: Any) -> torch.Tensor:
    """Key or value heads repeated to the query's, each `heads // t.shape[1]` times in a row
    (what the kernel reads under grouped query attention); `t` itself when they match."""
    kv_heads = t.shape[1]
    if kv_heads == heads:
        return t
    group = heads // kv_heads
    b, _, length, dim = t.shape
    return t.unsqueeze(2).expand(b, kv_heads, group, length, dim).reshape(b, heads, length, dim)


def _heads_as_key(grad: torch.Tensor, kv_heads: Any) -> torch.Tensor:
    """The gradient of `_heads_as_query`: each group of query heads summed onto its head."""
    heads = grad.shape[1]
    if kv_heads == heads:
        return grad
    b, _, length, dim = grad.shape
    return grad.reshape(b, kv_heads, heads // kv_heads, length, dim).sum(2)


def scaled_dot_product_flash_attention_for_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    """The CPU flash kernel's output and its log-sum-exp, computed as the kernel does (one
    block of keys): row maximum m of the scores s, e = exp(s - m), output (e v) / sum(e),
    lse = m + log(sum(e)); in float32 for half types, as the kernel accumulates."""
    if not _flash_supported(query, key, dropout_p):
        return NotImplemented
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    heads = query.shape[1]
    q, k, v = (t.to(work) for t in (query, key, value))
    k, v = _heads_as_query(k, heads), _heads_as_query(v, heads)
    scores = _attention_scores(q, k, is_causal, attn_mask, scale)
    peak = scores.amax(-1, keepdim=True)
    # a row with every key at -inf: the kernel gives an output and a log-sum-exp of 0
    # (so its backward, exp(-inf - 0), gives no gradient), where the softmax gives NaN
    masked = peak == -math.inf
    peak = torch.where(masked, 0.0, peak)
    weights = torch.exp(scores - peak)
    total = weights.sum(-1, keepdim=True)
    output = torch.matmul(weights, v) / torch.where(masked, 1.0, total)
    logsumexp = torch.where(masked, 0.0, peak + torch.log(total)).squeeze(-1)
    # the kernel's layouts (views after it need them): the output strided as the query
    # ((batch, length, heads, dim) transposed, as attention layers hand it over, or
    # contiguous), the log-sum-exp always (batch, length, heads) transposed
    output = output.to(query.dtype)
    if not query.is_contiguous() and query.transpose(1, 2).is_contiguous():
        output = output.transpose(1, 2).contiguous().transpose(1, 2)
    logsumexp = logsumexp.transpose(1, 2).contiguous().transpose(1, 2)
    return output, logsumexp


def scaled_dot_product_flash_attention_for_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    """The CPU flash kernel's backward (torch has none): the probabilities recomputed from the
    forward's log-sum-exp, p = exp(s - lse), not renormalised. That is what eager computes,
    and where every key of a row is masked by a large negative number (transformers' masks
    use the dtype's minimum) it is not the softmax's derivative: lse rounds to the minimum,
    each p is 1 instead of 1 / keys, and eager's gradients are that many times larger. The
    softmax's own backward (the math kernel's) was 0.35 % off eager's on BERT's embeddings."""
    if not _flash_supported(query, key, dropout_p):
        return NotImplemented
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v, o, g = (t.to(work) for t in (query, key, value, out, grad_out))
    k, v = _heads_as_query(k, query.shape[1]), _heads_as_query(v, query.shape[1])
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = _attention_scores(q, k, is_causal, attn_mask, scale)
    p = torch.exp(scores - logsumexp.to(work).unsqueeze(-1))
    grad_value = torch.matmul(p.transpose(-2, -1), g)
    grad_p = torch.matmul(g, v.transpose(-2, -1))
    row = (g * o).sum(-1, keepdim=True)
    grad_scores = p * (grad_p - row) * scale
    grad_query = torch.matmul(grad_scores, k)
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), q)
    grad_key, grad_value = (
        _heads_as_key(grad_key, key.shape[1]),
        _heads_as_key(grad_value, key.shape[1]),
    )
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


def select_backward(
    grad_output: torch.Tensor, input_sizes: Sequence[int], dim: int, index: int
) -> torch.Tensor:
    """Zeros around the selected slice, as a pad (ONNX Pad). torch's own decomposition
    scatters into zeros, which ORT runs as ScatterElements: in a transformer layer's backward
    (the q, k, v split) that was a quarter of the step."""
    rank = len(input_sizes)
    dim %= rank
    index %= input_sizes[dim]
    pad = [0, 0] * (rank - 1 - dim) + [index, input_sizes[dim] - index - 1]
    return aten.constant_pad_nd(grad_output.unsqueeze(dim), pad, 0.0)


def slice_backward(
    grad_output: torch.Tensor,
    input_sizes: Sequence[int],
    dim: int,
    start: int,
    end: int,
    step: int,
) -> torch.Tensor:
    """A step-1 slice's gradient as a pad, like `select_backward`; other steps scatter."""
    rank = len(input_sizes)
    dim %= rank
    size = input_sizes[dim]
    if step != 1:
        zeros = grad_output.new_zeros(input_sizes)
        return aten.slice_scatter(zeros, grad_output, dim, start, end, step)
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    pad = [0, 0] * (rank - 1 - dim) + [start, size - end]
    return aten.constant_pad_nd(grad_output, pad, 0.0)


def diagonal_backward(
    grad_output: torch.Tensor, input_sizes: Sequence[int], offset: int, dim1: int, dim2: int
) -> torch.Tensor:
    """The diagonal's gradient placed by a mask, out of place: torch's decomposition copies
    into a diagonal view of zeros, an in-place write aot_autograd refuses in a joint graph
    (and ONNX has no diagonal scatter). Element k of the diagonal sits in row k (offset >= 0)
    or column k (offset < 0): the gradient, padded to that length, is spread along the other
    axis and kept where the mask marks the diagonal."""
    rank = len(input_sizes)
    dim1, dim2 = dim1 % rank, dim2 % rank
    rows, cols = input_sizes[dim1], input_sizes[dim2]
    along = rows if offset >= 0 else cols
    spread = aten.constant_pad_nd(grad_output, [0, along - grad_output.shape[-1]], 0.0)
    spread = spread.unsqueeze(-1) if offset >= 0 else spread.unsqueeze(-2)
    i = torch.arange(rows, device=grad_output.device).unsqueeze(-1)
    j = torch.arange(cols, device=grad_output.device)
    on_diagonal = (j - i) == offset
    placed = torch.where(on_diagonal, spread, grad_output.new_zeros(()))
    return torch.movedim(placed, (-2, -1), (dim1, dim2))


def weight_norm_interface_backward(
    grad_w: torch.Tensor, v: torch.Tensor, g: torch.Tensor, norms: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight_norm's gradient (w = v * g / |v|, the norm over every dim but `dim`), which
    torch has as one fused kernel only: with s = sum(grad_w * v) over those dims,
    grad_g = s / |v| and grad_v = g / |v| * (grad_w - v * s / |v|^2)."""
    dim %= v.dim()
    over = [k for k in range(v.dim()) if k != dim]
    s = (grad_w * v).sum(over, keepdim=True)
    grad_g = s / norms
    grad_v = (g / norms) * (grad_w - v * (grad_g / norms))
    return grad_v, grad_g


def safe_softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The softmax of attention's math kernel, zero along rows that are all -inf (where the
    plain softmax gives NaN). torch's decomposition finds those rows as `all(x == -inf)`,
    which the exporter writes as a Cast of the comparison to int64 and a ReduceMin over it
    (0.66 ms of a transformer layer's 62 ms forward and backward, at one thread); a row is
    all -inf exactly when its maximum is -inf, NaN included (a NaN maximum is no -inf; nor
    is `all` over a row holding a NaN), so one ReduceMax finds them. An empty dimension
    (whose maximum torch refuses) keeps torch's decomposition."""
    from torch._decomp.decompositions import safe_softmax as torchs
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if input.dim() and statically_known_true(input.shape[dim] == 0):
        return torchs(input, dim, dtype)
    out = torch.softmax(input, dim=dim, dtype=dtype)
    masked_rows = input.amax(dim=dim, keepdim=True) == -math.inf
    return torch.where(masked_rows, torch.zeros_like(out), out)


OURS: dict[Any, Callable[..., Any]] = {
    aten._native_batch_norm_legit_functional.default: norms.native_batch_norm_legit_functional,
    aten.native_batch_norm_backward.default: norms.native_batch_norm_backward,
    aten.native_layer_norm.default: norms.native_layer_norm,
    aten.native_layer_norm_backward.default: norms.native_layer_norm_backward,
    aten.max_pool2d_with_indices.default: windows.max_pool2d_with_indices,
    aten.max_pool2d_with_indices_backward.default: windows.max_pool2d_with_indices_backward,
    aten.threshold_backward.default: activations.threshold_backward,
    aten.nll_loss_backward.default: losses.nll_loss_backward,
    aten._log_softmax_backward_data.default: losses.log_softmax_backward,
    aten._safe_softmax.default: safe_softmax,
    aten.leaky_relu_backward.default: activations.leaky_relu_backward,
    aten.select_backward.default: select_backward,
    aten.slice_backward.default: slice_backward,
    aten.diagonal_backward.default: diagonal_backward,
    aten._weight_norm_interface_backward.default: weight_norm_interface_backward,
    aten.convolution_backward.default: convolutions.convolution_backward,
    aten.avg_pool2d_backward.default: windows.avg_pool2d_backward,
    aten.avg_pool3d_backward.default: windows.avg_pool3d_backward,
    aten.avg_pool2d.default: windows.avg_pool2d,
    aten.avg_pool3d.default: windows.avg_pool3d,
    aten.max_pool3d_with_indices_backward.default: windows.max_pool3d_with_indices_backward,
    aten._adaptive_avg_pool2d_backward.default: windows.adaptive_avg_pool2d_backward,
    aten._adaptive_avg_pool3d.default: windows.adaptive_avg_pool3d,
    aten._adaptive_avg_pool3d_backward.default: windows.adaptive_avg_pool3d_backward,
    aten.bernoulli.p: bernoulli_p,
    aten.uniform.default: uniform,
    aten.rrelu_with_noise_functional.default: rrelu_with_noise_functional,
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        scaled_dot_product_flash_attention_for_cpu
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        scaled_dot_product_flash_attention_for_cpu_backward
    ),
}


#: composite operators of the table: their ATen kernel (CompositeImplicitAutograd) runs above
#: autograd and calls other operators, so a trace never hands the operator itself to a
#: decomposition table; each entry is marked (`before_autograd`), and the capture puts it in
#: the ATen kernel's place while aot traces (`trace_context.composites_replaced`).
BEFORE_AUTOGRAD: dict[Any, Callable[..., Any]] = {
    aten.adaptive_avg_pool2d.default: windows.adaptive_avg_pool2d,
    aten.max_pool1d.default: windows.max_pool1d,
    aten.linear.default: linears.linear,
    aten.matmul.default: matmuls.matmul,
}
for _function in BEFORE_AUTOGRAD.values():
    _function.before_autograd = True  # type: ignore[attr-defined]


@functools.cache
def _torch_tables() -> tuple[tuple[Any, Callable[..., Any]], ...]:
    """torch's decompositions in the exporter's order of preference: `torch.export`'s default
    table (core ATen's, and the composite operators it materialises by walking the
    dispatcher's registrations: 0.07 s the first time, 0.03 s each time after), then
    `torch._decomp`'s. Read once a process: `table` and `decomposable` both need it."""
    defaults = torch.export.default_decompositions().items()
    return (*defaults, *torch._decomp.decomposition_table.items())


def _exporter_table(implemented: frozenset[Any]) -> dict[Any, Callable[..., Any]]:
    """The exporter's own choice (`create_onnx_friendly_decomposition_table`, which reads
    torch's tables again each call): each operator torchlib lacks gets torch's first
    decomposition; higher-order operators (no schema) get none. A test holds the two equal."""
    found: dict[Any, Callable[..., Any]] = {}
    for op, decomposition in _torch_tables():
        if op in implemented or op in found or not hasattr(op, "_schema"):
            continue
        found[op] = decomposition
    return found


@functools.cache
def table(implemented: frozenset[Any] | None = None) -> dict[Any, Callable[..., Any]]:
    """The decompositions the capture traces with (built once per set of operators):
    torch's, less those of the operators torchlib translates (`implemented`, by default
    `lowering.implemented()`, which imports the exporter)."""
    from torch._decomp import get_decompositions

    if implemented is None:
        from ort_autopatch.engine.backends.ort import lowering

        implemented = lowering.implemented()
    found = _exporter_table(frozenset(implemented))
    found.update(get_decompositions(list(TORCH_DECOMPOSED)))
    found.update(OURS)
    found.update(BEFORE_AUTOGRAD)
    for op in KEPT:
        found.pop(op, None)
    return found


@functools.cache
def decomposable() -> frozenset[Any]:
    """The operators torch's tables decompose, less those whose entry is ours whatever
    torchlib translates (`OURS`, `TORCH_DECOMPOSED`, `BEFORE_AUTOGRAD`, `KEPT`): those whose
    place in `table` depends on what torchlib translates. (A LayerNorm, once in `OURS`, made
    every build whose first trace had misread it trace again, into the same graph.)"""
    fixed = {*OURS, *TORCH_DECOMPOSED, *BEFORE_AUTOGRAD, *KEPT}
    return frozenset(op for op, _ in _torch_tables() if op not in fixed)


def alike(one: frozenset[Any], other: frozenset[Any]) -> bool:
    """Whether `table(one)` and `table(other)` are one table: the two sets agree on every
    operator torch's tables decompose (what else they hold is never read)."""
    return not (one ^ other) & decomposable()
