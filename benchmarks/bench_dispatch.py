"""Cost of the patched call's cache-hit path, and of having the tool installed at all.

    python benchmarks/bench_dispatch.py

The hit path is everything a patched call does besides running the graph: stepping-aside
checks, hooks check, structure check, input signature, guard values, cache lookup, feed list.
It is measured by timing calls whose graph run is replaced by a constant, side by side with
the real MLP training step (forward + loss + backward + AdamW), with and without the skip-check
flags. Results: benchmarks/results/dispatch.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ort_autopatch import patcher
from ort_autopatch.engine import entry as engine_entry
from ort_autopatch.policy import SkipCheck

RESULTS = Path(__file__).resolve().parent / "results" / "dispatch.json"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        self.head = nn.Linear(512, 10)
        self.dropout_p = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


class NotSelected(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _median_us(fn: Any, repeat: int = 2000) -> float:
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        samples.append((time.perf_counter() - start) / repeat * 1e6)
    return statistics.median(samples)


def _step_ms(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 60) -> float:
    opt = torch.optim.AdamW(model.parameters())
    times = []
    for i in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 10:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bert_hit_path() -> dict[str, Any]:
    """The hit path on a 12-layer BERT (about 230 modules, tiny widths): the cost of checking
    that a graph still fits grows with the module tree, not with the widths."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=12,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    patcher.patch(BertModel)
    try:
        model = BertModel(config)
        ids = torch.randint(0, 100, (2, 16))
        model(input_ids=ids)  # build
        real_run = engine_entry.Entry.run
        engine_entry.Entry.run = lambda self, state, call, recompute=False: None  # type: ignore[method-assign,assignment,return-value]
        try:
            hit_us = _median_us(lambda: model(input_ids=ids), repeat=300)
        finally:
            engine_entry.Entry.run = real_run  # type: ignore[method-assign]
        modules = sum(1 for _ in model.modules())
        # Where the hit path goes: the guards every call reads (nothing announces their changes).
        instance = patcher._instances[model]
        engine = instance.engine
        assert engine is not None
        state = engine._state
        parts = {
            "structure_check": state.unchanged,
            "train_flags": state.training_flags,
            "requires_grad_flags": state.requires_grad_flags,
            "attribute_guards": instance.values,
            "submodule_hooks": state.submodule_hooks,
        }
        breakdown = {name: round(_median_us(fn, repeat=300), 2) for name, fn in parts.items()}
    finally:
        patcher.unpatch(BertModel)
    return {
        "bert12_modules": modules,
        "bert12_tensors": len(state.tensors),
        "bert12_attribute_guards": len(instance.guards),
        "bert12_hit_path_us": round(hit_us, 2),
        "bert12_hit_path_parts_us": breakdown,
    }


def main() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    eager_ms = _step_ms(MLP(), x, y)
    patcher.patch(MLP)
    ort_ms = _step_ms(MLP(), x, y)

    results: dict[str, Any] = {
        "mlp_step_eager_ms": round(eager_ms, 3),
        "mlp_step_ort_ms": round(ort_ms, 3),
        "not_selected_call_is_module_call": NotSelected.__call__ is nn.Module.__call__,
    }
    constant = torch.zeros(64, 10)
    real_run = engine_entry.Entry.run
    for label, skip in (
        ("all_checks", SkipCheck.SKIP_CHECK_DISABLED),
        (
            "skip_build_gradient_and_device",
            SkipCheck.SKIP_CHECK_BUILD_GRADIENT | SkipCheck.SKIP_CHECK_DEVICE,
        ),
    ):
        patcher.unpatch(MLP)
        patcher.patch(MLP, patcher.Settings(skip_check=skip))
        model = MLP()
        model(x)  # build
        engine_entry.Entry.run = lambda self, state, call, recompute=False: constant  # type: ignore[method-assign]
        try:
            hit_us = _median_us(lambda model=model: model(x))
        finally:
            engine_entry.Entry.run = real_run  # type: ignore[method-assign]
        results[f"hit_path_us_{label}"] = round(hit_us, 2)
        results[f"hit_path_share_of_eager_step_{label}"] = round(hit_us / (eager_ms * 1e3), 4)
    results.update(bert_hit_path())
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    for key, value in results.items():
        print(f"{key:48} {value}")
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
