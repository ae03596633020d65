"""What benchmarks/gpu_check.sh runs once the CUDA builds are installed: the zoo's parity on a
device, then BERT-base and GPT-2 small training steps (batch 8, sequence 128) eager vs ORT, fp32
and fp16 autocast.

    python benchmarks/gpu_bench.py --out DIR [--device cuda] [--tiny] [--steps 10]
                                   [--backend ort-training|ort]

It runs on the backend this environment has (the two builds cannot share one); `--backend`
makes sure that is the one meant (exit status 2 otherwise), and every result names it.
First the engine benchmark's models (and a module whose second output no loss reads) for 3
SGD steps through the engine against eager on the device. `--device cpu --tiny` runs the
same code with tiny configurations (how it is tested without a GPU). Writes
DIR/gpu_engine_models.json, DIR/gpu_parity.json and DIR/gpu_steps.json; exit status 1 when
an engine model or a parity entry fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ort_autopatch.engine import ModuleEngine  # noqa: E402
from ort_autopatch.engine import backend as registry  # noqa: E402
from ort_autopatch.engine.recipe import EngineOptions  # noqa: E402
from tests.zoo import harness  # noqa: E402
from tests.zoo.models import ENTRIES  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_engine  # noqa: E402  (its models)


class _TwoHeads(torch.nn.Module):
    """Two outputs, the loss reads the first: the second's gradient is zero-filled (on the
    outputs' device) before the backward graph runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(64, 64)
        self.first = torch.nn.Linear(64, 10)
        self.second = torch.nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.first(h), self.second(h)


def _engine_cases() -> dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor]]]:
    def bench(name: str) -> Callable[[], tuple[torch.nn.Module, torch.Tensor]]:
        def make() -> tuple[torch.nn.Module, torch.Tensor]:
            model, inputs, _ = bench_engine.MODELS[name]()
            return model, inputs[0]

        return make

    cases = {name: bench(name) for name in ("mlp", "transformer_p0", "cnn")}
    cases["two_heads"] = lambda: (_TwoHeads(), torch.randn(32, 64))
    return cases


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the largest eager value, or to 1e-3 when that is
    smaller (zero-initialised biases that three steps moved by 1e-8)."""
    scale = max(float(expected.detach().abs().max()), 1e-3)
    return float((actual.detach() - expected.detach()).abs().max()) / scale


def engine_models(device: str, backend: str, steps: int = 3) -> list[dict[str, Any]]:
    """The engine benchmark's models (and `_TwoHeads`), `steps` SGD steps through the engine
    against eager on `device`: losses, parameters and buffers (BatchNorm's statistics,
    written back on the device), relative to each eager tensor's largest value. SGD, not
    Adam: Adam's step has the size of the learning rate whatever the gradient, so a gradient
    that is rounding noise (a convolution's bias before BatchNorm) moves its parameter as far
    as a real one. 1e-3: on Ampere and newer, ORT's CUDA kernels may compute float32 matmuls
    in TF32."""
    import copy

    rows = []
    for name, make in _engine_cases().items():
        row: dict[str, Any] = {"model": name, "backend": backend}
        try:
            torch.manual_seed(0)
            model, x = make()
            model, x = model.to(device).train(), x.to(device)
            eager, ours = copy.deepcopy(model), copy.deepcopy(model)
            engine = ModuleEngine(ours, EngineOptions(backend=backend))
            worst = 0.0
            sides = [(eager, eager), (engine, ours)]
            optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for _, m in sides]
            for _ in range(steps):
                losses = []
                for (call, _), opt in zip(sides, optimizers, strict=True):
                    out = call(x)
                    first = out[0] if isinstance(out, tuple) else out
                    loss = first.float().pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(loss.detach())
                    row["output_device"] = str(first.device)
                worst = max(worst, _rel(losses[1], losses[0]))
            for a, e in zip(
                [*ours.parameters(), *ours.buffers()],
                [*eager.parameters(), *eager.buffers()],
                strict=True,
            ):
                if a.is_floating_point():
                    worst = max(worst, _rel(a, e))
            row["max_rel_diff"] = worst
            row["graphs_built"] = len(engine.records)
            ran = engine.records and row["output_device"].startswith(device)
            row["status"] = "ok" if ran and worst <= 1e-3 else "mismatch" if ran else "eager"
        except Exception as exc:
            row["status"] = "failed"
            row["reason"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            traceback.print_exc()
        print(f"engine {name} ({backend}): {row}", flush=True)
        rows.append(row)
    return rows


def parity(device: str, backend: str) -> list[dict[str, Any]]:
    rows = []
    for entry in ENTRIES:
        try:
            result = harness.run(entry, device=device).as_dict()
        except Exception as exc:  # one broken entry must not hide the others
            result = {"model": entry.name, "status": "error", "reason": repr(exc)[:500]}
        result["expected_fallback"] = entry.expect_fallback
        result["backend"] = backend
        rows.append(result)
        print(
            f"parity {entry.name} ({backend}): {result['status']} {result.get('reason', '')[:120]}",
            flush=True,
        )
    return rows


def _models(tiny: bool) -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers

    small = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    return {
        "bert-base": lambda: transformers.BertForMaskedLM(
            transformers.BertConfig(**(small | {"intermediate_size": 128} if tiny else {}))
        ),
        "gpt2-small": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(**({"n_layer": 2, "n_embd": 64, "n_head": 4} if tiny else {}))
        ),
    }


@contextlib.contextmanager
def _precision(device: str, precision: str) -> Iterator[None]:
    if precision == "fp16":
        with torch.autocast(device_type=device, dtype=torch.float16):
            yield
    else:
        yield


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def steps(
    device: str, tiny: bool, count: int, backend: str, batch: int = 8, length: int = 128
) -> list[dict[str, Any]]:
    rows = []
    for name, build in _models(tiny).items():
        for precision in ("fp32", "fp16"):
            row: dict[str, Any] = {"model": name, "precision": precision, "batch": batch}
            row["backend"] = backend
            row["sequence"] = length
            try:
                torch.manual_seed(0)
                model: Any = build().to(device).train()
                vocab = int(model.config.vocab_size)
                ids = torch.randint(0, vocab, (batch, length), device=device)
                for side in ("eager", "ort"):
                    call: Callable[..., Any] = (
                        model
                        if side == "eager"
                        else ModuleEngine(model, EngineOptions(backend=backend))
                    )
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                    times = []
                    for k in range(count + 3):
                        _sync(device)
                        start = time.perf_counter()
                        with _precision(device, precision):
                            loss = call(input_ids=ids, labels=ids).loss
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        _sync(device)
                        if k == 0:
                            row[f"{side}_first_step_s"] = round(time.perf_counter() - start, 3)
                        elif k >= 3:
                            times.append(time.perf_counter() - start)
                    row[f"{side}_step_ms"] = round(statistics.median(times) * 1e3, 3)
                    row[f"{side}_loss"] = float(loss)
                row["ratio"] = round(row["ort_step_ms"] / row["eager_step_ms"], 3)
                row["status"] = "ok"
            except Exception as exc:
                row["status"] = "failed"
                row["reason"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                traceback.print_exc()
            print(f"steps {name} {precision}: {row}", flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--backend", choices=registry.names(), help="the one expected here")
    args = parser.parse_args(argv)
    backend = registry.resolve("auto")
    why = registry.unavailable_reason(args.backend or "auto")
    if why is not None or args.backend not in (None, backend):
        why = why or f"'auto' picks {backend} here"
        print(f"gpu_bench: backend {args.backend or 'auto'} cannot run here: {why}")
        return 2
    print(f"gpu_bench: backend {backend}, onnxruntime {registry.version(backend)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    models = engine_models(args.device, backend)
    (args.out / "gpu_engine_models.json").write_text(json.dumps(models, indent=1) + "\n")
    ok = all(r["status"] == "ok" for r in models)
    if not args.skip_parity:
        rows = parity(args.device, backend)
        (args.out / "gpu_parity.json").write_text(json.dumps(rows, indent=1) + "\n")
        ok = ok and all(
            r["status"] == ("fallback" if r["expected_fallback"] else "ort") for r in rows
        )
    timings = steps(args.device, args.tiny, args.steps, backend)
    (args.out / "gpu_steps.json").write_text(json.dumps(timings, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
