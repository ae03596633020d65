"""Shared helpers for the engine tests: exact-parity training runs against eager PyTorch.

`assert_training_parity` deep-copies a model twice, trains one copy eagerly and the other through
`ModuleEngine` on identical inputs, and checks after every step: outputs (every tensor leaf of a
nested output, and its non-tensor leaves and structure), the loss, every parameter gradient,
every input gradient, every buffer (BatchNorm running stats and `num_batches_tracked` included)
and the parameters after the optimizer step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from ort_autopatch.engine import EngineOptions, ModuleEngine, backend


def plain_backend() -> bool:
    """Whether engines here run on the plain backend (inference-only onnxruntime: one graph
    per input shape, graphs from torch's autograd) rather than the training build."""

    return backend.resolve() == "ort"


RTOL = 1e-4
ATOL = 1e-6
#: how the rebuild reason of a static-shape graph earned by a repeated shape starts
REPEATED = "input shape repeated"

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def assert_close(
    actual: Any, expected: Any, what: str, rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Tensors: same dtype and shape; floats within rtol (plus atol floor); others exactly."""
    assert isinstance(actual, torch.Tensor), (
        f"{what}: engine gave {type(actual).__name__}, not a tensor"
    )
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != eager {expected.dtype}"
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    )
    a, e = actual.detach(), expected.detach()
    if e.is_floating_point() or e.is_complex():
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, e), f"{what}: engine {a} != eager {e}"


def assert_tree_close(
    actual: Any, expected: Any, what: str = "output", rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Same pytree structure (types included), every tensor leaf close, other leaves equal."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert type(actual) is type(expected), (
        f"{what}: engine returned {type(actual)}, eager {type(expected)}"
    )
    assert a_spec == e_spec, f"{what}: structure differs:\n engine {a_spec}\n eager  {e_spec}"
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        if isinstance(e, torch.Tensor):
            assert_close(a, e, f"{what} leaf {k}", rtol, atol)
        else:
            assert a == e, f"{what} leaf {k}: engine {a!r} != eager {e!r}"


def clone_inputs(inputs: Inputs) -> Inputs:
    """Independent copies of (args, kwargs): tensors cloned, requires_grad kept as a fresh leaf."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            copy_ = leaf.detach().clone()
            return copy_.requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(one, inputs)


def _grad_leaves(inputs: Inputs) -> list[torch.Tensor]:
    return [
        t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad
    ]


def make_optimizer(
    kind: str, params: Sequence[torch.nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    raise ValueError(kind)


@dataclass
class ParityRun:
    engine: ModuleEngine
    eager_model: torch.nn.Module
    engine_model: torch.nn.Module
    eager_losses: list[float] = field(default_factory=list)
    engine_losses: list[float] = field(default_factory=list)


def default_loss(output: Any) -> torch.Tensor:
    """Sum of squares of every floating tensor leaf (a scalar leaf is taken as it is)."""
    leaves = [
        t
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    assert leaves, "the output has no floating-point tensor to take a loss of"
    total = leaves[0].new_zeros(())
    for t in leaves:
        total = total + (t if t.dim() == 0 else (t * t).mean())
    return total


def assert_training_parity(
    model: torch.nn.Module,
    make_inputs: Callable[[int], Inputs],
    *,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    steps: int = 10,
    optimizer: str = "sgd",
    lr: float = 1e-2,
    rtol: float = RTOL,
    atol: float = ATOL,
    options: EngineOptions | None = None,
    expect_builds: int | Literal["by shapes"] | None = "by shapes",
) -> ParityRun:
    """Train deep copies of `model` eagerly and through the engine for `steps` steps; assert
    every observable agrees at each step. `make_inputs(step)` returns (args, kwargs).

    `expect_builds`: the graphs the steps build, static-shape graphs a repeated shape earned
    not counted; by default what the engine gives a model that does not specialise on sizes,
    one graph for the first step's input shapes and one for every other shape."""
    eager_model = copy.deepcopy(model)
    engine_model = copy.deepcopy(model)
    engine = ModuleEngine(engine_model, options)
    eager_opt = make_optimizer(optimizer, list(eager_model.parameters()), lr)
    engine_opt = make_optimizer(optimizer, list(engine_model.parameters()), lr)
    run = ParityRun(engine, eager_model, engine_model)
    shapes = set()
    for step in range(steps):
        inputs = make_inputs(step)
        shapes.add(tuple(tuple(t.shape) for t in pytree.tree_leaves(inputs) if torch.is_tensor(t)))
        e_args, e_kwargs = clone_inputs(inputs)
        o_args, o_kwargs = clone_inputs(inputs)
        eager_opt.zero_grad(set_to_none=True)
        engine_opt.zero_grad(set_to_none=True)

        expected = eager_model(*e_args, **e_kwargs)
        actual = engine(*o_args, **o_kwargs)
        assert_tree_close(actual, expected, f"step {step} output", rtol, atol)

        e_loss = loss_fn(expected)
        o_loss = loss_fn(actual)
        assert_close(o_loss, e_loss, f"step {step} loss", rtol, atol)
        run.eager_losses.append(float(e_loss.detach()))
        run.engine_losses.append(float(o_loss.detach()))

        e_loss.backward()
        o_loss.backward()
        for (name, e_p), o_p in zip(
            eager_model.named_parameters(), engine_model.parameters(), strict=True
        ):
            if e_p.grad is None:
                assert o_p.grad is None or not o_p.grad.any(), (
                    f"step {step} grad of {name}: eager has none"
                )
                continue
            assert o_p.grad is not None, f"step {step} grad of {name}: engine produced none"
            assert_close(o_p.grad, e_p.grad, f"step {step} grad of {name}", rtol, atol)
        for k, (e_in, o_in) in enumerate(
            zip(_grad_leaves((e_args, e_kwargs)), _grad_leaves((o_args, o_kwargs)), strict=True)
        ):
            assert e_in.grad is not None
            assert o_in.grad is not None, f"step {step} input #{k}: engine gave no gradient"
            assert_close(o_in.grad, e_in.grad, f"step {step} grad of input #{k}", rtol, atol)
        for (name, e_b), o_b in zip(
            eager_model.named_buffers(), engine_model.buffers(), strict=True
        ):
            assert_close(o_b, e_b, f"step {step} buffer {name}", rtol, atol)

        eager_opt.step()
        engine_opt.step()
        for (name, e_p), o_p in zip(
            eager_model.named_parameters(), engine_model.parameters(), strict=True
        ):
            assert_close(
                o_p, e_p, f"step {step} parameter {name} after the optimizer step", rtol, atol
            )
    if expect_builds == "by shapes":
        expect_builds = min(len(shapes), 2)
    if expect_builds is not None:
        # static-shape graphs for a shape that repeated (`--static-after`) come on top
        builds = sum(not record.reason.startswith(REPEATED) for record in engine.records)
        assert builds == expect_builds, (
            f"expected {expect_builds} graph build(s), got {builds}: {engine.records}"
        )
    return run


def assert_state_equal(
    model_a: torch.nn.Module, model_b: torch.nn.Module, rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Parameters and buffers of two copies agree."""
    for (name, a), b in zip(
        model_a.state_dict().items(), model_b.state_dict().values(), strict=True
    ):
        assert_close(a, b, name, rtol, atol)


def snapshot_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def repatch(cls: type, settings: Any) -> None:
    """Patch `cls` anew with `settings` (a `patcher.Settings`); instances made from now on use
    them."""
    from ort_autopatch import patcher

    patcher.unpatch(cls)
    patcher.patch(cls, settings)


def patched(classes: Sequence[type], settings: Any = None) -> Iterator[None]:
    """The body of a test module's patching fixture: a fresh report, `classes` patched (with
    `settings`, a `patcher.Settings`) for the test, and every class unpatched after it."""
    from ort_autopatch import patcher, report

    report.reset()
    for cls in classes:
        patcher.patch(cls, settings)
    yield
    patcher.unpatch_all()


def class_stats(cls: type) -> Any:
    """The report's counters (`report.ClassStats`) of a patched class."""
    from ort_autopatch import patcher, report

    return report.stats_for(patcher.class_name(cls))


def store_invalid_graphs(cache_dir: Path) -> bytes:
    """Overwrite every graph stored under `cache_dir` with one that is not valid ONNX (a node
    reads a tensor nothing produces) and whose checksum matches: only ONNX's checker or ONNX
    Runtime can tell. Returns the bytes written."""
    import json

    from onnx import TensorProto, helper

    from ort_autopatch.engine.store import digest_bytes

    bad: bytes = helper.make_model(
        helper.make_graph(
            [helper.make_node("Relu", ["ghost"], ["y"])],
            "bad",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
    ).SerializeToString()
    sidecars = [p for p in cache_dir.rglob("*.json") if p.name != "paths.json"]
    assert sidecars, f"nothing stored under {cache_dir}"
    for sidecar in sidecars:
        meta = json.loads(sidecar.read_text())
        stem = sidecar.name[: -len(".json")]
        for part in meta["graphs"]:
            (sidecar.parent / f"{stem}.{part}.onnx").write_bytes(bad)
            meta["graphs"][part] = digest_bytes(bad)
        sidecar.write_text(json.dumps(meta))
    return bad
