"""A backward run in stages (`backends/ort/stages.py`): where a graph is cut, that the stages
compute what the whole graph computes, that each value forward handed over is let go of after
the last stage reading it, and that training through a staged backward is eager's, with
autograd's rules for a second backward and for saved-tensor hooks kept."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.plain_helpers import PLAIN_READY, SKIP_REASON, PlainCall, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)

#: 4 MiB of float32 per value: eight saved ones are past `stages.LEAST_FREED`
SIZE = [1024, 1024]


def _chain(layers: int = 8, size: list[int] | None = None, extra: Any = None) -> Any:
    """A backward-like graph: a cotangent `g` multiplied by one saved activation `a{i}` per
    layer, each layer's "gradient" `o{i}` (plus a constant read in every layer) an output,
    and a last output that reads the held parameter `w` through a node of its own."""
    from onnx import TensorProto, helper

    size = SIZE if size is None else size

    def value(name: str) -> Any:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, size)

    nodes = [helper.make_node("Constant", [], ["c"], value_float=0.5)]
    inputs = [value("g"), value("w")]
    outputs = []
    previous = "g"
    for i in range(layers):
        inputs.append(value(f"a{i}"))
        nodes.append(helper.make_node("Mul", [previous, f"a{i}"], [f"h{i}"]))
        nodes.append(helper.make_node("Add", [f"h{i}", "c"], [f"o{i}"]))
        outputs.append(value(f"o{i}"))
        previous = f"h{i}"
    nodes.append(helper.make_node("Neg", ["w"], ["nw"]))  # reads only a held tensor
    nodes.append(helper.make_node("Mul", [previous, "nw"], ["last"]))
    outputs.append(value("last"))
    if extra is not None:
        nodes, inputs, outputs = extra(nodes, inputs, outputs)
    graph = helper.make_graph(
        nodes,
        "chain",
        inputs,
        outputs,
        value_info=[value(f"h{i}") for i in range(layers)] + [value("nw")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return model.SerializeToString()


def _handed(layers: int = 8) -> frozenset[str]:
    return frozenset(f"a{i}" for i in range(layers))


def _feeds(model: bytes, seed: int = 0) -> dict[str, np.ndarray]:
    import onnx

    rng = np.random.default_rng(seed)
    graph = onnx.load_from_string(model).graph
    shape = [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    return {v.name: rng.standard_normal(shape).astype(np.float32) for v in graph.input}


def _session(model: bytes) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _runner(model: bytes, staging: Any) -> Any:
    """The stages as the program runs them (`StagedRunnable` over one session each)."""
    import onnx

    from ort_autopatch.engine import dlpack, session
    from ort_autopatch.engine.backends.ort import stages

    dlpack.use_inference_dlpack()  # as the program's sessions are made
    device = torch.device("cpu")
    runs = []
    for stage in staging.stages:
        made = _session(stage.model)
        runs.append(session.RunnableSession.of(made, device, None, stage.outputs))
    inputs = [v.name for v in onnx.load_from_string(model).graph.input]
    return stages.StagedRunnable(staging, runs, inputs)


def test_a_backward_is_cut_where_handed_inputs_are_read_last_and_computes_the_whole() -> None:
    from ort_autopatch.engine.backends.ort import stages

    model = _chain()
    staging = stages.cut(model, _handed())
    assert staging is not None and 2 <= len(staging.stages) <= stages.MOST_STAGES
    feeds = _feeds(model)
    whole = _session(model)
    names = [o.name for o in whole.get_outputs()]
    expected = dict(zip(names, whole.run(None, feeds), strict=True))
    runner = _runner(model, staging)
    got = runner.run([torch.from_numpy(feeds[name]) for name in runner.feed_names])
    assert staging.outputs == names
    for name, value in zip(names, got, strict=True):
        np.testing.assert_array_equal(value.numpy(), expected[name], err_msg=name)
    # each saved activation is an input of the stage reading it and of none after
    reading = [i for i, stage in enumerate(staging.stages) if "a0" in stage.inputs]
    assert reading == [0]
    assert "a7" in staging.stages[-1].inputs


def test_a_node_reading_only_held_tensors_runs_in_its_readers_stage() -> None:
    """`Neg(w)` comes first in no order ORT keeps: made where `last` reads it, no stage
    holds its result across another."""
    import onnx

    from ort_autopatch.engine.backends.ort import stages

    staging = stages.cut(_chain(), _handed())
    assert staging is not None
    holding = [
        i
        for i, stage in enumerate(staging.stages)
        if "Neg" in [n.op_type for n in onnx.load_from_string(stage.model).graph.node]
    ]
    assert holding == [len(staging.stages) - 1]
    assert all("nw" not in stage.inputs for stage in staging.stages)


def test_a_constant_read_in_several_stages_is_copied_into_each() -> None:
    import onnx

    from ort_autopatch.engine.backends.ort import stages

    staging = stages.cut(_chain(), _handed())
    assert staging is not None
    for stage in staging.stages:
        nodes = onnx.load_from_string(stage.model).graph.node
        assert [n.op_type for n in nodes].count("Constant") == 1
        assert "c" not in stage.inputs and "c" not in stage.outputs


def test_the_runner_lets_go_of_each_input_after_the_last_stage_reading_it() -> None:
    from ort_autopatch.engine.backends.ort import stages

    model = _chain()
    staging = stages.cut(model, _handed())
    assert staging is not None
    runner = _runner(model, staging)
    feeds = _feeds(model)
    tensors = [torch.from_numpy(feeds[name].copy()) for name in runner.feed_names]
    watched = {name: weakref.ref(t) for name, t in zip(runner.feed_names, tensors, strict=True)}
    alive_at: list[set[str]] = []
    for _, run in runner._stages:
        real = run.run

        def seen(values: Any, kept: Any = None, real: Any = real) -> Any:
            gc.collect()
            alive_at.append({name for name, ref in watched.items() if ref() is not None})
            return real(values, kept)

        run.run = seen
    runner.run(tensors)  # hands the list over: emptied
    assert tensors == []
    for k, alive in enumerate(alive_at):
        still_read = {name for stage in staging.stages[k:] for name in stage.inputs}
        handed = _handed() & set(watched)
        assert alive & handed == still_read & handed, f"before stage {k}"
    gc.collect()
    assert all(watched[name]() is None for name in _handed())


@pytest.mark.parametrize(
    "why",
    ["nothing handed over", "too little handed over", "a subgraph", "symbolic sizes"],
)
def test_a_graph_staging_would_not_pay_or_could_break_is_left_whole(why: str) -> None:
    from onnx import TensorProto, helper

    from ort_autopatch.engine.backends.ort import stages

    handed = _handed()
    if why == "nothing handed over":
        model, handed = _chain(), frozenset()
    elif why == "too little handed over":
        model = _chain(size=[4, 4])
    elif why == "a subgraph":

        def extra(nodes: Any, inputs: Any, outputs: Any) -> Any:
            branch = helper.make_graph(
                [helper.make_node("Identity", ["a0"], ["b"])],
                "branch",
                [],
                [helper.make_tensor_value_info("b", TensorProto.FLOAT, SIZE)],
            )
            inputs.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
            nodes.append(
                helper.make_node("If", ["flag"], ["chosen"], then_branch=branch, else_branch=branch)
            )
            outputs.append(helper.make_tensor_value_info("chosen", TensorProto.FLOAT, SIZE))
            return nodes, inputs, outputs

        model = _chain(extra=extra)
    else:
        model = _chain(size=["rows", 1024])  # type: ignore[list-item]
    assert stages.cut(model, handed) is None


def test_a_staging_comes_back_from_the_cache_as_it_was_stored() -> None:
    from ort_autopatch.engine.backends.ort import stages

    staging = stages.cut(_chain(), _handed())
    assert staging is not None
    back = stages.Staging.from_stored(staging.meta(), staging.graphs("backward"), "backward")
    assert back == staging
    assert stages.Staging.from_stored(None, {}, "backward") is None


@pytest.fixture
def always_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backward with a value handed over is staged, however small the model."""
    from ort_autopatch.engine.backends.ort import stages

    monkeypatch.setattr(stages, "LEAST_FREED", float("-inf"))
    monkeypatch.setattr(stages, "LEAST_GAIN", float("-inf"))


def test_a_staged_call_stored_and_loaded_trains_as_built(always_staged: None) -> None:
    """The persistent cache stores the stages beside the whole backward (`Lowered.meta`,
    `graphs`); sessions made from what it reads back run the same stages."""
    from ort_autopatch.engine import session
    from ort_autopatch.engine.backend import RunHooks
    from ort_autopatch.engine.backends.ort import lowered, program

    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(6, 16)
    plain = PlainCall(model, x)
    built = plain.lowered
    assert built.staging is not None
    back = lowered.Lowered.from_stored(built.meta(), built.graphs())
    assert back.staging == built.staging
    assert back.backward == built.backward  # the whole graph stays (--save-onnx, a check)
    out = plain(x)
    out.square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain.program = program.instantiate(
        back, RunHooks("M"), torch.device("cpu"), session.SessionSettings(threads=1)
    )
    assert plain.program.backward_session is not None
    assert plain.program.backward_session.consumes
    plain(x).square().mean().backward()
    for p, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)


# -- training through a staged backward -----------------------------------------------------


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)]
    return nn.Sequential(*layers)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _attention() -> nn.Module:
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)


def _embedding() -> nn.Module:
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16))


MODELS = {
    "mlp": (_mlp, lambda: (torch.randn(6, 16, requires_grad=True),)),
    "cnn": (_cnn, lambda: (torch.randn(2, 3, 8, 8),)),
    "attention": (_attention, lambda: (torch.randn(2, 5, 16, requires_grad=True),)),
    # repeated ids: rows added by torch after the stages (`GraphFacts.added`)
    "embedding": (_embedding, lambda: (torch.randint(0, 10, (4, 32)),)),
}
#: what torch finishes of each model's staged backward (`GraphFacts`): the convolutions'
#: weight gradients made as matrices, the embedding's rows
FINISHED = {"cnn": "viewed", "embedding": "added"}


def _staged(plain: PlainCall) -> int:
    """How many stages the call's backward runs in."""
    staging = plain.lowered.staging
    assert plain.program.backward_session is not None
    assert plain.program.backward_session.consumes == (staging is not None)
    return 0 if staging is None else len(staging.stages)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_through_a_staged_backward_is_eagers(name: str, always_staged: None) -> None:
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    model = make()
    eager = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.05)
    plain = PlainCall(model, *inputs())
    assert _staged(plain) >= 2
    if name in FINISHED:
        assert getattr(plain.lowered.facts["backward"], FINISHED[name])
    for step in range(3):
        x = inputs()
        mine = [t.detach().clone().requires_grad_(t.requires_grad) for t in x]
        out = plain(*mine)
        assert ran_in_plain_ort(out)
        expected = eager(*x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        out.square().mean().backward()
        expected.square().mean().backward()
        for (what, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=what)
        for a, b in zip(mine, x, strict=True):
            if b.requires_grad:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
        for (what, a), b in zip(model.named_buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(a, b, msg=f"step {step}: {what}")
        optimizer.step()
        eager_optimizer.step()


def test_a_staged_backward_lets_go_of_forwards_values_as_it_goes(always_staged: None) -> None:
    """Before each stage runs, every value forward handed over that no stage left reads is
    gone: nothing (the Function's context, the program's lists) holds it."""
    from ort_autopatch.engine.backends.ort import program

    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(6, 16)
    plain = PlainCall(model, x)
    staging = plain.lowered.staging
    assert staging is not None and len(staging.stages) >= 2
    handed: list[Any] = []
    real_forward = program.OrtProgram.forward

    def forward(self: Any, ctx: Any, feeds: Any) -> Any:
        outputs = real_forward(self, ctx, feeds)
        handed.extend(weakref.ref(t) for t in ctx.handed)
        return outputs

    names = plain.lowered.facts["backward"].inputs
    reads = zip(plain.lowered.backward_inputs, names, strict=True)
    saved = [n for (kind, _), n in reads if kind != "tangent"]
    handed_names = [n for n in saved if n in set(staging.handed)]
    alive_at: list[set[str]] = []
    runner = plain.program.backward_session.runnable
    for _, run in runner._stages:  # type: ignore[union-attr]
        real = run.run

        def seen(values: Any, kept: Any = None, real: Any = real) -> Any:
            gc.collect()
            alive_at.append(
                {n for n, ref in zip(handed_names, handed, strict=True) if ref() is not None}
            )
            return real(values, kept)

        run.run = seen
    program.OrtProgram.forward = forward  # type: ignore[method-assign]
    try:
        out = plain(x)
    finally:
        program.OrtProgram.forward = real_forward  # type: ignore[method-assign]
    assert len(handed) == len(handed_names) > 0
    out.square().mean().backward()
    for k, alive in enumerate(alive_at):
        still_read = {name for stage in staging.stages[k:] for name in stage.inputs}
        assert alive == still_read & set(handed_names), f"before stage {k}"
    assert alive_at[-1] < alive_at[0]  # some were let go of before the last stage


def _staged_mlp() -> tuple[nn.Module, nn.Module, torch.Tensor, PlainCall]:
    """An MLP, its eager twin, an input, and its call through a staged backward."""
    torch.manual_seed(0)
    model = _mlp()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 16)
    plain = PlainCall(model, x)
    assert _staged(plain) >= 2
    return model, eager, x, plain


def test_retain_graph_keeps_a_staged_backwards_values_and_a_third_backward_raises(
    always_staged: None,
) -> None:
    """As eager: a backward with `retain_graph=True` can be followed by another, one
    without it frees the call's values, and a backward after that raises autograd's error."""
    model, eager, x, plain = _staged_mlp()
    out, expected = plain(x).square().mean(), eager(x).square().mean()
    for loss in (out, expected):
        loss.backward(retain_graph=True)
        loss.backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        expected.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward()


def test_under_saved_tensor_hooks_every_saved_value_goes_through_the_hooks(
    always_staged: None,
) -> None:
    """Offloading and checkpointing hooks see every tensor backward reads: nothing is handed
    over outside them, and the gradients are eager's."""
    model, eager, x, plain = _staged_mlp()
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = plain(x)
    names = plain.lowered.facts["backward"].inputs
    reads = sum(kind != "tangent" for kind, _ in plain.lowered.backward_inputs)
    assert len(names) == len(plain.lowered.backward_inputs)
    assert len(packed) >= reads
    out.square().mean().backward()
    eager(x).square().mean().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_values_the_call_returns_or_views_are_never_handed_over() -> None:
    """A saved value the caller also holds (an output, or a view of one) frees nothing when
    backward lets go of it, and stays under autograd's version check: not handed over. One
    that only backward reads is."""
    from ort_autopatch.engine.backends.ort import capture, stages

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.first(x)  # gelu's backward reads it; the caller sees it as a view
            return self.second(nn.functional.gelu(hidden)), hidden.view(-1)

    plain = PlainCall(Net(), torch.randn(4, 8))
    backward = plain.captured.backward
    assert backward is not None
    handed = backward.meta[stages.HANDED]
    forward_nodes = {n.name: n for n in plain.captured.forward.graph.nodes}
    targets = {str(forward_nodes[name].target) for name in handed if name in forward_nodes}
    assert any("gelu" in t for t in targets), (handed, targets)  # read by backward alone
    outputs = next(n for n in plain.captured.forward.graph.nodes if n.op == "output").args[0]
    seen = {capture._base(outputs[k]) for k in plain.captured.slots}
    assert all(capture._base(forward_nodes[name]) not in seen for name in handed)
    saved = [n.name for n in backward.graph.nodes if n.op == "placeholder"]
    assert any(
        "linear" in str(forward_nodes[name].target) for name in saved if name in forward_nodes
    ), saved  # the hidden value is saved, and not handed over
    assert not any("addmm" in t for t in targets)
