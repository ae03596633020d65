"""The plain backend (inference-only onnxruntime, graphs from torch's autograd) against eager:
outputs, gradients and buffer updates, call by call, for every entry of its decomposition
table, and its refusals."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests.plain_helpers import PLAIN_READY, SKIP_REASON, PlainCall, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)

Loss = Callable[[torch.Tensor], torch.Tensor]


def _square(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _train_like_eager(
    model: nn.Module,
    make_inputs: Callable[[], tuple[torch.Tensor, ...]],
    steps: int = 3,
    loss: Loss = _square,
    rtol: float = 1e-4,
) -> PlainCall:
    """Train a copy eagerly and the model through the plain backend, step by step; compare
    losses, every gradient (inputs' included) and every buffer after each step."""
    torch.manual_seed(0)
    eager = copy.deepcopy(model)
    inputs = make_inputs()
    plain = PlainCall(model, *inputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.05)
    for step in range(steps):
        inputs = make_inputs()
        ours = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out = plain(*ours)
        expected = eager(*inputs)
        assert ran_in_plain_ort(out), f"step {step} did not run in ORT"
        got_loss, eager_loss = loss(out), loss(expected)
        torch.testing.assert_close(got_loss, eager_loss, rtol=rtol, atol=1e-6)
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        got_loss.backward()
        eager_loss.backward()
        # one scale per step: a gradient that is zero in exact arithmetic (a bias before
        # BatchNorm) is float32 noise on both sides
        scale = max(float(q.grad.abs().max()) for q in eager.parameters()) + 1e-6
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            assert p.grad is not None, name
            torch.testing.assert_close(
                p.grad, q.grad, rtol=0, atol=rtol * scale, msg=f"step {step}: {name}.grad"
            )
        for a, b in zip(ours, inputs, strict=True):
            if b.requires_grad:
                assert a.grad is not None and b.grad is not None
                bound = rtol * max(scale, float(b.grad.abs().max()))
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=bound)
        for (name, a), b in zip(model.named_buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
        optimizer.step()
        eager_optimizer.step()
    return plain


def test_mlp_trains_with_eagers_gradients_and_sees_the_optimizers_updates() -> None:
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    _train_like_eager(model, lambda: (torch.randn(8, 20),), steps=4)


def test_a_weight_backward_reads_untransposed_is_handed_over_not_copied_by_forward() -> None:
    """The partitioner saves `t(t(fc2.weight))` for the hidden layer's gradient: the forward
    graph returns no copy of the weight; the program hands backward the parameter itself,
    with eager's gradients and eager's error for an in-place write before backward."""
    import onnx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    plain = _train_like_eager(model, lambda: (torch.randn(8, 20),), steps=2)
    forward = onnx.load_from_string(plain.lowered.forward)
    assert "Identity" not in {node.op_type for node in forward.graph.node}
    assert len(forward.graph.output) == 2  # the logits and the hidden activation
    weight = [f.where for f in plain.lowered.feeds].index("2.weight")
    assert ("in", weight) in plain.lowered.forward_outputs
    out = plain(torch.randn(8, 20))
    with torch.no_grad():
        model[2].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()


@pytest.mark.parametrize(
    ("shape", "chain", "identity"),
    [
        ((2, 3), lambda w: w.t().t(), True),
        ((2, 3, 4), lambda w: w.transpose(0, 2).transpose(2, 0), True),
        ((2, 3, 4), lambda w: w.permute(1, 2, 0).permute(2, 0, 1), True),
        ((2, 3, 4), lambda w: w.permute(1, 2, 0).transpose(0, 1), False),
        ((2, 3), lambda w: w.t(), False),
    ],
)
def test_transposes_that_undo_each_other_are_the_feed_itself_and_others_are_kept(
    shape: tuple[int, ...], chain: Callable[[torch.Tensor], torch.Tensor], identity: bool
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    w = torch.arange(float(torch.Size(shape).numel())).view(shape)
    assert torch.equal(chain(w), w) is identity
    gm = make_fx(lambda w: chain(w) * 2)(w)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    assert fx_passes._unpermuted(mul.args[0]) is (placeholder if identity else None)


@pytest.mark.parametrize(
    ("reduce", "folded"),
    [
        (lambda x: x.sum([0], keepdim=True).view(3, 4), True),
        (lambda x: x.sum([0, -1], keepdim=True).reshape(3), True),
        (lambda x: x.sum([0], keepdim=True).view(1, 3, 4), False),  # keeps the dim's place
        (lambda x: x.sum([0], keepdim=True).view(12), False),  # not the reduced shape
    ],
)
def test_a_sum_keeping_dims_a_view_then_drops_is_one_sum_without_them(
    reduce: Callable[[torch.Tensor], torch.Tensor], folded: bool
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    x = torch.randn(2, 3, 4)
    gm = make_fx(lambda x: reduce(x) * 2)(x)
    fx_passes.sums_without_kept_dims(gm)
    reshapes = [n for n in gm.graph.nodes if n.target in fx_passes._RESHAPES]
    assert bool(reshapes) is not folded
    assert torch.equal(gm(x), reduce(x) * 2)


@pytest.mark.parametrize(
    ("chain", "left"),
    [
        # BatchNorm's gradient: (C,) to (1, C, 1, 1) one dim at a time
        (lambda x: x.sum([0, 2]).unsqueeze(0).unsqueeze(-1), 1),
        # its saved mean: (1, C, 1) -> (C,) -> (1, C, 1), the value itself
        (lambda x: x.mean([0, 2], keepdim=True).view(-1).unsqueeze(0).unsqueeze(-1), 0),
        (lambda x: x.sum([0]).view(12).view(3, 4).unsqueeze(0).squeeze(0), 0),
        (lambda x: x.sum([0]).view(12).view(2, 6).view(1, 12), 1),
        # reshape copies a transposed value first: the chain starts from the copy
        (lambda x: x.sum([0]).t().reshape(12).view(4, 3), 0),
        # a view of the transposed value itself would be another order: left as it is
        (lambda x: x.sum([0]).t().unsqueeze(0).unsqueeze(-1), 2),
    ],
)
def test_a_chain_of_reshapes_is_one_reshape_or_none(
    chain: Callable[[torch.Tensor], torch.Tensor], left: int
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    x = torch.randn(2, 3, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return chain(x) * 2

    gm = make_fx(f)(x)
    fx_passes.reshape_chains_as_one(gm)
    shaped = [n for n in gm.graph.nodes if n.target in fx_passes._SHAPE_ONLY]
    assert len(shaped) == left, gm.graph
    assert torch.equal(gm(x), f(x))


@pytest.mark.parametrize(
    ("expand", "left"),
    [
        (lambda x: x.sum([0, 1]).expand(4), 0),  # rank 1, to its own shape
        (lambda x: x.sum([0]).expand(3, 4), 0),
        (lambda x: x.sum([0]).expand(-1, 4), 0),  # -1: the size it has
        (lambda x: x.view(1, 2, 3, 4).expand(1, 2, 3, 4), 0),  # rank 4, what bmm's makes
        (lambda x: x.sum([0], keepdim=True).expand(2, 3, 4), 1),  # broadcasts: kept
        (lambda x: x.sum([0]).expand(5, 3, 4), 1),  # a new leading dimension: kept
        (lambda x: x.sum([]).expand(()), 0),  # rank 0
    ],
)
def test_an_expand_to_the_shape_its_value_has_is_the_value(
    expand: Callable[[torch.Tensor], torch.Tensor], left: int
) -> None:
    """A batched matmul's decomposition expands both operands to the batch shape they have:
    ONNX Runtime copied the tensor for each such Expand (15 a GPT-2 layer)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    x = torch.randn(2, 3, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return expand(x).sin()

    gm = make_fx(f)(x)
    fx_passes.reshape_chains_as_one(gm)
    expands = [n for n in gm.graph.nodes if n.target is torch.ops.aten.expand.default]
    assert len(expands) == left, gm.graph
    assert torch.equal(gm(x), f(x))


def test_attention_trains_like_eager_with_no_expand_to_its_own_shape() -> None:
    """End to end: scaled dot-product attention written out (two batched matmuls, as GPT-2's
    and BERT's eager attention), trained through the plain backend with eager's numbers,
    and no Expand left in either graph that broadcasts nothing."""
    import onnx

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 5, 3, 4, 4).permute(2, 0, 3, 1, 4)
            weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
            return (weights @ v).transpose(1, 2).reshape(2, 5, 16)

    plain = _train_like_eager(Attention(), lambda: (torch.randn(2, 5, 16),), steps=2)
    for model in (plain.lowered.forward, plain.lowered.backward):
        assert model is not None
        graph = onnx.load_from_string(model)
        inferred = onnx.shape_inference.infer_shapes(graph).graph
        shapes = {
            v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*inferred.value_info, *inferred.input, *inferred.output]
        }
        for node in graph.graph.node:
            if node.op_type == "Expand":
                assert shapes.get(node.input[0]) != shapes.get(node.output[0]), node


def test_a_reshape_chain_a_graph_outputs_ends_in_a_node_of_its_own_or_the_value() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    x = torch.randn(2, 3, 4)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mean = x.mean([0, 2], keepdim=True)
        back = mean.view(-1).unsqueeze(0).unsqueeze(-1)  # (1, 3, 1) again
        return back, x.view(-1).unsqueeze(0).squeeze(0).view(2, 3, 4), x.sum(0).view(12)

    gm = make_fx(f)(x)
    fx_passes.reshape_chains_as_one(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    first, second, third = output.args[0]
    assert first.target is torch.ops.aten.mean.dim  # the mean itself, not a copy of it
    assert second.target in fx_passes._SHAPE_ONLY  # a feed's view stays a node of its own
    assert third.target in fx_passes._SHAPE_ONLY
    for got, expected in zip(gm(x), f(x), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("chain", "left"),
    [
        (lambda x: x.sum([0]).t().t(), 0),  # undone: the value itself
        (lambda x: x.permute(2, 0, 1).permute(1, 2, 0), 0),
        (lambda x: x.transpose(0, 2).transpose(0, 2), 0),
        (lambda x: x.transpose(0, 1).permute(2, 1, 0), 1),  # two orders: one permute
        (lambda x: x.permute(1, 2, 0).transpose(-1, -2).transpose(0, -1), 1),  # negative dims
        (lambda x: x.sum([0]).t().t().unsqueeze(0).transpose(1, 2), 1),
    ],
)
def test_transposes_of_a_transpose_are_one_permute_or_none(
    chain: Callable[[torch.Tensor], torch.Tensor], left: int
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    x = torch.randn(2, 3, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return chain(x).sin()  # the transposed value read by a node, not output as a view

    gm = make_fx(f)(x)
    fx_passes.transposes_composed(gm)
    transposes = [n for n in gm.graph.nodes if n.target in fx_passes._TRANSPOSES]
    assert len(transposes) == left, gm.graph
    assert torch.equal(gm(x), f(x))


def test_a_transpose_chain_a_graph_outputs_is_the_value_or_a_node_of_its_own() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    x, w = torch.randn(3, 4), torch.randn(5, 4)

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grad = (x.t() @ torch.ones(3, 5)).t().t()  # a tied weight's gradient, as aot made it
        return grad, w.t().t(), x.sum(0)

    gm = make_fx(f)(x, w)
    fx_passes.transposes_composed(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    first, second, _ = output.args[0]
    assert first.target is torch.ops.aten.mm.default  # the product itself, not a copy
    assert second.target in fx_passes._TRANSPOSES  # an input's view keeps a node of its own
    for got, want in zip(gm(x, w), f(x, w), strict=True):
        assert torch.equal(got, want) and got.stride() == want.stride()


class _TiedLM(nn.Module):
    """An embedding whose weight is also the output projection (GPT-2's, BERT's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(ids)))
        return h @ self.embed.weight.t()


def test_a_tied_embeddings_gradient_is_no_transpose_of_a_transpose_and_no_copy() -> None:
    """The gradient of a weight used as an embedding and transposed as the output projection:
    the product's transpose transposed back, and torchlib's `index_put` with a Transpose
    that keeps every dimension before and after its ScatterND, were four copies of the
    weight a step (GPT-2 small's 147 MiB each), and the embedding's part was scattered into
    zeros and then added to the projection's. None is left; gradients equal eager's."""
    import onnx

    ids = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(0))
    plain = _train_like_eager(_TiedLM(), lambda: (ids,), steps=2)
    assert plain.lowered.backward is not None
    graph = onnx.load_from_string(plain.lowered.backward).graph
    made = {out: node for node in graph.node for out in node.output}
    for node in graph.node:
        if node.op_type != "Transpose":
            continue
        perm = list(next(a.ints for a in node.attribute if a.name == "perm"))
        assert perm != list(range(len(perm))), node
        source = made.get(node.input[0])
        assert source is None or source.op_type != "Transpose", node
    # the embedding's values are scattered into the projection's gradient, not into zeros
    # then added to it
    into, result = _scattered_into(plain)
    assert into not in ("ConstantOfShape", "Cast", "CastLike")
    assert not any(n.op_type == "Add" and result in n.input for n in graph.node)


def _scattered_into(plain: PlainCall) -> tuple[str | None, str]:
    """The backward's one accumulating scatter (an embedding's gradient): the operator making
    the tensor its rows are added into (None for a graph input), and that output's name.
    ONNX Runtime scatters into a graph output only after copying it whole
    (`onnx_passes.accumulations_into_outputs_left_to_torch`): the graph returns the tensor,
    the rows and the values, and torch adds them in place (`GraphFacts.added`). No scatter
    is left in the graph, and no Reshape makes the tensor (a copy too)."""
    import onnx

    assert plain.lowered.backward is not None
    graph = onnx.load_from_string(plain.lowered.backward).graph
    made = {out: node for node in graph.node for out in node.output}
    assert not [n for n in graph.node if n.op_type in ("ScatterND", "ScatterElements")]
    [(k, (rows, values))] = plain.lowered.facts["backward"].added.items()
    name = graph.output[k].name
    assert [graph.output[rows].name, graph.output[values].name] == [
        f"{name}.rows",
        f"{name}.values",
    ]
    data = made.get(name)
    assert data is None or data.op_type != "Reshape", data
    return (None if data is None else data.op_type), name


class _TiedAcrossModules(nn.Module):
    """An embedding and an output projection holding one weight, as transformers ties them
    (GPT-2's `lm_head.weight` is `wte.weight`): aot feeds it once per module."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=bias)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


@pytest.mark.parametrize("bias", [False, True])
def test_a_weight_two_modules_hold_gets_one_gradient_summed_in_the_graph(bias: bool) -> None:
    """Fed once per module, the tied weight had two gradients out of backward, the
    embedding's scattered into zeros (GPT-2 small's 147 MiB filled, copied, then added in
    torch). Its gradient is one output now, the embedding's values scattered into the
    projection's; training equals eager's, and a weight untied later gets its own."""
    import onnx

    ids = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(0))
    model = _TiedAcrossModules(bias)
    plain = _train_like_eager(model, lambda: (ids,), steps=2)
    feeds = plain.captured.feeds
    (again, first), *others = plain.captured.tied.items()
    assert not others
    assert (feeds[again].where, feeds[first].where) == ("head.weight", "embed.weight")
    assert plain.lowered.backward is not None
    graph = onnx.load_from_string(plain.lowered.backward).graph
    # one gradient each, and the embedding's rows and values, which torch adds
    assert len(graph.output) == len(list(model.parameters())) + 2
    assert _scattered_into(plain)[0] not in ("ConstantOfShape", "Cast", "CastLike")
    # untied: each weight its own gradient, as in eager
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    _train_like_eager(model, lambda: (ids,), steps=2)


def test_tied_gradients_are_left_to_autograd_whole_where_outputs_are_not_one_per_feed() -> None:
    """A graph whose outputs do not line up with its feeds keeps every gradient as it was:
    no tie summed, and no sum made for one tie and left unused when a later one is out of
    range."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    a, b = torch.randn(3), torch.randn(3)
    gm = make_fx(lambda a, b: (a.sin(), b.cos()))(a, b)
    before = [n.target for n in gm.graph.nodes]
    fx_passes.tied_gradients_summed(gm, {1: 0, 2: 0})
    assert [n.target for n in gm.graph.nodes] == before
    fx_passes.tied_gradients_summed(gm, {1: 0})  # in range: summed under the first
    assert torch.equal(gm(a, b)[0], a.sin() + b.cos()) and gm(a, b)[1] is None


_aten = torch.ops.aten


#: (a's shape, the index tensors, the values' shape) of a scatter into zeros of a's shape
_SCATTER_LAYOUTS = {
    "rows": ((6, 4), lambda: [torch.tensor([3, 0, 3, 5, 3])], (5, 4)),  # an embedding's
    "elements": ((6,), lambda: [torch.tensor([3, 0, 3, 5, 3])], (5,)),
    "ids in a batch": ((6, 4), lambda: [torch.tensor([[3, 0, 3], [5, 3, 1]])], (2, 3, 4)),
    "two indices": ((4, 5, 3), lambda: [torch.tensor([1, 0, 1]), torch.tensor([4, 2, 4])], (3, 3)),
}


def _scatter_sum(zeros: str, put: object, first: bool, layout: str = "rows"):
    """A function of (a, values, *indices) adding `a` and values put with accumulation into
    zeros made by `zeros` (`a`'s term first or second), as a tied embedding's gradient is;
    and its arguments."""
    shape, indices, values_shape = _SCATTER_LAYOUTS[layout]

    def f(a: torch.Tensor, values: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
        made = {
            "new_zeros": lambda: values.new_zeros(shape),
            "zeros": lambda: torch.zeros(shape),
            "zeros_like": lambda: torch.zeros_like(torch.empty(shape)),
        }[zeros]()
        scattered = put(made, list(index), values, True)  # type: ignore[operator]
        return (a + scattered if first else scattered + a).sin()

    return f, (torch.randn(*shape), torch.randn(*values_shape), *indices())


@pytest.mark.parametrize("layout", list(_SCATTER_LAYOUTS))
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("put", [_aten.index_put.default, _aten._unsafe_index_put.default])
@pytest.mark.parametrize("zeros", ["new_zeros", "zeros", "zeros_like"])
def test_values_scattered_into_zeros_and_added_are_scattered_into_the_sum(
    zeros: str, put: object, first: bool, layout: str
) -> None:
    """A tied embedding's gradient: the embedding's part scattered into zeros, added to the
    projection's. The values go into the projection's term at once: no zeros, no Add, at
    every rank and with several index tensors; through ONNX Runtime too (an index given
    more than once: added in turn, equal to eager's within rounding)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    f, args = _scatter_sum(zeros, put, first, layout)
    gm = make_fx(f)(*args)
    fx_passes.scatters_added_into_the_sum(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert _aten.add.Tensor not in targets and not set(targets) & fx_passes._ZEROS, gm.graph
    torch.testing.assert_close(gm(*args), f(*args), rtol=1e-6, atol=1e-6)
    _, (ran,) = _lowered_and_run(f, *args, rewrite=fx_passes.scatters_added_into_the_sum)
    torch.testing.assert_close(ran, f(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kept",
    [
        "broadcast",  # `a` of another shape: the sum broadcasts it
        "scatter broadcast",  # the scattered rows broadcast over `a`'s
        "promoted",  # `a` of another type: the sum promotes
        "not accumulated",  # index_put without accumulation replaces: no sum to fold
        "zeros read elsewhere",
        "alpha",  # a + 2 * scattered
        "itself",  # scattered + scattered: no other term to scatter into
    ],
)
def test_a_sum_the_scatter_cannot_take_keeps_its_add(kept: str) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    a, values, index = torch.randn(6, 4), torch.randn(5, 4), torch.tensor([3, 0, 3, 5, 3])

    def f(a: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        zeros = values.new_zeros((6, 4))
        scattered = _aten.index_put.default(zeros, [index], values, kept != "not accumulated")
        if kept == "broadcast":
            return (a[:1] + scattered).sin()
        if kept == "scatter broadcast":
            one = _aten.index_put.default(values.new_zeros((1, 4)), [index * 0], values, True)
            return (a + one).sin()
        if kept == "promoted":
            return (a.double() + scattered).sin()
        if kept == "zeros read elsewhere":
            return (a + scattered).sin() + zeros.sum()
        if kept == "alpha":
            return torch.add(a, scattered, alpha=2).sin()
        if kept == "itself":
            return (scattered + scattered).sin()
        return (a + scattered).sin()

    gm = make_fx(f)(a, values, index)
    fx_passes.scatters_added_into_the_sum(gm)
    assert any(n.target is _aten.add.Tensor for n in gm.graph.nodes), gm.graph
    torch.testing.assert_close(gm(a, values, index), f(a, values, index))


def _lowered_and_run(
    f: Callable[..., object], *args: torch.Tensor, rewrite: Callable[..., None] | None = None
) -> tuple[Any, list]:
    """`f` traced on fakes (then `rewrite`, an FX pass, if given), lowered alone, and run by
    ONNX Runtime on `args`: its ONNX graph, and the outputs as torch tensors (through DLPack:
    numpy has no bfloat16)."""
    import onnx
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine import dlpack, session
    from ort_autopatch.engine.backends.ort import lowering

    gm = make_fx(f, tracing_mode="fake")(*args)
    if rewrite is not None:
        rewrite(gm)
    model = lowering.to_onnx(gm, "M", "forward")
    dlpack.use_inference_dlpack()
    device = torch.device("cpu")
    made, _ = session.create(model, device, session.SessionSettings(threads=1), "M", False)
    outputs = session.RunnableSession.of(made, device, None).run(list(args))
    return onnx.load_from_string(model).graph, outputs


_FILLED_TYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 1, 3, 2)])
@pytest.mark.parametrize("dtype", _FILLED_TYPES)
def test_new_zeros_and_ones_are_made_in_their_type_not_cast_after(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """torchlib's `new_zeros` fills a float32 tensor and casts it to the type it should have
    (a float32 one too: a copy of the whole tensor, an embedding gradient's 147 MiB). The fill
    is made in that type instead, the cast dropped: equal values, dtype and shape, every
    type torch makes such tensors in, at every rank."""

    def made(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.new_zeros(shape, dtype=dtype), x.new_ones(shape, dtype=dtype)

    x = torch.randn(3, 4)
    graph, outputs = _lowered_and_run(made, x)
    producers = {out: node.op_type for node in graph.node for out in node.output}
    for node in graph.node:
        if node.op_type in ("Cast", "CastLike"):
            assert producers.get(node.input[0]) != "ConstantOfShape", node
    for got, want in zip(outputs, made(x), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [t for t in _FILLED_TYPES if t is not torch.bfloat16])
def test_filled_tensors_of_every_type_keep_eagers_values(dtype: torch.dtype) -> None:
    """`new_full`, `full_like` and `zeros_like` beside `new_zeros`, converting their fill to
    the type as torch does (2.5 to an integer is 2, to bool True). (bfloat16 is left out:
    ONNX Runtime's CPU Expand, which these broadcast with, has no bfloat16 kernel.)"""

    def made(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            x.new_zeros(2, 3, dtype=dtype),
            x.new_full((2, 2), 2.5, dtype=dtype),
            torch.full_like(x, 2.5, dtype=dtype),
            torch.zeros_like(x, dtype=dtype),
        )

    x = torch.randn(3, 4)
    _, outputs = _lowered_and_run(made, x)
    for got, want in zip(outputs, made(x), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _pads_of_parts(sizes: tuple[int, ...], dim: int, widths: list[int], order: list[int]):
    """A function summing, in `order`, the zero pads that put parts of `widths` side by side
    along `dim` of a tensor of `sizes` (what `select_backward` and `slice_backward` write
    for the parts' gradients), and the parts."""
    aten = torch.ops.aten
    rank, starts = len(sizes), [sum(widths[:k]) for k in range(len(widths))]
    parts = [torch.randn(*sizes[:dim], w, *sizes[dim + 1 :]) for w in widths]

    def summed(*parts: torch.Tensor) -> torch.Tensor:
        total = None
        for k in order:
            pads = [0, 0] * (rank - 1 - dim) + [starts[k], sizes[dim] - starts[k] - widths[k]]
            padded = aten.constant_pad_nd(parts[k], pads, 0.0)
            total = padded if total is None else total + padded
        return total * 2

    return summed, parts


_TILINGS = [
    ((3,), 0, [1, 1, 1], [0, 1, 2]),  # select_backward of q, k, v: widths of one
    ((3, 5), 0, [1, 1, 1], [2, 0, 1]),  # summed in another order than their places
    ((4, 6), 1, [2, 3, 1], [1, 2, 0]),  # slices of several widths
    ((2, 3, 4), 0, [1, 1], [0, 1]),
    ((2, 3, 4), 1, [1, 2], [1, 0]),
    ((2, 3, 4), 2, [1, 1, 1, 1], [3, 1, 0, 2]),
    ((3, 2, 4, 5), 0, [1, 1, 1], [0, 1, 2]),
    ((2, 3, 4, 6), 3, [2, 2, 2], [0, 2, 1]),  # chunk(3, -1) of a fused projection
]


@pytest.mark.parametrize(("sizes", "dim", "widths", "order"), _TILINGS)
def test_pads_of_parts_tiling_a_dimension_are_summed_as_one_cat(
    sizes: tuple[int, ...], dim: int, widths: list[int], order: list[int]
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    summed, parts = _pads_of_parts(sizes, dim, widths, order)
    gm = make_fx(summed)(*parts)
    fx_passes.pads_summed_into_cat(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert aten.constant_pad_nd.default not in targets and aten.add.Tensor not in targets
    assert targets.count(aten.cat.default) == 1
    assert torch.equal(gm(*parts), summed(*parts))


@pytest.mark.parametrize(
    ("sizes", "dim", "widths", "starts"),
    [
        ((4, 6), 1, [3, 4], [0, 2]),  # the parts overlap: their sum is no cat
        ((4, 6), 1, [2, 3], [0, 3]),  # a gap of zeros between them
        ((4, 6), 1, [2, 3], [1, 3]),  # zeros before the first
    ],
)
def test_pads_that_overlap_or_leave_gaps_stay_a_sum(
    sizes: tuple[int, ...], dim: int, widths: list[int], starts: list[int]
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    aten = torch.ops.aten
    parts = [torch.randn(*sizes[:dim], w, *sizes[dim + 1 :]) for w in widths]

    def summed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rest = [0, 0] * (len(sizes) - 1 - dim)
        pads = [[*rest, s, sizes[dim] - s - w] for s, w in zip(starts, widths, strict=True)]
        return aten.constant_pad_nd(a, pads[0], 0.0) + aten.constant_pad_nd(b, pads[1], 0.0)

    gm = make_fx(summed)(*parts)
    fx_passes.pads_summed_into_cat(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.cat.default not in targets and targets.count(aten.constant_pad_nd.default) == 2
    assert torch.equal(gm(*parts), summed(*parts))


@pytest.mark.parametrize(
    ("summed", "shapes"),
    [
        (  # padded with ones, not zeros
            lambda a, b: (
                torch.ops.aten.constant_pad_nd(a, [0, 1], 1.0)
                + torch.ops.aten.constant_pad_nd(b, [1, 0], 0.0)
            ),
            [(2, 1), (2, 1)],
        ),
        (  # the two pads move different dimensions
            lambda a, b: (
                torch.ops.aten.constant_pad_nd(a, [0, 1, 0, 0], 0.0)
                + torch.ops.aten.constant_pad_nd(b, [0, 0, 1, 0], 0.0)
            ),
            [(2, 1), (1, 2)],
        ),
        (  # a pad read elsewhere too
            lambda a, b: (
                (p := torch.ops.aten.constant_pad_nd(a, [0, 1], 0.0))
                + torch.ops.aten.constant_pad_nd(b, [1, 0], 0.0)
                + p.sum()
            ),
            [(2, 1), (2, 1)],
        ),
        (  # one part broadcast over the other's rows
            lambda a, b: (
                torch.ops.aten.constant_pad_nd(a, [0, 1], 0.0)
                + torch.ops.aten.constant_pad_nd(b, [1, 0], 0.0)
            ),
            [(2, 1), (1, 1)],
        ),
    ],
)
def test_pads_that_are_not_a_tiling_of_zeros_stay_a_sum(
    summed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shapes: list[tuple[int, ...]],
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    a, b = (torch.randn(*shape) for shape in shapes)
    gm = make_fx(summed)(a, b)
    fx_passes.pads_summed_into_cat(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.cat.default not in targets
    assert torch.equal(gm(a, b), summed(a, b))


class _SplitProjection(nn.Module):
    """q, k and v from one projection, taken by indexing as attention layers take them."""

    def __init__(self, split: str) -> None:
        super().__init__()
        self.split = split
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.qkv(x)
        if self.split == "select":  # nn.MultiheadAttention's packed projection: proj[0], ...
            proj = proj.unflatten(-1, (3, 8)).unsqueeze(0).transpose(0, -2).squeeze(-2)
            q, k, v = proj[0], proj[1], proj[2]
        else:  # slices of the last dimension
            q, k, v = proj[..., :8], proj[..., 8:16], proj[..., 16:]
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


@pytest.mark.parametrize("split", ["select", "slice"])
def test_the_gradient_of_a_split_projection_is_one_concat(split: str) -> None:
    import onnx

    plain = _train_like_eager(_SplitProjection(split), lambda: (torch.randn(2, 5, 8),), steps=2)
    assert plain.lowered.backward is not None
    ops = [node.op_type for node in onnx.load_from_string(plain.lowered.backward).graph.node]
    assert "Pad" not in ops and "Concat" in ops


class _Product(nn.Module):
    """A linear layer written as a product and a sum, as hand-written layers and attention
    projections are: ATen's `matmul` and `add`, whose autograd the graph passes meet (an
    `nn.Linear` is one operator of ours each way: `linears`)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


@pytest.mark.parametrize("activation", [nn.ReLU, nn.GELU, nn.Identity])
def test_forward_saves_no_reshape_for_backward(activation: type[nn.Module]) -> None:
    """Products over 3-d inputs reshape their inputs to matrices, and the partitioner saves
    the reshaped activation for the weight's gradient: forward saves what it reshaped instead
    (ONNX Runtime copies a Reshape whose output is a graph output), and backward reshapes
    it again, with eager's gradients. The call's own input stays reshaped: forward may write
    into an input, and the copy keeps what it read."""
    import onnx

    model = nn.Sequential(_Product(8, 16), activation(), _Product(16, 4))
    plain = _train_like_eager(model, lambda: (torch.randn(2, 5, 8, requires_grad=True),))
    forward = onnx.load_from_string(plain.lowered.forward).graph
    made_by = {out: node for node in forward.node for out in node.output}
    inputs = {value.name for value in forward.input}
    saved = [value.name for value in forward.output[len(plain.lowered.user_outputs) :]]
    reshaped = [made_by[name] for name in saved if made_by[name].op_type == "Reshape"]
    assert len(saved) >= 2 and all(node.input[0] in inputs for node in reshaped)


def _saved_by(plain: PlainCall) -> list[tuple[str, int]]:
    """The operator that makes each value forward saves for backward ("feed" for a view of
    an input: forward may write into the input, so the copy stays), and how many of
    forward's own nodes read that value."""
    import onnx

    forward = onnx.load_from_string(plain.lowered.forward).graph
    made_by = {out: node for node in forward.node for out in node.output}
    feeds = {value.name for value in forward.input}
    saved = [value.name for value in forward.output[len(plain.lowered.user_outputs) :]]

    def maker(name: str) -> str:
        node = made_by.get(name)
        if node is None or (node.op_type == "Reshape" and node.input[0] in feeds):
            return "feed"
        return node.op_type

    return [(maker(name), sum(name in node.input for node in forward.node)) for name in saved]


@pytest.mark.parametrize("layout", ["batch_first", "sequence_first"])
def test_attention_saves_no_copy_transpose_or_reshape_for_backward(layout: str) -> None:
    """Attention's batched products take transposed operands in backward, which the
    partitioner saves as transposes, and it saves copies (`clone`, `detach`) and reshapes:
    ONNX Runtime writes each of those out as a graph output. Forward saves the value they
    were made of instead (a Transpose only where forward reads it too), backward makes them
    again, and the gradients are eager's."""
    batch_first = layout == "batch_first"
    model = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first)
    plain = _train_like_eager(model, lambda: (torch.randn(3, 5, 16, requires_grad=True),))
    saved = _saved_by(plain)
    assert len(saved) > 8
    assert not [op for op, _ in saved if op in ("Identity", "Reshape", "Expand")], saved
    assert all(readers > 0 for op, readers in saved if op == "Transpose"), saved


class _MaskedTwice(nn.Module):
    """A gradient through dropout and ReLU: two masks, one after the other."""

    def __init__(self, dropout_first: bool, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.dropout_first = dropout_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.weight
        if self.dropout_first:
            return torch.relu(nn.functional.dropout(h, 0.3, training=True))
        return nn.functional.dropout(torch.relu(h), 0.3, training=True)


@pytest.mark.parametrize("shape", [(3000,), (4, 25, 30)], ids=["1d", "batch_sequence_features"])
@pytest.mark.parametrize("dropout_first", [False, True], ids=["relu_dropout", "dropout_relu"])
def test_a_gradient_through_two_masks_multiplies_by_one(
    dropout_first: bool, shape: tuple[int, ...]
) -> None:
    """Dropout's gradient multiplies by its scaled mask and ReLU's by its mask: backward
    multiplies the gradient by one mask, the two masks' And (the gradient is the dropout
    scale where both kept the element and 0 elsewhere, as eager's), also where the masks
    are broadcast against a parameter and the gradient is summed over leading dimensions."""
    import onnx

    model = _MaskedTwice(dropout_first, shape[-1])
    x = torch.linspace(-2, 2, math.prod(shape)).reshape(shape)
    plain = PlainCall(model, x)
    out = plain(x)
    assert ran_in_plain_ort(out)
    grad = torch.linspace(0.5, 1.5, math.prod(shape)).reshape(shape)
    out.backward(grad)
    assert model.weight.grad is not None
    kept = out.detach() != 0  # dropout kept it, ReLU passed it
    assert 0.2 < float(kept.float().mean()) < 0.5
    expected = torch.where(kept, grad * (1 / 0.7) * x, torch.zeros_like(x))
    expected = expected.reshape(-1, shape[-1]).sum(0)
    torch.testing.assert_close(model.weight.grad, expected)
    assert plain.lowered.backward is not None
    ops = [node.op_type for node in onnx.load_from_string(plain.lowered.backward).graph.node]
    assert ops.count("And") == 1 and ops.count("Cast") == 1, ops


class _Conv1D(nn.Module):
    """transformers' GPT-2 projection: the weight stored (in, out), `addmm(b, x, w)`; the
    input's gradient reads the weight transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 12) * 0.3)
        self.bias = nn.Parameter(torch.zeros(12))
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(self.bias, x.view(-1, 8), self.weight).view(*x.shape[:-1], 12)
        return self.out(torch.tanh(h))


def test_forward_saves_no_transposed_parameter_for_backward() -> None:
    """The partitioner saves a parameter's transpose for the input's gradient: forward
    saves the parameter itself (no run writes into it) and backward transposes it again,
    where ONNX Runtime had copied it out every step (GPT-2 small: 27 MiB a layer)."""
    import onnx

    plain = _train_like_eager(
        _Conv1D(), lambda: (torch.randn(2, 5, 8, requires_grad=True),), steps=2
    )
    forward = onnx.load_from_string(plain.lowered.forward).graph
    outputs, feeds = {o.name for o in forward.output}, {i.name for i in forward.input}
    written = [
        n
        for n in forward.node
        if n.op_type == "Transpose" and n.output[0] in outputs and n.input[0] in feeds
    ]
    assert not written, written  # (the input's own transpose stays: forward may write it)


@pytest.mark.parametrize("layer", [nn.Linear, _Product])
def test_a_linear_layers_bias_gradient_is_one_reduce_sum_without_a_reshape(
    layer: Callable[[int, int], nn.Module],
) -> None:
    import onnx

    model = nn.Sequential(layer(20, 32), nn.ReLU(), layer(32, 5))
    plain = _train_like_eager(model, lambda: (torch.randn(8, 20),), steps=2)
    assert plain.lowered.backward is not None
    backward = onnx.load_from_string(plain.lowered.backward)
    ops = [node.op_type for node in backward.graph.node]
    assert ops.count("ReduceSum") == 2 and "Reshape" not in ops


def test_the_capture_runs_the_passes_the_declaration_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The capture runs `passes.PARTITIONED` as declared when it runs: a pass taken out of the
    declaration leaves its effect out of the graphs (the bias gradient's reshape stays)."""
    from ort_autopatch.engine import signature
    from ort_autopatch.engine.backends.ort import capture, decompositions, fx_passes, passes

    def reshaped_sums() -> int:
        call = signature.flatten_call("M", (torch.randn(8, 20),), {})
        captured = capture.capture(
            _Product(20, 5),
            lambda m, *a, **k: m(*a, **k),
            call.spec(),
            call.tensors,
            "M",
            decompositions.table(),
        )
        assert captured.backward is not None
        return sum(
            n.target in fx_passes._RESHAPES and n.args[0].target is torch.ops.aten.sum.dim_IntList
            for n in captured.backward.graph.nodes
        )

    assert "sums_without_kept_dims" in [p.name for p in passes.PARTITIONED]
    assert reshaped_sums() == 0
    kept = tuple(p for p in passes.PARTITIONED if p.name != "sums_without_kept_dims")
    monkeypatch.setattr(passes, "PARTITIONED", kept)
    assert reshaped_sums() == 1


def test_batchnorm_in_train_mode_normalises_with_batch_statistics() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    _train_like_eager(model, lambda: (torch.randn(4, 3, 6, 6) * 3 + 1,))
    assert int(model[1].num_batches_tracked) == 3


class _NllLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.linear(x), target)


def _batch_norm_graph() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    return model, (torch.randn(4, 3, 6, 6) * 3 + 1,)


def _nll_graph() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _NllLoss(), (torch.randn(5, 6), torch.randint(0, 4, (5,)))


@pytest.mark.parametrize(
    ("operator", "make"),
    [
        ("_native_batch_norm_legit_functional", _batch_norm_graph),
        ("nll_loss_forward", _nll_graph),
    ],
)
def test_the_exporters_silent_mistranslations_are_caught_against_eager(
    operator: str, make: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
) -> None:
    """Without the table's entry the exporter's own translation runs: BatchNorm with training
    hard-coded off (running statistics instead of the batch's), nll_loss with a total weight
    of 1 (gradients batch-size times too large). Both without an error: the comparison with
    eager (which the backend's first-call check makes) must see them."""
    from ort_autopatch.engine.backends.ort import decompositions

    dropped = getattr(torch.ops.aten, operator).default
    table = {k: v for k, v in decompositions.table().items() if k is not dropped}
    torch.manual_seed(0)
    model, inputs = make()
    eager = copy.deepcopy(model)
    plain = PlainCall(model, *inputs, table=table)
    out, expected = plain(*inputs), eager(*inputs)
    out.float().pow(2).mean().backward()
    expected.float().pow(2).mean().backward()
    differs = not torch.allclose(out, expected, atol=1e-4) or any(
        not torch.allclose(p.grad, q.grad, atol=1e-4)
        for p, q in zip(model.parameters(), eager.parameters(), strict=True)
    )
    assert differs, f"the exporter's {operator} now agrees with eager: drop the table's entry?"


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2),
        nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4),
        nn.Conv1d(3, 5, 4, stride=3, padding=1),
        nn.Conv3d(2, 4, 2, stride=1, padding=1, bias=False),
        nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
        nn.ConvTranspose1d(3, 2, 4, stride=3, dilation=2),
    ],
    ids=lambda m: repr(m),
)
def test_convolution_gradients_equal_eagers_for_the_input_too(conv: nn.Module) -> None:
    channels = conv.in_channels
    dims = {nn.Conv1d: 1, nn.Conv3d: 3, nn.ConvTranspose1d: 1}.get(type(conv), 2)
    _train_like_eager(conv, lambda: (torch.randn(2, channels, *[7] * dims, requires_grad=True),))


@pytest.mark.parametrize(
    "pool",
    [
        nn.MaxPool2d(2),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.AvgPool2d(2),
        nn.AdaptiveAvgPool2d(1),
    ],
    ids=repr,
)
def test_pooling_gradients_equal_eagers(pool: nn.Module) -> None:
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), pool)
    _train_like_eager(model, lambda: (torch.randn(2, 2, 8, 8),))


class _ChannelsLastPool(nn.Module):
    """A channels-last activation (a Linear over NHWC, permuted: convnext's and swin_t's last
    stage) pooled to 1x1, then to 2x2."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 5)
        self.pool = nn.AdaptiveAvgPool2d(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.linear(x).permute(0, 3, 1, 2)).flatten(1)


@pytest.mark.parametrize("size", [1, 2])
def test_adaptive_pooling_of_a_channels_last_activation_trains_like_eager(size: int) -> None:
    _train_like_eager(_ChannelsLastPool(size), lambda: (torch.randn(2, 4, 4, 3),))


def _operators(model: bytes) -> set[str]:
    import onnx

    proto = onnx.load_from_string(model)
    nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
    return {node.op_type for node in nodes}


@pytest.mark.parametrize("kernel", [2, 3, (2, 3)], ids=["2x2", "3x3", "2x3"])
def test_a_tiling_max_pools_square_windows_come_from_one_space_to_depth(
    kernel: int | tuple[int, int],
) -> None:
    """The windows of a max pool that tiles its input, slot by slot: for square windows one
    SpaceToDepth cut by one Split (ORT copies a slice strided along the last dimension
    element by element, three times as slowly), for others strided slices; eager's numbers
    either way. Each slot's first maximum comes from the running maxima: no slots marked
    taken (Not, Or)."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.MaxPool2d(kernel))
    plain = _train_like_eager(model, lambda: (torch.randn(2, 2, 12, 12, requires_grad=True),))
    forward = _operators(plain.lowered.forward)
    square = isinstance(kernel, int)
    assert ("SpaceToDepth" in forward) == square, forward
    assert not {"Not", "Or"} & forward, forward
    if square:
        assert "Split" in forward
        assert not {"Squeeze", "SplitToSequence", "SequenceAt"} & forward, forward


def _conv_kernels_fed(model: bytes) -> list[str]:
    """The Conv nodes whose kernel depends on the graph's inputs."""
    import onnx

    graph = onnx.load_from_string(model).graph
    producers = {out: node for node in graph.node for out in node.output}
    fed = {i.name for i in graph.input}

    def depends(name: str, seen: set[str]) -> bool:
        if name in fed:
            return True
        node = producers.get(name)
        if node is None or name in seen:
            return False
        seen.add(name)
        return any(depends(i, seen) for i in node.input if i)

    return [n.name for n in graph.node if n.op_type == "Conv" and depends(n.input[1], set())]


def test_a_cnns_pool_and_weight_gradients_avoid_the_operators_ort_runs_slowly() -> None:
    # ArgMax, a scatter or a Conv with the whole gradient as its kernel each cost ORT more
    # than eager's whole step on a small CNN (decompositions.py says how much)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    plain = PlainCall(model, torch.randn(2, 3, 8, 8))
    assert plain.lowered.backward is not None
    forward, backward = _operators(plain.lowered.forward), _operators(plain.lowered.backward)
    assert not {"ArgMax", "ScatterElements", "ScatterND"} & (forward | backward)
    # the weight's patches come from a convolution with constant one-hot kernels; none
    # takes the gradient (or anything else the graph is fed) as its kernel
    assert "Conv" in backward
    assert not _conv_kernels_fed(plain.lowered.backward)
    assert _conv_kernels_fed(plain.lowered.forward)  # the layer's own, fed its weight
    # the input needs no gradient: the backward computes the parameters' alone
    import onnx

    outputs = onnx.load_from_string(plain.lowered.backward).graph.output
    assert len(outputs) == len(list(model.parameters()))


def test_transformer_layer_attention_and_layer_norm_train_like_eager() -> None:
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    _train_like_eager(model, lambda: (torch.randn(3, 7, 32, requires_grad=True),))


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 16, padding_idx=0)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.embedding(tokens)).mean(1))
        return nn.functional.cross_entropy(logits, labels)


def test_embedding_layer_norm_and_cross_entropy_train_like_eager() -> None:
    def inputs() -> tuple[torch.Tensor, ...]:
        return torch.randint(0, 30, (4, 6)), torch.randint(0, 5, (4,))

    _train_like_eager(_Classifier(), inputs, loss=lambda out: out)


@pytest.mark.parametrize(
    "loss",
    [
        nn.functional.mse_loss,
        nn.functional.smooth_l1_loss,
        nn.functional.binary_cross_entropy_with_logits,
        lambda a, b: nn.functional.binary_cross_entropy(torch.sigmoid(a), b),
        lambda a, b: nn.functional.nll_loss(a.log_softmax(1), b.argmax(1)),
    ],
    ids=["mse", "smooth_l1", "bce_logits", "bce", "nll"],
)
def test_loss_gradients_equal_eagers(loss: Callable[..., torch.Tensor]) -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(6, 4)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss(self.linear(x), target)

    _train_like_eager(WithLoss(), lambda: (torch.randn(5, 6), torch.rand(5, 4)), loss=lambda o: o)


def test_dropout_drops_at_its_rate_reuses_its_mask_in_backward_and_leaves_torchs_rng() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4000))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(x * self.weight, 0.25, training=True)

    model = Drop()
    x = torch.ones(4000)
    plain = PlainCall(model, x)
    torch.manual_seed(7)
    state = torch.random.get_rng_state()
    out = plain(x)
    assert ran_in_plain_ort(out)
    assert torch.equal(torch.random.get_rng_state(), state), "torch's generator was drawn from"
    zeros = float((out == 0).float().mean())
    assert 0.2 < zeros < 0.3
    kept = out != 0
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))
    out.sum().backward()
    assert model.weight.grad is not None
    torch.testing.assert_close(model.weight.grad, out.detach())  # the same mask, x = 1
    second = plain(x)
    assert not torch.equal(second, out), "every call draws a new mask"
    torch.manual_seed(7)
    assert torch.equal(plain(x), out), "the same seed gives the same run"


def test_a_call_without_gradients_runs_forward_alone_and_updates_batchnorm() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    eager = copy.deepcopy(model)
    x = torch.randn(6, 4)
    plain = PlainCall(model, x)
    with torch.no_grad():
        out = plain(x)
        expected = eager(x)
    assert out.grad_fn is None
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(model[1].running_var, eager[1].running_var)


class SampledConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 2)

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return nn.functional.grid_sample(self.conv(x), grid, align_corners=False)


def test_an_operator_without_onnx_form_in_backward_alone_cuts_backward_alone() -> None:
    """grid_sample's gradient has no translation in torchlib (its forward has): backward is
    cut at it, forward stays one graph, and the gradients are eager's."""
    torch.manual_seed(0)
    model = SampledConv()
    twin = copy.deepcopy(model)
    x, grid = torch.randn(1, 1, 5, 5), torch.rand(1, 3, 3, 2) * 2 - 1
    plain = PlainCall(model, x, grid)
    assert plain.program.torch_nodes == {"aten::grid_sampler_2d_backward": 1}
    assert set(plain.lowered.splits) == {"backward"}
    out, expected = plain(x, grid), twin(x, grid)
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def _first_call(plain: PlainCall, *inputs: torch.Tensor) -> object:
    """What the engine's first-call check does (`build.Builder._check_first_call`):
    `verify.verify_call` of the graph against eager, here on a bare program."""
    from ort_autopatch.engine import verify

    def run_graph(tensors: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = plain(*tensors)
        return out

    def run_eager(tensors: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = plain.module(*tensors)
        return out

    trainable = [p for p in plain.module.parameters() if p.requires_grad]
    return verify.verify_call(
        "M", plain.module, run_graph, run_eager, list(inputs), trainable, grad=True
    )


def test_the_first_call_check_passes_a_faithful_graph_and_leaves_no_trace() -> None:
    model, inputs = _batch_norm_graph()
    plain = PlainCall(model, *inputs)
    before = [b.clone() for b in model.buffers()]
    result = _first_call(plain, *inputs)
    assert getattr(result, "mismatch", "?") is None
    assert getattr(result, "unverified", "?") is None
    assert getattr(result, "spread_rel", "?") is None  # strictly within: eager ran once
    for a, b in zip(model.buffers(), before, strict=True):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in model.parameters())


def test_the_first_call_check_passes_a_convolution_bias_that_batchnorm_cancels() -> None:
    # the bias's gradient is zero in exact arithmetic: rounding noise on both sides, 3e-6
    # apart here, beside weight gradients in the tens
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
    x = torch.randn(8, 3, 32, 32)
    result = _first_call(PlainCall(model, x), x)
    assert getattr(result, "mismatch", "?") is None


@pytest.mark.parametrize(
    ("operator", "make", "differs"),
    [
        ("_native_batch_norm_legit_functional", _batch_norm_graph, "output 0 differs"),
        ("nll_loss_forward", _nll_graph, "gradient 0 differs"),  # the loss is right
    ],
)
def test_the_first_call_check_refuses_a_graph_that_differs_from_eager(
    operator: str, make: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]], differs: str
) -> None:
    """The exporter's mistranslations (BatchNorm with training off, nll_loss's total weight)
    are refused, and stay refused once eager's own spread on the call is measured: eager
    moves by rounding's size, these graphs by the values' size."""
    from ort_autopatch.engine import verify
    from ort_autopatch.engine.backends.ort import decompositions

    dropped = getattr(torch.ops.aten, operator).default
    table = {k: v for k, v in decompositions.table().items() if k is not dropped}
    torch.manual_seed(0)
    model, inputs = make()
    plain = PlainCall(model, *inputs, table=table)
    with pytest.raises(verify.VerificationError, match=differs) as caught:
        _first_call(plain, *inputs)
    verification = caught.value.verification
    assert verification is not None and verification.spread_rel is not None
    assert verification.spread_rel < 1e-4 < max(verification.output_rel, verification.grad_rel)


def test_the_first_call_check_names_random_operators_it_cannot_compare() -> None:
    from ort_autopatch.engine import EngineOptions, ModuleEngine

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=1))
    assert ran_in_plain_ort(engine(torch.randn(3, 4)))
    assert [v.unverified for v in engine.verifications] == ["random operators (Dropout)"]


def test_dropout_between_layers_drops_in_a_call_without_gradients() -> None:
    """ORT's EliminateDropout optimizer takes the exporter's Dropout (training flag from a
    Constant node) for an inference no-op when its mask is unused: the sessions keep it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(16, 8)
    with torch.no_grad():
        plain = PlainCall(model, x)
        clean = copy.deepcopy(model).eval()(x)
        assert (plain(x) - clean).abs().mean() > 1e-3, "dropout was removed from the graph"


class _PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.linear(x) * y
        return {"h": h, "label": h.argmax(-1), "y": y}


def test_an_input_returned_as_it_is_gets_its_gradient_through_autograd() -> None:
    """aot's graphs have no cotangent for an output that is an input: like eager, the call
    returns the input itself, and its gradient reaches it directly."""
    torch.manual_seed(0)
    model = _PassThrough()
    eager = copy.deepcopy(model)
    x, y = torch.randn(3, 6), torch.randn(3, 4, requires_grad=True)
    plain = PlainCall(model, x, y)
    ours_y = y.detach().clone().requires_grad_()
    out, expected = plain(x, ours_y), eager(x, y)
    assert out["y"] is ours_y
    assert ran_in_plain_ort(out["h"])
    (out["h"].sum() + (out["y"] * 3).sum()).backward()
    (expected["h"].sum() + (expected["y"] * 3).sum()).backward()
    assert ours_y.grad is not None and y.grad is not None
    torch.testing.assert_close(ours_y.grad, y.grad)
    torch.testing.assert_close(out["label"], expected["label"])


def test_an_output_that_is_a_view_of_an_input_is_that_view_with_eagers_gradient() -> None:
    """aot's graph computes the view as a value of its own; the call replays it on the
    caller's tensor, as aot's runtime wrappers do (`plain.aliasing`)."""

    class View(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.linear(x), x.view(-1)

    x = torch.randn(2, 4, requires_grad=True)
    plain = PlainCall(View(), x)
    # ORT computes no copy of the view
    assert plain.program.forward_session.runnable.fetch_names == ["linear"]
    y, flat = plain(x)
    assert flat._base is x and ran_in_plain_ort(y)
    (y.sum() + (flat * 2).sum()).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, plain.module.linear.weight.sum(0).expand(2, 4) + 2)


def test_batchnorm_with_a_cumulative_average_trains_like_eager() -> None:
    """momentum=None: eager computes the factor with float(num_batches_tracked)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU())
    _train_like_eager(model, lambda: (torch.randn(4, 3, 6, 6) * 2 + 1,))
    assert int(model[1].num_batches_tracked) == 3
    assert "forward" not in model[1].__dict__


def test_outputs_are_fetched_to_cuda_as_onnx_runtime_names_the_device() -> None:
    # ORT 1.2x keys CUDA allocators by vendor too: a fetch device without NVIDIA's id names
    # no allocator of the CUDA provider (the name is built without a GPU)
    from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

    from ort_autopatch.engine import session

    ours = session.ort_device(torch.device("cuda", 1))
    theirs = OrtDevice.make("cuda", 1)._get_c_device()
    assert (ours.device_type(), ours.vendor_id(), ours.device_id()) == (
        theirs.device_type(),
        theirs.vendor_id(),
        theirs.device_id(),
    )


def test_an_in_place_weight_change_before_backward_raises_as_in_eager() -> None:
    """Backward reads the weight's transpose, which forward made: the weight itself is saved
    so that autograd's version check raises eager's error instead of using the old values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 8, requires_grad=True)
    plain = PlainCall(model, x)
    out = plain(x)
    with torch.no_grad():
        model[2].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()


def test_a_tensor_made_from_data_in_forward_is_a_constant_of_the_graph() -> None:
    """`torch.tensor(...)` in forward (transformers' masks, an empty cache) is lifted into the
    trace and comes out as the graph's real constant."""

    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = torch.tensor([0.5, 1.0, 2.0, -1.0])
            return self.linear(x) * (torch.tensor(1.0) - scale)

    _train_like_eager(Constant(), lambda: (torch.randn(3, 4, requires_grad=True),))


def test_a_libraries_data_dependent_shortcut_takes_its_general_path_in_the_trace() -> None:
    """transformers skips the mask when `torch.all(mask == 1)` unless it is being compiled:
    the trace answers `torch.compiler.is_compiling()` with True in its own thread only."""
    seen: list[bool] = []

    class Shortcut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            seen.append(torch.compiler.is_compiling())
            if not torch.compiler.is_compiling() and bool(torch.all(mask == 1)):
                return self.linear(x)
            return self.linear(x) * mask

    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]] * 3)
    _train_like_eager(Shortcut(), lambda: (torch.randn(3, 4), mask))
    assert seen[0] and not torch.compiler.is_compiling()


def test_an_lstm_trains_like_eager_through_its_generic_kernels() -> None:
    """On CPU an LSTM traces to oneDNN's fused layer, which has no ONNX form."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 8, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(x)[0]

    model = Recurrent()
    _train_like_eager(model, lambda: (torch.randn(2, 5, 4, requires_grad=True),))
    weights = zip(model.lstm._flat_weights, model.lstm.parameters(), strict=True)
    assert all(w is p for w, p in weights)  # the module's own list, as before the trace


def test_a_layer_drop_at_zero_leaves_no_draw_in_the_graphs_so_the_first_call_is_checked() -> None:
    """`torch.rand([]) < 0.0` is False for every draw: the trace takes eager's branch and
    the draw, read by nothing else, is not an operator of either graph."""

    class LayerDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.layerdrop = 0.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                if self.training and torch.rand([]) < self.layerdrop:
                    continue
                x = layer(x)
            return x

    plain = _train_like_eager(LayerDrop(), lambda: (torch.randn(3, 4),))
    assert plain.captured.backward is not None
    graphs = (plain.captured.forward.graph, plain.captured.backward.graph)
    targets = {str(node.target) for graph in graphs for node in graph.nodes}
    assert not any("rand" in target for target in targets), targets
    assert plain.program.lowered.random_operators == []


def test_a_module_reached_by_two_paths_keeps_its_weight_after_the_trace() -> None:
    """T5's shared embedding is also `encoder.embed_tokens`, and the head is tied to it: the
    trace swaps each module's tensors for its stand-ins once, and puts back the originals."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Embedding(10, 4)
            self.encoder = nn.ModuleDict({"embed_tokens": self.shared})
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.shared.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder["embed_tokens"](ids).tanh())

    model = Shared()
    weight = model.shared.weight
    _train_like_eager(model, lambda: (torch.randint(0, 10, (2, 5)),))
    assert model.shared.weight is weight and model.head.weight is weight


class _Embeddings(nn.Module):
    """BERT's embeddings in small: a token type table of two rows every token reads row 0
    of, and positions every sequence of the batch reads alike."""

    def __init__(self) -> None:
        super().__init__()
        self.types = nn.Embedding(2, 256)
        self.positions = nn.Embedding(128, 256)

    def forward(self, types: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.types(types) + self.positions(positions))


def test_embedding_gradients_of_repeated_ids_are_eagers_from_two_threads() -> None:
    """An embedding's gradient adds every token's row into the table (`index_put` with
    accumulation). ORT's ScatterND lost updates of one row added from two threads at once:
    BERT-base at batch 8 had its token type embedding's gradient 3 to 14 % off, refused by
    the first-call check on one call and passing it on another. Through the engine at two
    threads, every call's gradients are eager's, in the graph traced for the first batch
    size and in the one with symbolic sizes the others take."""
    from ort_autopatch.engine import ModuleEngine
    from ort_autopatch.engine.recipe import EngineOptions

    torch.manual_seed(0)
    model = _Embeddings()
    eager = copy.deepcopy(model)
    engine = ModuleEngine(model, EngineOptions(backend="ort", threads=2))
    for call, batch in enumerate((32, 32, 16, 24, 32, 16, 24, 32)):
        types = torch.zeros(batch, 128, dtype=torch.long)
        positions = torch.arange(128).expand(batch, 128)
        cotangent = torch.randn(batch, 128, 256, generator=torch.Generator().manual_seed(call))
        out = engine(types, positions)
        assert ran_in_plain_ort(out), f"call {call} ran elsewhere"
        model.zero_grad()
        eager.zero_grad()
        out.backward(cotangent)
        eager(types, positions).backward(cotangent)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=f"{call}: {name}")
    assert [r.dynamic for r in engine.records][:2] == [False, True]  # both graphs ran


class _ConvViewed(nn.Module):
    """A convolution (its weight's gradient is a matrix product reshaped to the weight) and an
    output viewed from a matrix, as a language model's logits are."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1)).view(-1, 5, 1)


def test_outputs_a_reshape_makes_are_shaped_by_torch_not_copied_by_ort() -> None:
    """ONNX Runtime copies every Reshape into a graph output (ResNet-50's weight gradients:
    15 ms of its step). Such outputs leave both graphs as the value the Reshape read, and
    torch gives them their shapes: gradients and outputs equal eager's, and the user's
    output is no view (no `_base`), taking in-place writes and a backward as eager's does."""
    import onnx

    def images() -> tuple[torch.Tensor, ...]:
        return (torch.randn(4, 3, 8, 8),)

    plain = _train_like_eager(_ConvViewed(), images, steps=2)
    for role in ("forward", "backward"):
        model = getattr(plain.lowered, role)
        graph = onnx.load_from_string(model).graph
        made = {out: node for node in graph.node for out in node.output}
        reshaped = [
            o.name for o in graph.output if o.name in made and made[o.name].op_type == "Reshape"
        ]
        assert not reshaped, (role, reshaped)
        assert plain.lowered.facts[role].viewed, role
    (x,) = images()
    out = plain(x)
    assert out.shape == (4, 5, 1) and out._base is None and out.is_contiguous()
    out.mul_(2)
    out.sum().backward()
    assert all(p.grad is not None for p in plain.module.parameters())


def test_operators_read_through_a_detach_and_outputs_keep_it() -> None:
    """In a graph run without autograd a `detach` (or an `alias`) is its input, and ONNX
    Runtime copies the Identity it becomes wherever its value leaves a graph (a backward cut
    into stages: GPT-2 small's 51 MB log-softmax, 8 ms a step). Operators read its input
    instead; an output keeps it (an output that is an input would be the caller's tensor)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_autopatch.engine.backends.ort import fx_passes

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x.sin()
        d = y.detach()
        return d * 2, torch.ops.aten.alias(y) + 1, x.detach()

    x = torch.randn(3, 4)
    gm = make_fx(f)(x)
    fx_passes.detaches_read_through(gm)
    aliases = (_aten.detach.default, _aten.alias.default)
    read = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in aliases]
    assert [n.args[0].op for n in read] == ["placeholder"]  # only the output's own
    for got, want in zip(gm(x), f(x), strict=True):
        torch.testing.assert_close(got, want)


def test_outputs_shaped_by_torch_are_eagers_in_the_graph_with_symbolic_sizes() -> None:
    """The weight gradients torch gives their shapes have static shapes in the graph traced
    with symbolic sizes too: through the engine, over batches of three sizes, every call
    runs in ORT in both graphs, outputs and gradients equal eager's."""
    from ort_autopatch.engine import ModuleEngine
    from ort_autopatch.engine.recipe import EngineOptions

    torch.manual_seed(0)
    model = _ConvViewed()
    eager = copy.deepcopy(model)
    engine = ModuleEngine(model, EngineOptions(backend="ort"))
    for call, batch in enumerate((4, 4, 2, 3, 4)):
        x = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(call))
        out = engine(x)
        assert ran_in_plain_ort(out), f"call {call} ran elsewhere"
        expected = eager(x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        assert out._base is None
        model.zero_grad()
        eager.zero_grad()
        out.square().sum().backward()
        expected.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{call}: {name}")
    assert [r.dynamic for r in engine.records][:2] == [False, True]  # both graphs ran
