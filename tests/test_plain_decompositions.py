"""The plain backend's own decompositions equal the ATen operators they replace.

Pure torch: each decomposition is called on real tensors beside the operator it stands for
(the end-to-end tests in test_plain_backend.py hold the whole table to eager through ORT).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import pytest
import torch

from ort_autopatch.engine.backends.ort import decompositions, norms, windows

aten = torch.ops.aten

# (dims, in channels, out channels, kernel, stride, padding, dilation, groups, transposed,
#  output padding)
CONVOLUTIONS = [
    (2, 3, 4, 3, 1, 0, 1, 1, False, 0),
    (2, 4, 6, 3, 2, 1, 1, 2, False, 0),
    (2, 4, 4, 3, 1, 2, 2, 4, False, 0),  # depthwise, dilated
    (2, 3, 5, (3, 2), (2, 1), (1, 0), (1, 2), 1, False, 0),
    (2, 3, 4, 4, 3, 1, 1, 1, False, 0),  # stride leaves trailing positions unread
    (1, 3, 4, 5, 2, 2, 1, 1, False, 0),
    (3, 2, 4, 2, 1, 1, 1, 2, False, 0),
    (2, 4, 6, 3, 2, 1, 1, 1, True, 1),
    (2, 4, 6, 3, 2, 0, 2, 2, True, 0),
    (1, 3, 2, 4, 3, 1, 1, 1, True, 2),
    (2, 6, 3, 3, 2, 2, 2, 3, False, 0),  # groups, stride, padding and dilation at once
    (3, 4, 4, (2, 3, 1), (1, 2, 1), (1, 0, 1), (2, 1, 1), 2, False, 0),
    (2, 3, 4, 1, 1, 0, 1, 1, False, 0),  # one kernel position
    (2, 20, 6, 1, 1, 0, 1, 1, False, 0),  # pointwise: the input is the patch
    (1, 20, 4, 1, 1, 0, 1, 1, False, 0),  # pointwise, more channels than positions
    (3, 18, 4, 1, 1, 0, 1, 1, False, 0),
    (2, 20, 6, 1, 2, 0, 1, 1, False, 0),  # 1x1 strided: the last window ends at the last row
    (2, 20, 6, 1, 1, 1, 1, 1, False, 0),  # 1x1 over padding: sliced
    (2, 20, 6, 1, 1, 0, 1, 1, True, 0),  # transposed pointwise
]


def _pair(value: int | tuple[int, ...], dims: int) -> list[int]:
    return list(value) if isinstance(value, tuple) else [value] * dims


@pytest.mark.parametrize("patches", ["channels_last", "channels_first", "convolved"])
@pytest.mark.parametrize("case", CONVOLUTIONS, ids=lambda c: "-".join(map(str, c)))
def test_convolution_backward_equals_atens(
    case: tuple, patches: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every way of taking the weight's patches, whatever the channels and sizes: slices
    channels last; slices channels first (few channels and one group:
    `_narrow_weight_gradient`); or (one group, float32) one convolution with one-hot
    kernels."""
    narrow = 0 if patches == "channels_last" else 1_000
    monkeypatch.setattr(windows, "_NARROW_CHANNELS", narrow)
    convolved = patches == "convolved"
    monkeypatch.setattr(windows, "_convolved_patches_pay", lambda *_: convolved)
    taken = []
    by_convolution = windows._patches_by_convolution

    def spy(*args: Any) -> torch.Tensor | None:
        result = by_convolution(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(windows, "_patches_by_convolution", spy)
    dims, cin, cout, kernel, stride, padding, dilation, groups, transposed, extra = case
    kernel, stride, padding, dilation = (
        _pair(v, dims) for v in (kernel, stride, padding, dilation)
    )
    torch.manual_seed(0)
    # float32 where the convolution may serve (it serves float32 alone), float64 elsewhere
    convolved = convolved and groups == 1 and math.prod(kernel) > 1
    dtype = torch.float32 if convolved else torch.float64
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if convolved else {}
    x = torch.randn(2, cin, *[9 - d for d in range(dims)], dtype=dtype)
    if transposed:
        w = torch.randn(cin, cout // groups, *kernel, dtype=dtype)
    else:
        w = torch.randn(cout, cin // groups, *kernel, dtype=dtype)
    args = (stride, padding, dilation, transposed, [extra] * dims, groups)
    y = aten.convolution(x, w, None, *args)
    g = torch.randn_like(y)
    mask = [True, True, True]
    expected = aten.convolution_backward(g, x, w, [w.shape[1 if transposed else 0]], *args, mask)
    got = windows.convolution_backward(g, x, w, None, *args, mask)
    for name, a, e in zip(("input", "weight", "bias"), got, expected, strict=True):
        assert a is not None
        assert a.shape == e.shape, name
        torch.testing.assert_close(a, e, msg=f"gradient of the {name}", **tolerance)
    if convolved:
        assert taken == [True]  # the one-hot convolution, not the slices
    else:
        assert True not in taken


@pytest.mark.parametrize("n", [5, 40])  # patch widths below and above the positions
def test_a_weight_gradients_contraction_per_image_or_at_once_is_the_same(n: int) -> None:
    rows = torch.randn(3, 4, 20, dtype=torch.float64)
    cols = torch.randn(3, n, 20, dtype=torch.float64)
    expected = torch.einsum("bmp,bnp->mn", rows, cols)
    torch.testing.assert_close(windows._contracted(rows, cols), expected)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_a_pointwise_convolutions_weight_gradient_reads_its_input_as_it_lies(dims: int) -> None:
    """A 1x1 convolution's one patch is its input: the product takes it channels first,
    with no permuted copy of the input (channels last, it copied every 1x1 layer's input
    whole) and no permuted gradient."""
    from torch.fx.experimental.proxy_tensor import make_fx

    sides = {1: [40], 2: [6, 6], 3: [4, 4, 4]}[dims]  # positions no fewer than the channels
    x = torch.randn(2, 32, *sides, dtype=torch.float64)
    w = torch.randn(16, 32, *[1] * dims, dtype=torch.float64)
    g = torch.randn(2, 16, *sides, dtype=torch.float64)
    args = ([1] * dims, [0] * dims, [1] * dims, False, [0] * dims, 1, [False, True, False])

    def weight_gradient(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return windows.convolution_backward(g, x, w, None, *args)[1]

    graph = make_fx(weight_gradient)(g, x, w).graph
    targets = {node.target for node in graph.nodes if node.op == "call_function"}
    assert not targets & {aten.permute.default, aten.clone.default}, graph
    expected = aten.convolution_backward(g, x, w, [16], *args)[1]
    torch.testing.assert_close(weight_gradient(g, x, w), expected)


def test_convolution_backward_computes_only_the_masked_gradients() -> None:
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    g = torch.randn(1, 3, 3, 3)
    args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    got = windows.convolution_backward(g, x, w, None, *args, [False, True, False])
    assert got[0] is None and got[2] is None and got[1] is not None


POOLS = list(
    itertools.product(
        [(2, 2), (3, 3), (3, 2)],  # kernel
        [None, (2, 2), (1, 2)],  # stride
        [(0, 0), (1, 1)],  # padding
        [True, False],  # count_include_pad
        [None, 5],  # divisor_override
        [False, True],  # ceil_mode: windows hanging off the input
    )
)


@pytest.mark.parametrize("case", POOLS, ids=lambda c: "-".join(map(str, c)))
def test_avg_pool2d_and_its_backward_equal_atens(case: tuple) -> None:
    kernel, stride, padding, include, divisor, ceil = case
    if padding[0] * 2 > min(kernel):
        pytest.skip("torch refuses padding larger than half the kernel")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    stride = stride or kernel
    y = aten.avg_pool2d(x, kernel, stride, padding, ceil, include, divisor)
    forward = windows.avg_pool2d(x, kernel, stride, padding, ceil, include, divisor)
    if divisor is None:
        assert forward is NotImplemented  # the exporter's AveragePool
    else:
        torch.testing.assert_close(forward, y)
    g = torch.randn_like(y)
    expected = aten.avg_pool2d_backward(g, x, kernel, stride, padding, ceil, include, divisor)
    got = windows.avg_pool2d_backward(g, x, kernel, stride, padding, ceil, include, divisor)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("include", [True, False])
@pytest.mark.parametrize("divisor", [None, 3])
@pytest.mark.parametrize("batched", [True, False])
def test_avg_pool3d_and_its_backward_equal_atens(
    ceil: bool, include: bool, divisor: int | None, batched: bool
) -> None:
    torch.manual_seed(0)
    x = torch.randn(*([2] if batched else []), 3, 5, 6, 4, dtype=torch.float64)
    args = ([2, 3, 2], [2, 2, 1], [1, 1, 0], ceil, include, divisor)
    y = aten.avg_pool3d(x, *args)
    if divisor is not None:
        torch.testing.assert_close(windows.avg_pool3d(x, *args), y)
    g = torch.randn_like(y)
    expected = aten.avg_pool3d_backward(g, x, *args)
    torch.testing.assert_close(windows.avg_pool3d_backward(g, x, *args), expected)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize(
    "args", [([2, 2, 2], [2, 2, 2], [0, 0, 0]), ([3, 3, 2], [2, 1, 2], [1, 1, 1])]
)
def test_max_pool3d_with_indices_backward_equals_atens(batched: bool, args: tuple) -> None:
    torch.manual_seed(0)
    x = torch.randn(*([2] if batched else []), 3, 5, 6, 4, dtype=torch.float64)
    y, indices = aten.max_pool3d_with_indices(x, *args, [1, 1, 1], False)
    g = torch.randn_like(y)
    call = (g, x, *args, [1, 1, 1], False, indices)
    expected = aten.max_pool3d_with_indices_backward(*call)
    torch.testing.assert_close(windows.max_pool3d_with_indices_backward(*call), expected)


@pytest.mark.parametrize("out", [(1, 1), (2, 3), (4, 6)])
def test_adaptive_avg_pool2d_backward_equals_atens(out: tuple[int, int]) -> None:
    x = torch.randn(2, 3, 8, 12, dtype=torch.float64)
    g = torch.randn(2, 3, *out, dtype=torch.float64)
    expected = aten._adaptive_avg_pool2d_backward(g, x)
    torch.testing.assert_close(windows.adaptive_avg_pool2d_backward(g, x), expected)


@pytest.mark.parametrize(("size", "out"), [((7, 7), (3, 3)), ((5, 9), (2, 4)), ((3, 4), (5, 6))])
def test_adaptive_avg_pool2d_backward_over_uneven_windows_equals_atens(
    size: tuple[int, int], out: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    g = torch.randn(2, 3, *out, dtype=torch.float64)
    expected = aten._adaptive_avg_pool2d_backward(g, x)
    torch.testing.assert_close(windows.adaptive_avg_pool2d_backward(g, x), expected)


@pytest.mark.parametrize(
    ("size", "out"), [((4, 4, 4), (2, 2, 2)), ((5, 7, 6), (2, 3, 4)), ((3, 2, 4), (4, 3, 1))]
)
@pytest.mark.parametrize("batched", [True, False])
def test_adaptive_avg_pool3d_and_its_backward_equal_atens(
    size: tuple[int, ...], out: tuple[int, ...], batched: bool
) -> None:
    torch.manual_seed(0)
    x = torch.randn(*((2,) if batched else ()), 3, *size, dtype=torch.float64)
    expected = aten._adaptive_avg_pool3d(x, out)
    torch.testing.assert_close(windows.adaptive_avg_pool3d(x, out), expected)
    g = torch.randn_like(expected)
    torch.testing.assert_close(
        windows.adaptive_avg_pool3d_backward(g, x),
        aten._adaptive_avg_pool3d_backward(g, x),
    )


@pytest.mark.parametrize("out", [(1, 1), 1, (2, 3), (4, 6)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_adaptive_avg_pool2d_equals_atens_with_its_gradient(
    out: int | tuple[int, int], layout: torch.memory_format
) -> None:
    size = [out, out] if isinstance(out, int) else list(out)
    torch.manual_seed(0)
    base = torch.randn(2, 3, 8, 12, dtype=torch.float64).contiguous(memory_format=layout)
    x, y = base.clone().requires_grad_(), base.clone().requires_grad_()
    expected = aten.adaptive_avg_pool2d(x, size)
    got = windows.adaptive_avg_pool2d(y, size)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    g = torch.randn_like(expected)
    expected.backward(g)
    got.backward(g)
    assert x.grad is not None and y.grad is not None
    torch.testing.assert_close(y.grad, x.grad, rtol=0, atol=0)


def test_adaptive_avg_pool2d_over_channels_last_traces_without_re_striding() -> None:
    """ATen's composite kernel re-strides a channels-last 1x1 result in place, and its
    gradient is a scatter ONNX cannot express; with the table's entry in its place (as the
    capture puts it) the trace has neither, and the kernel is ATen's again afterwards."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import trace_context

    op = aten.adaptive_avg_pool2d.default
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)

    def gradient(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().requires_grad_()
        (grad,) = torch.autograd.grad(op(t, [1, 1]).sum(), t)
        return grad

    def traced() -> str:
        with torch._dispatch.python.enable_python_dispatcher():
            return str(make_fx(gradient)(x).code)

    assert "as_strided" in traced()  # ATen's own: what the entry is for
    # the table's composite entries, as the capture is given them (within the whole table,
    # whose building imports the exporter: absent beside the training build)
    with trace_context.composites_replaced(decompositions.BEFORE_AUTOGRAD):
        code = traced()
    assert "as_strided" not in code and "mean" in code
    assert key not in op.py_kernels
    assert "as_strided" in traced()


def _attention_scores(sizes: tuple[int, ...], dim: int, kind: torch.dtype) -> torch.Tensor:
    """Scores with every kind of row along `dim`: all -inf, partly -inf, a NaN among -inf, a
    NaN among numbers, +inf, and plain numbers."""
    scores = torch.randn(sizes, dtype=kind)
    if not scores.dim() or not scores.numel():
        return scores
    rows = scores.movedim(dim, -1).reshape(-1, sizes[dim])
    kinds = [
        lambda row: row.fill_(-math.inf),
        lambda row: row[: max(1, len(row) // 2)].fill_(-math.inf),
        lambda row: (row.fill_(-math.inf), row[0].fill_(math.nan)),
        lambda row: row[-1].fill_(math.nan),
        lambda row: row[0].fill_(math.inf),
    ]
    for row, kind in zip(rows, kinds, strict=False):
        kind(row)
    shape = [s for k, s in enumerate(sizes) if k != dim % len(sizes)] + [sizes[dim]]
    return rows.reshape(shape).movedim(-1, dim).contiguous()


@pytest.mark.parametrize(
    ("sizes", "dim"),
    [
        ((), 0),
        ((5,), 0),
        ((6, 4), 0),
        ((6, 4), 1),
        ((3, 2, 4), -1),
        ((3, 4, 2), 1),
        ((2, 3, 6, 5), -1),  # (batch, heads, queries, keys)
        ((2, 3, 6, 5), 0),
        ((2, 0, 4), -1),  # no rows
        ((2, 4, 0), -1),  # empty rows: torch's own decomposition
    ],
)
@pytest.mark.parametrize("kind", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_safe_softmax_equals_atens(
    sizes: tuple[int, ...], dim: int, kind: torch.dtype, dtype: torch.dtype | None
) -> None:
    scores = _attention_scores(sizes, dim, kind)
    expected = aten._safe_softmax(scores, dim, dtype)
    got = decompositions.safe_softmax(scores, dim, dtype)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)


def test_safe_softmax_runs_in_the_plain_backend_as_one_reduce_max() -> None:
    """Attention on the math kernel (as with dropout) through the plain backend: eager's
    numbers, and its rows of -inf found by a ReduceMax, not a ReduceMin over an int64 cast."""
    import onnx.inliner
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.plain_helpers import PLAIN_READY, SKIP_REASON, PlainCall, ran_in_plain_ort

    if not PLAIN_READY:
        pytest.skip(SKIP_REASON)

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            mask[0] = False  # the first query sees no key: a row of -inf
            with sdpa_kernel(SDPBackend.MATH):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (torch.randn(2, 3, 6, 8, requires_grad=True) for _ in range(3))
    plain = PlainCall(Attention(), q, k, v)
    out = plain(q, k, v)
    assert ran_in_plain_ort(out)
    expected = Attention()(q, k, v)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (q, k, v)))
    forward = onnx.inliner.inline_local_functions(onnx.load_from_string(plain.lowered.forward))
    ops = [node.op_type for node in forward.graph.node]
    assert "ReduceMax" in ops and "ReduceMin" not in ops


@pytest.mark.parametrize(("dim", "index"), [(0, 0), (1, 2), (-1, -1), (2, 1)])
def test_select_backward_equals_atens(dim: int, index: int) -> None:
    sizes = [3, 4, 5]
    g = torch.randn(*[s for k, s in enumerate(sizes) if k != dim % 3])
    expected = aten.select_backward(g, sizes, dim, index)
    torch.testing.assert_close(decompositions.select_backward(g, sizes, dim, index), expected)


@pytest.mark.parametrize(
    ("sizes", "offset", "dim1", "dim2"),
    [([4, 4], 0, 0, 1), ([3, 5], 1, 0, 1), ([3, 5], -2, 0, 1), ([2, 3, 4], 2, -1, 1)],
)
def test_diagonal_backward_equals_atens(
    sizes: list[int], offset: int, dim1: int, dim2: int
) -> None:
    g = torch.randn_like(torch.diagonal(torch.zeros(sizes), offset, dim1, dim2))
    expected = aten.diagonal_backward(g, sizes, offset, dim1, dim2)
    got = decompositions.diagonal_backward(g, sizes, offset, dim1, dim2)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("shape", "dim"), [((4, 3), 0), ((4, 3, 2), 0), ((4, 3, 2), 2)])
def test_weight_norm_interface_backward_equals_atens(shape: tuple[int, ...], dim: int) -> None:
    v = torch.randn(shape, dtype=torch.float64)
    g = torch.randn([s if k == dim else 1 for k, s in enumerate(shape)], dtype=torch.float64)
    w, norms = aten._weight_norm_interface(v, g, dim)
    grad_w = torch.randn_like(w)
    expected = aten._weight_norm_interface_backward(grad_w, v, g, norms, dim)
    got = decompositions.weight_norm_interface_backward(grad_w, v, g, norms, dim)
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize(
    ("dim", "start", "end", "step"),
    [(0, 0, 2, 1), (1, 1, 4, 1), (2, -3, 9223372036854775807, 1), (1, -10, -1, 1), (2, 0, 5, 2)],
)
def test_slice_backward_equals_atens(dim: int, start: int, end: int, step: int) -> None:
    sizes = [3, 4, 5]
    x = torch.randn(*sizes)
    g = torch.randn_like(aten.slice(x, dim, start, end, step))
    expected = aten.slice_backward(g, sizes, dim, start, end, step)
    got = decompositions.slice_backward(g, sizes, dim, start, end, step)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "size"),
    [([2, 2], [2, 2], [0, 0], 8), ([3, 3], [], [0, 0], 9), ([2, 3], [2, 3], [0, 0], 6)],
)
def test_tiling_max_pool_and_its_backward_equal_atens(
    kernel: list[int], stride: list[int], padding: list[int], size: int
) -> None:
    x = torch.randn(2, 3, size, size)
    x[0, 0, :2, :2] = 1.0  # a tie: the first maximum wins, as in ATen
    x[1, 1] = 0.0  # all ties (a ReLU's zeros)
    out, indices = aten.max_pool2d_with_indices(x, kernel, stride, padding)
    got_out, got_indices = windows.max_pool2d_with_indices(x, kernel, stride, padding)
    torch.testing.assert_close(got_out, out)
    assert torch.equal(got_indices, indices)
    g = torch.randn_like(out)
    expected = aten.max_pool2d_with_indices_backward(
        g, x, kernel, stride, padding, [1, 1], False, indices
    )
    got = windows.max_pool2d_with_indices_backward(
        g, x, kernel, stride, padding, [1, 1], False, indices
    )
    torch.testing.assert_close(got, expected)


def test_tiling_max_pool_backward_treats_signed_zeros_as_ties_like_aten() -> None:
    x = torch.tensor([[[[-0.0, 0.0], [0.0, -1.0]], [[-1.0, -0.0], [0.0, -0.0]]]])
    _, indices = aten.max_pool2d_with_indices(x, [2, 2], [2, 2], [0, 0])
    g = torch.tensor([[[[3.0]], [[5.0]]]])
    expected = aten.max_pool2d_with_indices_backward(
        g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices
    )
    got = windows.max_pool2d_with_indices_backward(
        g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices
    )
    assert torch.equal(got, expected)


def test_overlapping_max_pool_keeps_atens_operator() -> None:
    x = torch.randn(1, 1, 7, 7)
    assert windows.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1]) is NotImplemented
    out, indices = aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1])
    g = torch.randn_like(out)
    expected = aten.max_pool2d_with_indices_backward(
        g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, indices
    )
    got = windows.max_pool2d_with_indices_backward(
        g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, indices
    )
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (2, 4, 5, 3), (2, 4, 3, 2, 3)])
def test_batch_norm_equals_atens_outputs_and_running_statistics(
    training: bool, affine: bool, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64) * 3 + 1
    channels = shape[1]
    weight = torch.randn(channels, dtype=torch.float64) if affine else None
    bias = torch.randn(channels, dtype=torch.float64) if affine else None
    mean, var = torch.randn(channels, dtype=torch.float64), torch.rand(channels) + 0.5
    args = (x, weight, bias, mean, var.double(), training, 0.1, 1e-5)
    expected = aten._native_batch_norm_legit_functional(*args)
    got = norms.native_batch_norm_legit_functional(*args)
    names = ("output", "mean", "inverse deviation", "running mean", "running variance")
    for name, a, e in zip(names, got, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        torch.testing.assert_close(a, e, msg=name)


def test_half_precision_batch_norm_computes_in_float_like_aten() -> None:
    torch.manual_seed(0)
    x = (torch.randn(4, 3, 5, 5) * 3 + 1).to(torch.bfloat16)
    weight, bias = torch.randn(3), torch.randn(3)
    args = (x, weight, bias, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5)
    expected = aten._native_batch_norm_legit_functional(*args)
    got = norms.native_batch_norm_legit_functional(*args)
    for a, e in zip(got, expected, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bernoulli_p_draws_zeros_and_ones_at_rate_p_in_the_inputs_dtype(
    p: float, dtype: torch.dtype
) -> None:
    x = torch.empty(200, 300, dtype=dtype)
    drawn = decompositions.bernoulli_p(x, p)
    assert drawn.dtype == dtype and drawn.shape == x.shape
    assert bool(((drawn == 0) | (drawn == 1)).all())
    assert abs(float(drawn.mean()) - p) < 0.01


def _attention_mask(kind: str, length: int, keys: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Masks as `scaled_dot_product_attention` hands them to the flash kernel (a boolean one
    already made 0 / -inf): rows with every key masked, by -inf or by the dtype's minimum
    (transformers' padding masks), are the cases where the kernel is not the softmax."""
    generator = torch.Generator().manual_seed(1)
    if kind == "none":
        return None
    if kind == "random":
        return torch.randn(2, 1, length, keys, generator=generator, dtype=dtype)
    mask = torch.zeros(2, 1, length, keys, dtype=dtype)
    if kind == "bool":
        dropped = torch.rand(2, 1, length, keys, generator=generator) > 0.6
        return mask.masked_fill(dropped, -math.inf)
    fill = torch.finfo(dtype).min if kind == "minimum" else -math.inf
    mask[0, :, 1] = fill  # one query row with every key masked
    mask[1, :, :, keys // 2 :] = fill  # padding: half the keys masked for every query
    if kind == "minimum":
        mask[0, :, 2:] = fill  # most of a sequence masked
    return mask


@pytest.mark.parametrize("kind", ["none", "random", "bool", "minimum", "infinity"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("length", "keys"), [(5, 5), (4, 7)])
@pytest.mark.parametrize("layout", ["contiguous", "heads-transposed"])
def test_flash_attention_for_cpu_and_its_backward_equal_atens(
    kind: str, causal: bool, length: int, keys: int, layout: str
) -> None:
    torch.manual_seed(0)

    def make(n: int) -> torch.Tensor:
        if layout == "contiguous":
            return torch.randn(2, 3, n, 8)
        return torch.randn(2, n, 3, 8).transpose(1, 2)  # as attention layers hand them over

    q, k, v = make(length), make(keys), make(keys)
    mask = _attention_mask(kind, length, keys, q.dtype)
    args = (0.0, causal)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, *args, attn_mask=mask)
    got_out, got_lse = decompositions.scaled_dot_product_flash_attention_for_cpu(
        q, k, v, *args, attn_mask=mask
    )
    torch.testing.assert_close(got_out, out)
    torch.testing.assert_close(got_lse, lse)
    assert got_out.stride() == out.stride() and got_lse.stride() == lse.stride()
    grad = torch.randn_like(out)
    expected = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, *args, attn_mask=mask
    )
    got = decompositions.scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, *args, attn_mask=mask
    )
    for name, a, e in zip("qkv", got, expected, strict=True):
        torch.testing.assert_close(a, e, msg=f"gradient of {name}")


def test_flash_attention_for_cpu_in_float64_with_a_scale_equals_atens() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    mask = _attention_mask("minimum", 6, 6, torch.float64)
    kwargs = {"attn_mask": mask, "scale": 0.3}
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, **kwargs)
    got = decompositions.scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, **kwargs)
    torch.testing.assert_close(got[0], out)
    torch.testing.assert_close(got[1], lse)
    grad = torch.randn_like(out)
    expected = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, **kwargs
    )
    got_grads = decompositions.scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, **kwargs
    )
    for a, e in zip(got_grads, expected, strict=True):
        torch.testing.assert_close(a, e)


def _decoder_mask(shape: str, fill: float, length: int, dtype: torch.dtype) -> torch.Tensor:
    """A decoder's additive mask (OPT's: causal and padding in one, `is_causal` off) at one of
    the ranks the kernel takes (2-D, or 4-D broadcast over batch and heads or not): sequence 0
    left-padded by 3, so its first 3 query rows mask every key, and query row 1 fully masked."""
    above = torch.ones(length, length, dtype=torch.bool).triu(1)
    masked = above.expand(2, 4, length, length).clone()
    masked[0, :, :, :3] = True
    masked[:, :, 1] = True
    if shape == "2-d":
        masked = masked[1, 0]
    elif shape == "batch":
        masked = masked[:, :1]
    elif shape == "one":
        masked = masked[1:, :1]
    return torch.zeros(masked.shape, dtype=dtype).masked_fill(masked, fill)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True], ids=["mask", "mask+causal"])
@pytest.mark.parametrize("shape", ["2-d", "batch", "one", "heads"])
@pytest.mark.parametrize("fill", ["minimum", "infinity"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_flash_attention_for_cpu_with_decoder_padding_masks_equals_atens(
    dtype: torch.dtype,
    causal: bool,
    shape: str,
    fill: str,
    kv_heads: int,
    scale: float | None,
) -> None:
    """Issue 35 (OPT's zoo entry, 3.4x off its reference when traced with this kernel) held
    the decomposition to ATen's kernel at OPT's case and around it: every mask rank the kernel
    takes (boolean masks reach it as 0 / -inf, `scaled_dot_product_attention` converts them),
    rows fully masked by the mask and by the mask with `is_causal`, grouped key heads, OPT's
    scale of 1 (its query comes scaled). None differed: the 3.4x was the reference's, run on
    the math kernel where eager takes this one."""
    torch.manual_seed(0)
    length = 6
    q = torch.randn(2, length, 4, 8, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(2, length, kv_heads, 8, dtype=dtype).transpose(1, 2) for _ in range(2))
    value = torch.finfo(dtype).min if fill == "minimum" else -math.inf
    mask = _decoder_mask(shape, value, length, dtype)
    args = (0.0, causal)
    kwargs = {"attn_mask": mask, "scale": scale}
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, *args, **kwargs)
    got_out, got_lse = decompositions.scaled_dot_product_flash_attention_for_cpu(
        q, k, v, *args, **kwargs
    )
    torch.testing.assert_close(got_out, out)
    torch.testing.assert_close(got_lse, lse)
    grad = torch.randn_like(out)
    expected = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, *args, **kwargs
    )
    got = decompositions.scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, *args, **kwargs
    )
    for name, a, e in zip("qkv", got, expected, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, msg=f"gradient of {name}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [2, 4])
def test_flash_attention_for_cpu_with_grouped_key_heads_equals_atens(
    causal: bool, group: int
) -> None:
    """Grouped query attention (`enable_gqa`): the kernel reads key and value head h // group
    for query head h, and its backward sums each group's gradients onto its head."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8)
    k, v = (torch.randn(2, 4 // group, 5, 8) for _ in range(2))
    mask = _attention_mask("random", 5, 5, q.dtype)
    args = (0.0, causal)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, *args, attn_mask=mask)
    got_out, got_lse = decompositions.scaled_dot_product_flash_attention_for_cpu(
        q, k, v, *args, attn_mask=mask
    )
    torch.testing.assert_close(got_out, out)
    torch.testing.assert_close(got_lse, lse)
    grad = torch.randn_like(out)
    expected = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, *args, attn_mask=mask
    )
    got = decompositions.scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, *args, attn_mask=mask
    )
    for name, a, e in zip("qkv", got, expected, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, msg=f"gradient of {name}")


@pytest.mark.parametrize("translated", ["none", "every other", "all"])
def test_the_tables_base_is_the_exporters_choice(translated: str) -> None:
    """The table's base is what the exporter's `create_onnx_friendly_decomposition_table`
    gives for the same translated operators (read from torch's tables once a process rather
    than on each call): the same operators, each with the same decomposition."""
    from torch.onnx._internal.exporter import _decomp

    # read anew, as the exporter reads them: operators registered since this process's first
    # read (c10d's functional collectives, once a test imported them) join both tables
    decompositions._torch_tables.cache_clear()
    every = sorted(decompositions.decomposable(), key=str)
    chosen = {"none": [], "every other": every[::2], "all": every}[translated]
    ours = decompositions._exporter_table(frozenset(chosen))
    theirs = _decomp.create_onnx_friendly_decomposition_table(set(chosen))
    assert list(ours) == list(theirs)
    assert [_function(f) for f in ours.values()] == [_function(f) for f in theirs.values()]
    assert translated == "all" or len(ours) > 500


def _function(decomposition: object) -> object:
    """A decomposition as what it runs: a composite operator's is a partial of a closure,
    both made anew each time torch's default table is read."""
    if isinstance(decomposition, functools.partial):
        function = decomposition.func
        return function.__qualname__, decomposition.args, decomposition.keywords
    return decomposition
