"""What benchmarks/gpu_check.sh runs once the CUDA builds are installed: the zoo's parity on a
device, then BERT-base and GPT-2 small training steps (batch 8, sequence 128) eager vs ORT, fp32
and fp16 autocast.

    python benchmarks/gpu_bench.py --out DIR [--device cuda] [--tiny] [--steps 10]

`--device cpu --tiny` runs the same code with tiny configurations (how it is tested without a
GPU). Writes DIR/gpu_parity.json and DIR/gpu_steps.json; exit status 1 when a parity entry fails.
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
from tests.zoo import harness  # noqa: E402
from tests.zoo.models import ENTRIES  # noqa: E402


def parity(device: str) -> list[dict[str, Any]]:
    rows = []
    for entry in ENTRIES:
        try:
            result = harness.run(entry, device=device).as_dict()
        except Exception as exc:  # one broken entry must not hide the others
            result = {"model": entry.name, "status": "error", "reason": repr(exc)[:500]}
        result["expected_fallback"] = entry.expect_fallback
        rows.append(result)
        print(
            f"parity {entry.name}: {result['status']} {result.get('reason', '')[:120]}", flush=True
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
    device: str, tiny: bool, count: int, batch: int = 8, length: int = 128
) -> list[dict[str, Any]]:
    rows = []
    for name, build in _models(tiny).items():
        for precision in ("fp32", "fp16"):
            row: dict[str, Any] = {"model": name, "precision": precision, "batch": batch}
            row["sequence"] = length
            try:
                torch.manual_seed(0)
                model: Any = build().to(device).train()
                vocab = int(model.config.vocab_size)
                ids = torch.randint(0, vocab, (batch, length), device=device)
                for side in ("eager", "ort"):
                    call: Callable[..., Any] = model if side == "eager" else ModuleEngine(model)
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
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ok = True
    if not args.skip_parity:
        rows = parity(args.device)
        (args.out / "gpu_parity.json").write_text(json.dumps(rows, indent=1) + "\n")
        ok = all(r["status"] == ("fallback" if r["expected_fallback"] else "ort") for r in rows)
    timings = steps(args.device, args.tiny, args.steps)
    (args.out / "gpu_steps.json").write_text(json.dumps(timings, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
