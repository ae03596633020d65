"""Where a training step's time goes, in ORT and in eager PyTorch, at 1 and 2 threads.

    python benchmarks/bench_profile.py [--steps 20] [--threads 1,2]

For the TransformerEncoderLayer of bench_engine.py (d 256, 4 heads, ff 1024, x 16x64x256):
1. ORT's own profiler (`enable_profiling`) over `--steps` training steps, aggregated per operator
   type and split into the forward and the backward run of the training agent, next to
   torch.profiler's self time per ATen operator of the same eager steps. The sum of ORT's kernel
   times against the run's wall time shows the executor's own cost.
2. The ORT session settings, each changed alone against the engine's defaults, every variant's
   steps interleaved with eager's in one process (median ratio): intra-op threads, spinning,
   execution mode, graph optimisation level, the shared CPU memory arena (off), and
   `scaled_dot_product_attention` as a torch-calling node (torch's fused CPU kernel) instead of
   the ONNX MatMul/Softmax path. Which operators each optimisation level leaves in the graph
   (the fusions it applied) comes from the profile of two steps per level.
3. The cost of one torch-calling node: an MLP with `tanh` run in ORT, and again with `tanh`
   routed to torch (`EngineOptions(torch_ops=("aten::tanh",))`), interleaved with eager.

Results: benchmarks/results/profile.json and tables on stdout. Both sides run with
`OMP_WAIT_POLICY=PASSIVE`; on a shared machine the ratios are the numbers to read.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import collections
import copy
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).resolve().parent / "results" / "profile.json"
WARMUP = 10  # past the 8 calls after which the fixed input shape gets its static graph

Loss = Callable[[torch.Tensor], torch.Tensor]


def _transformer(dropout: float = 0.0) -> tuple[nn.Module, torch.Tensor, Loss]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=dropout, batch_first=True)
    return layer, torch.randn(16, 64, 256), lambda out: (out * out).mean()


def _tanh_mlp() -> tuple[nn.Module, torch.Tensor, Loss]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    return model, torch.randn(32, 64), lambda out: (out * out).mean()


def _engine(
    model: nn.Module,
    threads: int,
    torch_ops: tuple[str, ...] = (),
    static_after: int | None = None,
    engine_options: dict[str, Any] | None = None,
    **settings: Any,
):
    from ort_autopatch.engine import EngineOptions, ModuleEngine

    options = EngineOptions(threads=threads, torch_ops=torch_ops, **(engine_options or {}))
    if static_after is not None:
        options = dataclasses.replace(options, static_after=static_after)
    engine = ModuleEngine(model, options=options)
    engine.settings = dataclasses.replace(engine.settings, **settings)
    return engine


class _Runner:
    """One side of an interleaved comparison: a callable, its parameters' optimizer, its times."""

    def __init__(self, call: Callable[..., Any], model: nn.Module) -> None:
        self.call = call
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.times: list[float] = []

    def step(self, x: torch.Tensor, loss_fn: Loss) -> float:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss_fn(self.call(x)).backward()
        self.opt.step()
        return time.perf_counter() - start


def _interleaved(
    make: Callable[[], tuple[nn.Module, torch.Tensor, Loss]],
    variants: dict[str, Callable[[nn.Module], Any]],
    steps: int,
) -> dict[str, dict[str, Any]]:
    """Median step time of eager and of each variant, taking turns step by step."""
    model, x, loss_fn = make()
    eager = copy.deepcopy(model)
    runners = {"eager": _Runner(eager, eager)}
    failed: dict[str, dict[str, Any]] = {}
    for name, build in variants.items():
        copied = copy.deepcopy(model)
        runner = _Runner(build(copied), copied)
        try:
            runner.step(x, loss_fn)
        except Exception as exc:  # a setting ORT refuses for training: record why
            failed[name] = {"error": str(exc)[:300]}
            continue
        runners[name] = runner
    for k in range(WARMUP + steps):
        for runner in runners.values():
            took = runner.step(x, loss_fn)
            if k >= WARMUP:
                runner.times.append(took)
    base = statistics.median(runners["eager"].times)
    timed: dict[str, dict[str, Any]] = {
        name: {
            "step_ms": statistics.median(r.times) * 1e3,
            "ratio": statistics.median(r.times) / base,
        }
        for name, r in runners.items()
    }
    return {**timed, **failed}


# --- 1. per-operator profiles ---------------------------------------------------------------
def ort_profile(threads: int, steps: int, dropout: float) -> dict[str, Any]:
    """ORT's per-node profile of `steps` training steps, per operator and phase, ms per step."""
    from ort_autopatch.engine import session

    model, x, loss_fn = _transformer(dropout)
    with tempfile.TemporaryDirectory(prefix="ort_autopatch-profile-") as folder:
        # One session only (each profiles on its own clock): the static-shape graph the fixed
        # input earns after `--static-after` calls, built on the first call here.
        engine = _engine(model, threads, static_after=1, profile_prefix=os.path.join(folder, "ort"))
        runner = _Runner(engine, model)
        for _ in range(WARMUP + steps):
            runner.step(x, loss_fn)
        paths = session.end_profiles()
        events = [e for path in paths for e in json.loads(Path(path).read_text())]
        del engine
    return _aggregate(events, steps)


def _aggregate(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Node events per (phase, op type). The training agent runs the graph in two parts per
    step (forward, then backward), each an executor run: alternate runs are the phases."""
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e["name"].endswith("::Execute")),
        key=lambda e: e["ts"],
    )[-2 * steps :]
    spans = [
        (e["ts"], e["ts"] + e["dur"], "forward" if k % 2 == 0 else "backward")
        for k, e in enumerate(runs)
    ]
    per_op: dict[str, collections.Counter[str]] = {
        "forward": collections.Counter(),
        "backward": collections.Counter(),
    }
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        phase = next((p for start, end, p in spans if start <= e["ts"] <= end), None)
        if phase is not None:
            per_op[phase][e["args"]["op_name"]] += e["dur"]
    wall = collections.Counter()
    for start, end, phase in spans:
        wall[phase] += end - start
    result: dict[str, Any] = {}
    for phase, ops in per_op.items():
        kernels = sum(ops.values())
        result[phase] = {
            "wall_ms": wall[phase] / steps / 1e3,
            "kernels_ms": kernels / steps / 1e3,
            "ops_ms": {op: us / steps / 1e3 for op, us in ops.most_common()},
        }
    return result


def eager_profile(threads: int, steps: int, dropout: float) -> dict[str, Any]:
    """torch.profiler's self CPU time per ATen operator, and the phases' wall times."""
    from torch.profiler import ProfilerActivity, profile

    model, x, loss_fn = _transformer(dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    phases = collections.Counter()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = loss_fn(model(x))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        phases["forward"] += t1 - t0
        phases["backward"] += t2 - t1
        opt.step()

    for _ in range(WARMUP):
        step()
    phases.clear()
    for _ in range(steps):
        step()
    wall = {p: s / steps * 1e3 for p, s in phases.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops = {
        a.key: a.self_cpu_time_total / steps / 1e3
        for a in prof.key_averages()
        if a.key.startswith("aten::") and a.self_cpu_time_total > 0
    }
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
    return {"wall_ms": wall, "ops_ms": top}


# --- 2. session settings --------------------------------------------------------------------
def settings_sweep(threads: int, steps: int) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(threads)
    variants: dict[str, Callable[[nn.Module], Any]] = {
        "default": lambda m: _engine(m, threads),
        "spinning": lambda m: _engine(m, threads, spinning=True),
        "parallel execution": lambda m: _engine(m, threads, parallel=True),
        "optimization basic": lambda m: _engine(m, threads, optimization="basic"),
        "optimization extended": lambda m: _engine(m, threads, optimization="extended"),
        "no memory arena": lambda m: _engine(m, threads, engine_options={"memory_arena": False}),
        "sdpa as torch node": lambda m: _engine(
            m, threads, torch_ops=("aten::scaled_dot_product_attention",)
        ),
    }
    # ORT's own thread pool, not torch's OpenMP one: the two never run at the same time
    other = 1 if threads > 1 else 2
    variants[f"ORT {other} thread(s)"] = lambda m: _engine(m, other)
    return _interleaved(_transformer, variants, steps)


def fusions(threads: int) -> dict[str, dict[str, int]]:
    """How many nodes of each operator type ORT runs per step at each optimisation level (two
    profiled steps each): what the level's fusions changed in the gradient graph."""
    from ort_autopatch.engine import session

    found: dict[str, dict[str, int]] = {}
    for level in ("disable", "basic", "extended", "all"):
        model, x, loss_fn = _transformer()
        with tempfile.TemporaryDirectory(prefix="ort_autopatch-profile-") as folder:
            engine = _engine(
                model, threads, optimization=level, profile_prefix=os.path.join(folder, "ort")
            )
            runner = _Runner(engine, model)
            for _ in range(2):
                runner.step(x, loss_fn)
            events = [e for p in session.end_profiles() for e in json.loads(Path(p).read_text())]
            del engine
        nodes = {
            (e["name"], e["args"]["op_name"])
            for e in events
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
        }
        found[level] = dict(sorted(collections.Counter(op for _, op in nodes).items()))
    return found


# --- 3. one torch-calling node --------------------------------------------------------------
def torch_node_overhead(steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    timings = _interleaved(
        _tanh_mlp,
        {
            "ORT": lambda m: _engine(m, 1),
            "ORT, tanh as torch node": lambda m: _engine(m, 1, torch_ops=("aten::tanh",)),
        },
        steps,
    )
    per_node = timings["ORT, tanh as torch node"]["step_ms"] - timings["ORT"]["step_ms"]
    return {"timings": timings, "per_node_per_step_us": per_node * 1e3}


def _relu_mlp() -> tuple[nn.Module, torch.Tensor, Loss]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return model, torch.randn(64, 64), lambda out: (out * out).mean()


def gradient_node_overhead(steps: int) -> dict[str, Any]:
    """ReLU's gradient (64x256 floats, 2^14) three ways: ORT's `ReluGrad` kernel, an `ATen`
    node through the compiled executor, a `PythonOp` node (`torch_in_graph/gradients.py`)."""
    torch.set_num_threads(1)
    timings = _interleaved(
        _relu_mlp,
        {
            "ORT ReluGrad": lambda m: _engine(
                m, 1, engine_options={"no_torch_ops": ("aten::threshold_backward",)}
            ),
            "ATen node": lambda m: _engine(m, 1),
            "PythonOp node": lambda m: _engine(m, 1, engine_options={"compile_executor": False}),
        },
        steps,
    )
    base = timings["ORT ReluGrad"]["step_ms"]
    return {
        "timings": timings,
        "against_orts_kernel_us": {
            name: (timings[name]["step_ms"] - base) * 1e3 for name in ("ATen node", "PythonOp node")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    thread_counts = [int(t) for t in args.threads.split(",")]

    from ort_autopatch.engine import runtime

    report: dict[str, Any] = {
        "environment": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "onnxruntime": runtime.version(),
            "cpu_count": os.cpu_count(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "load_average": os.getloadavg(),
            "steps": args.steps,
        },
        "model": "TransformerEncoderLayer d256 h4 ff1024 dropout 0, x(16,64,256)",
        "threads": {},
    }
    for threads in thread_counts:
        torch.set_num_threads(threads)
        report["threads"][str(threads)] = {
            "ort": ort_profile(threads, args.steps, 0.0),
            "eager": eager_profile(threads, args.steps, 0.0),
            "settings": settings_sweep(threads, args.steps),
        }
    report["fusions"] = fusions(thread_counts[0])
    report["torch_node"] = torch_node_overhead(max(args.steps * 5, 100))
    report["gradient_node"] = gradient_node_overhead(max(args.steps * 5, 100))
    report["environment"]["load_average_after"] = os.getloadavg()

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    _print(report)
    print(f"\nwritten to {args.output}")
    return 0


def _print(report: dict[str, Any]) -> None:
    env = report["environment"]
    print(
        f"{report['model']}; torch {env['torch']}, onnxruntime {env['onnxruntime']}, "
        f"{env['date']}, load average {env['load_average'][0]:.2f} -> "
        f"{env['load_average_after'][0]:.2f}"
    )
    for threads, t in report["threads"].items():
        ort, eager = t["ort"], t["eager"]
        print(f"\n== {threads} thread(s): ms per step, ORT (profiled) vs eager ==")
        for phase in ("forward", "backward"):
            o = ort[phase]
            print(
                f"{phase:<9} ORT wall {o['wall_ms']:6.1f} (kernels {o['kernels_ms']:6.1f})   "
                f"eager wall {eager['wall_ms'].get(phase, float('nan')):6.1f}"
            )
        ort_ops = collections.Counter()
        for phase in ("forward", "backward"):
            ort_ops.update(ort[phase]["ops_ms"])
        print(f"{'ORT op (fw+bw)':<28}{'ms':>7}    {'eager op (self)':<36}{'ms':>7}")
        eager_ops = list(eager["ops_ms"].items())[:12]
        for k, (op, ms) in enumerate(ort_ops.most_common(12)):
            right = f"{eager_ops[k][0]:<36}{eager_ops[k][1]:7.2f}" if k < len(eager_ops) else ""
            print(f"{op:<28}{ms:7.2f}    {right}")
        print(f"{'setting':<24}{'step ms':>9}{'ratio':>7}")
        for name, v in t["settings"].items():
            if "error" in v:
                print(f"{name:<24} refused: {v['error'][-70:]}")
            else:
                print(f"{name:<24}{v['step_ms']:9.1f}{v['ratio']:7.2f}")
    base = report["fusions"]["disable"]
    for level, ops in report["fusions"].items():
        changed = {
            op: ops.get(op, 0) - base.get(op, 0)
            for op in {*ops, *base}
            if ops.get(op, 0) != base.get(op, 0)
        }
        print(f"optimisation {level}: {sum(ops.values())} nodes; vs disable {changed or '-'}")
    node = report["torch_node"]
    print(f"one torch-calling node: {node['per_node_per_step_us']:.0f} us per training step")
    for name, v in node["timings"].items():
        print(f"  {name:<26}{v['step_ms']:8.3f} ms{v['ratio']:7.2f}")
    grad = report["gradient_node"]
    print("ReLU's gradient (2^14 floats) three ways, us per step against ORT's kernel:")
    for name, v in grad["timings"].items():
        delta = grad["against_orts_kernel_us"].get(name, 0.0)
        print(f"  {name:<26}{v['step_ms']:8.3f} ms{v['ratio']:7.2f}  {delta:+6.0f} us")


if __name__ == "__main__":
    raise SystemExit(main())
