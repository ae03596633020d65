"""torchvision's models train through ONNX Runtime as a user selects them.

Every class of `torchvision.models` is patched as `--modules 'torchvision.models.*:*'` patches
it (the blocks too, which run inside their model's graph); each model, `weights=None`, takes 3
SGD steps and one eval forward, beside eager copies: every call must run in ORT, and with
dropout and stochastic depth at 0 every output and loss, step 1's gradients, the parameters and
buffers after three steps and the eval output must equal eager's.

"Equal" is measured as the zoo measures it (`tests/zoo/harness.relative`: the largest
difference over the tensor's largest value); the largest of each kind of result (outputs,
losses, gradients, parameters, buffers, eval output) must stay within 1e-4 (parameters and
buffers 1e-4 a step, 3e-4 after three: each step adds its rounding), or within 4 times the
largest of that kind that eager itself moves under rounding-sized disturbances: the same steps
on 2 threads instead of 1, and the same steps from parameters nudged by about one float32
rounding step. BatchNorm over a batch of 4 amplifies rounding step by step (regnet_y_400mf's
step-1 gradients differ by 8e-2 between eager on 1 and 2 threads; shufflenet_v2_x0_5's step-3
loss moves 0.5 to 5 % when its parameters are nudged, where ORT's is 0.7 % away), and no graph
can be held closer to eager than eager is to itself.

torch 2.13's CPU wheel and PyPI's torchvision do not import together: this file runs in
`nox -s tests_torch214` and, on the plain backend, `tests_plain_torch214` (torch 2.14.1,
torchvision 0.29.1).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

import ort_autopatch
from ort_autopatch import patcher, report
from ort_autopatch.config import Config
from ort_autopatch.engine import calls
from tests.zoo.harness import relative

torchvision = pytest.importorskip("torchvision")
models = torchvision.models

STEPS = 3
BATCH = 4
CLASSES = 10
LR = 1e-3
#: the closeness required whatever eager's own spread
TOLERANCE = 1e-4
#: how many times eager's own spread (2 threads, nudged parameters) ORT may differ by
SPREAD = 4
#: the nudge: parameters times (1 + NUDGE * N(0, 1)), about one float32 rounding step
NUDGE = 2e-7


def _vit() -> nn.Module:
    return models.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=CLASSES,
    )


def _without_stochastic_depth(model: nn.Module) -> nn.Module:
    """swin_t fixes its stochastic depth at 0.2 (a second value is a TypeError)."""
    for sub in model.modules():
        if isinstance(sub, torchvision.ops.StochasticDepth):
            sub.p = 0.0
    return model


#: name -> (model without weights, dropout and stochastic depth 0; image side): 64 pixels for
#: BatchNorm models (on 32, their last stages normalise over 4 values, and eager's own rounding
#: on 1 and 2 threads already parts by O(1) in three steps), 32 where LayerNorm allows it.
MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "resnet18": (lambda: models.resnet18(num_classes=CLASSES), 64),
    "squeezenet1_1": (lambda: models.squeezenet1_1(num_classes=CLASSES, dropout=0.0), 64),
    "efficientnet_b0": (
        lambda: models.efficientnet_b0(num_classes=CLASSES, dropout=0.0, stochastic_depth_prob=0.0),
        64,
    ),
    "densenet121": (lambda: models.densenet121(num_classes=CLASSES, drop_rate=0.0), 64),
    "convnext_tiny": (
        lambda: models.convnext_tiny(num_classes=CLASSES, stochastic_depth_prob=0.0),
        32,
    ),
    "swin_t": (
        lambda: _without_stochastic_depth(
            models.swin_t(num_classes=CLASSES, dropout=0.0, attention_dropout=0.0)
        ),
        32,
    ),
    "regnet_y_400mf": (lambda: models.regnet_y_400mf(num_classes=CLASSES), 64),
    "mobilenet_v3_small": (
        lambda: models.mobilenet_v3_small(num_classes=CLASSES, dropout=0.0),
        64,
    ),
    "vit": (_vit, 32),
    "shufflenet_v2_x0_5": (lambda: models.shufflenet_v2_x0_5(num_classes=CLASSES), 64),
}


@pytest.fixture(scope="module", autouse=True)
def _selected() -> Iterator[None]:
    """Every class of torchvision.models patched, as the wildcard selects them."""
    threads = torch.get_num_threads()
    config = Config(modules=("torchvision.models.*:*",), background_builds=False)
    assert ort_autopatch.install(config)
    try:
        yield
    finally:
        ort_autopatch.uninstall()
        torch.set_num_threads(threads)


@dataclass
class Run:
    """What a training run shows: every step's output and loss, step 1's gradients, the
    parameters and buffers after the last step, and the eval output."""

    outputs: list[torch.Tensor] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    evaluated: torch.Tensor | None = None


def _train(model: nn.Module, side: int, eager: bool, threads: int = 1) -> Run:
    """3 SGD steps and an eval forward, on the same data every run; `eager`: the model's own
    code, its selected blocks included, as without the tool."""
    torch.set_num_threads(threads)
    context = calls.stepping_aside if eager else contextlib.nullcontext
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    run = Run()
    for step in range(STEPS):
        x = torch.randn(BATCH, 3, side, side, generator=data)
        target = torch.randint(0, CLASSES, (BATCH,), generator=data)
        optimizer.zero_grad(set_to_none=True)
        with context():
            output = model(x)
        loss = nn.functional.cross_entropy(output, target)
        loss.backward()
        run.outputs.append(output.detach().clone())
        run.losses.append(loss.detach().clone())
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None, f"no gradient for {name}"
                run.gradients[name] = p.grad.clone()
        optimizer.step()
    run.parameters = {n: p.detach().clone() for n, p in model.named_parameters()}
    run.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.eval()
    x = torch.randn(BATCH, 3, side, side, generator=data)
    with torch.no_grad(), context():
        run.evaluated = model(x)
    return run


def _differences(actual: Run, expected: Run) -> dict[str, tuple[float, str]]:
    """The largest relative difference per kind of result, and where it is (gradients and
    parameters against the run's largest one, as the zoo measures gradients: exact zeros hold
    rounding noise)."""
    grad_floor = 1e-3 * max(g.abs().max().item() for g in expected.gradients.values())
    param_floor = 1e-3 * max(p.abs().max().item() for p in expected.parameters.values())
    kinds: dict[str, list[tuple[float, str]]] = {
        "outputs": [
            (relative(a, e), f"step {k + 1}")
            for k, (a, e) in enumerate(zip(actual.outputs, expected.outputs, strict=True))
        ],
        "losses": [
            (relative(a, e), f"step {k + 1}")
            for k, (a, e) in enumerate(zip(actual.losses, expected.losses, strict=True))
        ],
        "step 1 gradients": [
            (relative(actual.gradients[n], g, grad_floor), n) for n, g in expected.gradients.items()
        ],
        f"parameters after {STEPS} steps": [
            (relative(actual.parameters[n], p, param_floor), n)
            for n, p in expected.parameters.items()
        ],
        f"buffers after {STEPS} steps": [
            (relative(actual.buffers[n], b), n) for n, b in expected.buffers.items()
        ],
        "eval output": [(relative(actual.evaluated, expected.evaluated), "")],
    }
    return {kind: max(found, default=(0.0, "")) for kind, found in kinds.items()}


def _tolerance(kind: str) -> float:
    """Each step may add its rounding to what the steps leave (parameters, buffers)."""
    return STEPS * TOLERANCE if kind.endswith(f"after {STEPS} steps") else TOLERANCE


def _nudged(model: nn.Module, seed: int) -> nn.Module:
    """A copy whose parameters are moved by about one rounding step each: what any other
    kernel's rounding (ORT's against eager's) does to the first step's numbers."""
    nudged = copy.deepcopy(model)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in nudged.parameters():
            p.mul_(1 + NUDGE * torch.randn(p.shape, generator=noise))
    return nudged


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_and_evaluates_in_ort_like_eager(name: str) -> None:
    build, side = MODELS[name]
    report.reset()
    torch.manual_seed(0)
    model = build()
    assert patcher.is_patched(type(model)), f"{type(model)} is not selected by the wildcard"
    eager = _train(copy.deepcopy(model), side, eager=True)
    disturbed = [
        _train(copy.deepcopy(model), side, eager=True, threads=2),
        *(_train(_nudged(model, seed), side, eager=True) for seed in (1, 2)),
    ]
    ours = _train(model, side, eager=False)
    stats = report.snapshot()[patcher.class_name(type(model))]
    assert stats["fallbacks"] == [] and stats["eager_calls"] == 0, stats
    assert stats["ort_calls"] == STEPS + 1
    spreads = [_differences(run, eager) for run in disturbed]
    spread = {kind: max(s[kind] for s in spreads) for kind in spreads[0]}
    apart = {
        kind: (difference, where, spread[kind][0])
        for kind, (difference, where) in _differences(ours, eager).items()
        if difference > max(_tolerance(kind), SPREAD * spread[kind][0])
    }
    assert not apart, "ORT differs from eager (largest difference, where; eager's own spread): " + (
        "; ".join(f"{kind}: {d:.2e} {where} ({s:.2e})" for kind, (d, where, s) in apart.items())
    )
