"""Step time, first-call time and peak memory of ModuleEngine against eager PyTorch.

    python benchmarks/bench_engine.py [--steps 50] [--min-seconds 5] [--warmup 10]
                                      [--threads 1,2] [--fresh-runs 7]
                                      [--models mlp,transformer,transformer_p0,cnn]
                                      [--backend ort-training|ort] [--output PATH]

A step is forward + loss + backward + AdamW step. Eager and the engine each run in a fresh
process of their own (as a user runs one or the other) and take steps in turn (so both see the
same machine load), in pairs whose order alternates; the medians of at least `--steps` pairs
and `--min-seconds` after `--warmup` untimed pairs are reported, with their ratio and the
median of the per-pair ratios, at each `--threads` count (torch.set_num_threads; the engine's
ORT sessions follow it). The same pairs interleaved in this one process follow, as
`same_process` (sharing a process, the two sides change each other's allocator: `lockstep`).
The first call (export + gradient build + session + the first step) is measured in fresh
subprocesses of this script, so ONNX Runtime's import and the exporter's first-use warm-up are
counted as a user pays them: the median of `--fresh-runs` processes, each engine process
followed by an eager one (a single process is at the mercy of the machine: 0.25 to 0.58 s for
one commit at load 1); the first call of a second model instance in the already-warm main
process is reported as well. Peak RSS comes from the median fresh subprocesses (eager-only and
engine), so the two are comparable.

`--backend` picks the engine's backend (EngineOptions.backend): the training build by default;
`benchmarks/bench_plain.py` is this benchmark on the plain backend (`ort`), in the environment
that has it (`nox -s bench_plain`), with its results in plain.json.

Results: benchmarks/results/engine.json, and a table on stdout.
"""

from __future__ import annotations

import os

# OpenMP spin-waiting can make 2-thread steps on small VMs tens of times slower and turns any
# interleaved comparison into noise: both sides run with passive waiting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"


# --- models -----------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(512, 512)
        self.fc2 = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(64, 512)
    y = torch.randint(0, 10, (64,))
    return MLP(), (x,), lambda out: F.cross_entropy(out, y)


def _transformer(
    dropout: float = 0.1,
) -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=256, nhead=4, dim_feedforward=1024, dropout=dropout, batch_first=True
    )
    x = torch.randn(16, 64, 256)
    return layer, (x,), lambda out: (out * out).mean()


def _cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 10),
    )
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return model, (x,), lambda out: F.cross_entropy(out, y)


MODELS: dict[
    str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]]
] = {
    "mlp": _mlp,
    "transformer": _transformer,
    "transformer_p0": lambda: _transformer(0.0),
    "cnn": _cnn,
}
DESCRIPTIONS = {
    "mlp": "MLP 512-512-10, batch 64",
    "transformer": "TransformerEncoderLayer d256 h4 ff1024 dropout 0.1, x(16,64,256)",
    "transformer_p0": "TransformerEncoderLayer d256 h4 ff1024 dropout 0, x(16,64,256)",
    "cnn": "Conv3-16 + BatchNorm + ReLU + MaxPool + Linear, x(8,3,32,32)",
}


def _step(
    call: Callable[..., Any], opt: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...], loss_fn
) -> float:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(call(*inputs))
    loss.backward()
    opt.step()
    return float(loss.detach())


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / (1024 * 1024)
    except ImportError:  # pragma: no cover
        return float("nan")


# --- child: a fresh interpreter measuring one side ----------------------------------------------
def _engine(model: nn.Module, backend: str) -> Any:
    from ort_autopatch.engine import ModuleEngine
    from ort_autopatch.engine.recipe import EngineOptions

    return ModuleEngine(model, EngineOptions(backend=backend))


def child(model_name: str, side: str, steps: int, backend: str) -> dict[str, Any]:
    start = time.perf_counter()
    model, inputs, loss_fn = MODELS[model_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rss_before = _rss_mb()
    result: dict[str, Any] = {"model": model_name, "side": side}
    if side == "engine":
        engine = _engine(model, backend)
        call: Callable[..., Any] = engine
    else:
        call = model
    t0 = time.perf_counter()
    out = call(*inputs)
    t1 = time.perf_counter()
    loss = loss_fn(out)
    loss.backward()
    opt.step()
    t2 = time.perf_counter()
    result["first_forward_s"] = t1 - t0
    result["first_step_s"] = t2 - t0
    times = []
    for _ in range(steps):
        s = time.perf_counter()
        _step(call, opt, inputs, loss_fn)
        times.append(time.perf_counter() - s)
    result["steady_step_s"] = statistics.median(times) if times else None
    if side == "engine":
        result["records"] = [
            {
                "reason": r.reason,
                "export_s": r.export_seconds,
                "build_s": r.build_seconds,
                "training": r.has_backward,
            }
            for r in engine.records
        ]
        result["builds"] = engine.builds
    result["rss_before_mb"] = rss_before
    result["rss_mb"] = _rss_mb()
    result["peak_rss_mb"] = _peak_rss_mb()
    result["process_s"] = time.perf_counter() - start
    return result


def run_child(model_name: str, side: str, steps: int, backend: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        model_name,
        side,
        "--child-steps",
        str(steps),
        "--backend",
        backend,
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"child {model_name}/{side} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fresh_runs(model_name: str, runs: int, backend: str) -> dict[str, Any]:
    """`runs` fresh processes of each side, an engine process then an eager one (both see
    the same moment of the machine); per side the run whose first step is the median, and
    every first step."""
    samples: dict[str, list[dict[str, Any]]] = {"engine": [], "eager": []}
    for _ in range(runs):
        for side, results in samples.items():
            results.append(run_child(model_name, side, 5, backend))
    chosen: dict[str, Any] = {}
    for side, results in samples.items():
        ordered = sorted(results, key=lambda r: float(r["first_step_s"]))
        chosen[side] = ordered[(len(ordered) - 1) // 2]  # the lower median: a real run
        chosen[side]["first_step_samples_s"] = [r["first_step_s"] for r in results]
    return chosen


# --- lockstep: each side in a process of its own, steps taken in turn ------------------------
def lockstep_child(model_name: str, side: str, threads: int, backend: str) -> int:
    """One side's process for `lockstep`: its first step (the build), then "ready"; a step per
    line read, each answered with its seconds; at "done", a JSON line of its builds."""
    torch.set_num_threads(threads)
    model, inputs, loss_fn = MODELS[model_name]()
    call: Any = _engine(model, backend) if side == "engine" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(call, opt, inputs, loss_fn)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "done":
            break
        start = time.perf_counter()
        _step(call, opt, inputs, loss_fn)
        print(time.perf_counter() - start, flush=True)
    builds = call.builds if side == "engine" else 0
    print(json.dumps({"builds": builds}), flush=True)
    return 0


def lockstep(
    model_name: str, steps: int, warmup: int, min_seconds: float, backend: str, threads: int
) -> dict[str, Any]:
    """Eager and the engine each in a fresh process of its own, as a user runs one or the
    other, taking steps in turn (pairs whose order alternates) so that both see the same
    moment of the machine: `interleaved`'s pairs without sharing a process.

    Why not one process: the two sides share its allocator, and each changes what the other
    pays. ONNX Runtime's first large allocation raises glibc's threshold for serving large
    blocks from fresh pages, so the bench MLP's eager steps in a process where the engine has
    run took 1.81 ms with 28 page faults a step, and 2.39 ms with 480 in a process of their
    own (2026-12-05, 1 thread): the process a user runs eagerly is the second one."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, str(Path(__file__).resolve()), "--backend", backend]
    sides = ("eager", "engine")
    procs = {
        side: subprocess.Popen(
            [*command, "--lockstep", model_name, side, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for side in sides
    }

    def ask(side: str, line: str) -> str:
        proc = procs[side]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"lockstep {model_name}/{side} exited ({proc.wait()})")
        return answer.strip()

    try:
        for side in sides:
            out = procs[side].stdout
            assert out is not None
            if out.readline().strip() != "ready":
                raise RuntimeError(f"lockstep {model_name}/{side} failed ({procs[side].wait()})")
        for _ in range(warmup):
            for side in sides:
                ask(side, "step")
        times: dict[str, list[float]] = {side: [] for side in sides}
        start, pairs = time.perf_counter(), 0
        while pairs < steps or time.perf_counter() - start < min_seconds:
            for side in sides if pairs % 2 == 0 else sides[::-1]:
                times[side].append(float(ask(side, "step")))
            pairs += 1
        builds = json.loads(ask("engine", "done"))["builds"]
        ask("eager", "done")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    eager_times, engine_times = times["eager"], times["engine"]
    eager_ms = statistics.median(eager_times) * 1e3
    engine_ms = statistics.median(engine_times) * 1e3
    return {
        "eager_step_ms": eager_ms,
        "engine_step_ms": engine_ms,
        "ratio_engine_over_eager": engine_ms / eager_ms,
        "ratio_pairwise_median": statistics.median(
            o / e for e, o in zip(eager_times, engine_times, strict=True)
        ),
        "steps": pairs,
        "eager_step_ms_p10_p90": [_pct(eager_times, 10) * 1e3, _pct(eager_times, 90) * 1e3],
        "engine_step_ms_p10_p90": [_pct(engine_times, 10) * 1e3, _pct(engine_times, 90) * 1e3],
        "lockstep_builds": builds,
    }


# --- parent: interleaved steady-state steps ---------------------------------------------------
def interleaved(
    model_name: str, steps: int, warmup: int, min_seconds: float = 0.0, backend: str = "auto"
) -> dict[str, Any]:
    import copy

    model, inputs, loss_fn = MODELS[model_name]()
    eager_model = copy.deepcopy(model)
    engine_model = copy.deepcopy(model)
    engine = _engine(engine_model, backend)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-4)
    engine_opt = torch.optim.AdamW(engine_model.parameters(), lr=1e-4)

    t0 = time.perf_counter()
    _step(engine, engine_opt, inputs, loss_fn)
    warm_first = time.perf_counter() - t0  # ORT imported and warmed by an earlier model (or not)

    eager_times: list[float] = []
    engine_times: list[float] = []
    sides = [(eager_model, eager_opt, eager_times), (engine, engine_opt, engine_times)]
    for _ in range(warmup):
        for call, opt, _times in sides:
            _step(call, opt, inputs, loss_fn)
    # Pairs of steps, eager first and ORT first in turn (whichever runs second finds the
    # caches the other left), until `steps` pairs and `min_seconds` are both reached: a
    # millisecond step needs hundreds of pairs for a median that holds from run to run.
    start, pairs = time.perf_counter(), 0
    while pairs < steps or time.perf_counter() - start < min_seconds:
        for call, opt, times in sides if pairs % 2 == 0 else sides[::-1]:
            s = time.perf_counter()
            _step(call, opt, inputs, loss_fn)
            times.append(time.perf_counter() - s)
        pairs += 1

    # A second instance of the same class in this warm process: what a second model pays.
    second, _, _ = MODELS[model_name]()
    second_engine = _engine(second, backend)
    second_opt = torch.optim.AdamW(second.parameters(), lr=1e-4)
    s = time.perf_counter()
    _step(second_engine, second_opt, inputs, loss_fn)
    second_first = time.perf_counter() - s
    eager_ms = statistics.median(eager_times) * 1e3
    engine_ms = statistics.median(engine_times) * 1e3
    pairwise = statistics.median(o / e for e, o in zip(eager_times, engine_times, strict=True))
    return {
        "eager_step_ms": eager_ms,
        "engine_step_ms": engine_ms,
        "ratio_engine_over_eager": engine_ms / eager_ms,
        "ratio_pairwise_median": pairwise,  # each ORT step over the eager step of its pair
        "steps": pairs,
        "eager_step_ms_p10_p90": [_pct(eager_times, 10) * 1e3, _pct(eager_times, 90) * 1e3],
        "engine_step_ms_p10_p90": [_pct(engine_times, 10) * 1e3, _pct(engine_times, 90) * 1e3],
        "first_call_in_process_s": warm_first,
        "second_model_first_call_in_process_s": second_first,
        "builds": engine.builds,
        "build_records": [
            {
                "reason": r.reason,
                "export_s": r.export_seconds,
                "build_s": r.build_seconds,
                "training": r.has_backward,
            }
            for r in engine.records
        ],
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def main(
    argv: list[str] | None = None,
    backend: str = "ort-training",
    output: Path = RESULTS,
    doc: str | None = __doc__,
) -> int:
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=50, help="at least this many step pairs")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=5.0,
        help="and step pairs for at least this long, per model and thread count",
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts")
    parser.add_argument(
        "--fresh-runs",
        type=int,
        default=7,
        help="fresh processes per side for the first call (their median is reported)",
    )
    parser.add_argument("--backend", default=backend, choices=("ort-training", "ort"))
    parser.add_argument("--output", type=Path, default=output)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "SIDE"), help=argparse.SUPPRESS)
    parser.add_argument("--child-steps", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--lockstep", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.child_steps, args.backend)))
        return 0
    if args.lockstep:
        model_name, side, threads = args.lockstep
        return lockstep_child(model_name, side, int(threads), args.backend)

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")

    from ort_autopatch.engine import backend as registry

    reason = registry.unavailable_reason(args.backend)
    if reason is not None:
        parser.error(f"backend {args.backend} cannot run here: {reason}")
    report: dict[str, Any] = {
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "backend": args.backend,
            "onnxruntime": registry.version(args.backend),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "machine": platform.machine(),
            "steps": args.steps,
            "min_seconds": args.min_seconds,
            "warmup": args.warmup,
            "fresh_runs": max(1, args.fresh_runs),
        },
        "models": {},
    }
    thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    default_threads = torch.get_num_threads()
    # The ATen executor is compiled once per torch install, on the first CPU training graph
    # that wants it: timed here on its own, so the first calls below are every later run's.
    # (the plain backend's graphs call no ATen executor)
    if args.backend == "ort-training":
        from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

        start = time.perf_counter()
        folder = aten_executor.default_folder()
        built = aten_executor.build(folder) if aten_executor.compiler() else None
        report["environment"]["aten_executor"] = {
            "path": str(built),
            "seconds": time.perf_counter() - start,  # ~0 when it was cached already
        }
    report["environment"]["load_average"] = os.getloadavg()
    for name in names:
        fresh = fresh_runs(name, max(1, args.fresh_runs), args.backend)
        fresh_engine, fresh_eager = fresh["engine"], fresh["eager"]
        per_threads = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            same = interleaved(name, args.steps, args.warmup, args.min_seconds, args.backend)
            apart = lockstep(
                name, args.steps, args.warmup, args.min_seconds, args.backend, threads
            )
            same_process = {k: same.pop(k) for k in list(apart) if k in same}
            per_threads[str(threads)] = {**same, **apart, "same_process": same_process}
        torch.set_num_threads(default_threads)
        # the top-level numbers (read by render_report.py) are the default thread count's
        steady = per_threads.get(str(default_threads)) or per_threads[str(thread_counts[-1])]
        report["models"][name] = {
            "description": DESCRIPTIONS[name],
            **steady,
            "threads": {
                t: {
                    k: v
                    for k, v in r.items()
                    if k.endswith("_ms") or k.startswith("ratio") or k in ("steps", "same_process")
                }
                for t, r in per_threads.items()
            },
            "fresh_process": {"engine": fresh_engine, "eager": fresh_eager},
            "first_call_fresh_process_s": fresh_engine["first_step_s"],  # the median
            "first_call_fresh_process_samples_s": fresh_engine["first_step_samples_s"],
            "eager_first_step_fresh_process_s": fresh_eager["first_step_s"],
            "peak_rss_mb": {
                "engine": fresh_engine["peak_rss_mb"],
                "eager": fresh_eager["peak_rss_mb"],
            },
        }
    report["main_process_peak_rss_mb"] = _peak_rss_mb()
    report["environment"]["load_average_after"] = os.getloadavg()
    report["environment"]["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    _print_table(report)
    print(f"\nwritten to {args.output}")
    return 0


def _first_call(model: dict[str, Any]) -> str:
    """The median fresh-process first call and the range of the runs."""
    samples = model.get("first_call_fresh_process_samples_s") or [
        model["first_call_fresh_process_s"]
    ]
    return (
        f"{model['first_call_fresh_process_s']:.3f} ({min(samples):.2f}-{max(samples):.2f})"
    )


def _print_table(report: dict[str, Any]) -> None:
    env = report["environment"]
    print(
        f"{env['date']}: torch {env['torch']}, backend {env.get('backend')}, "
        f"onnxruntime {env['onnxruntime']}, "
        f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}, medians of at least {env['steps']} step "
        f"pairs and {env['min_seconds']:.0f} s after {env['warmup']} warm-up, load average "
        f"{env['load_average'][0]:.2f} -> {env['load_average_after'][0]:.2f}"
    )
    print(
        f"\n{'model':<16} {'threads':>7} {'eager ms':>9} {'engine ms':>10} {'ratio':>6} "
        f"{'pairwise':>8} {'pairs':>6}"
    )
    for name, m in report["models"].items():
        for threads, r in m["threads"].items():
            print(
                f"{name:<16} {threads:>7} {r['eager_step_ms']:>9.2f} {r['engine_step_ms']:>10.2f} "
                f"{r['ratio_engine_over_eager']:>6.2f} {r['ratio_pairwise_median']:>8.2f} "
                f"{r['steps']:>6}"
            )
    print(f"\nat the default {env['torch_threads']} threads:")
    header = (
        f"{'model':<12} {'eager ms':>9} {'engine ms':>10} {'ratio':>6} {'1st call fresh s':>23} "
        f"{'(eager 1st s)':>13} {'2nd model 1st s':>16} {'peak RSS eager/engine MB':>25}"
    )
    print(header)
    print("-" * len(header))
    for name, m in report["models"].items():
        rss = m["peak_rss_mb"]
        cells = [
            f"{name:<12}",
            f"{m['eager_step_ms']:>9.2f}",
            f"{m['engine_step_ms']:>10.2f}",
            f"{m['ratio_engine_over_eager']:>6.2f}",
            f"{_first_call(m):>23}",
            f"{m['eager_first_step_fresh_process_s']:>13.3f}",
            f"{m['second_model_first_call_in_process_s']:>16.3f}",
            f"{rss['eager']:>12.0f} / {rss['engine']:<10.0f}",
        ]
        print(" ".join(cells))
    executor = env.get("aten_executor")
    if executor is not None:
        print(
            f"ATen executor (built once per torch install, before the first calls above): "
            f"{executor['seconds']:.1f} s, {executor['path']}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
