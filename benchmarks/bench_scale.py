"""Models at the size users train: BERT-base, GPT-2 small and ResNet-50, one AdamW step at a
time, eager PyTorch, this tool and torch.compile interleaved in one process.

    python benchmarks/bench_scale.py [--backend ort-training|ort] [--models bert,gpt2,resnet50]
                                     [--batch 2] [--threads 2] [--steps 3] [--tiny]
                                     [--no-compile] [--fresh eager,tool,compile]
                                     [--output PATH]

Each model is built with random weights from transformers' default configuration
(`BertForMaskedLM`, `GPT2LMHeadModel`, sequence 128, labels = the input ids) or torchvision's
`resnet50()` (224x224 images, 1000 classes, cross-entropy), with dropout set to 0: ONNX Runtime
draws other dropout masks than torch's generator, and only without dropout can every step's
loss be held to eager's. `--tiny` builds 2-layer transformers (hidden 128) and ResNet-18 on
112x112 images instead, for trying the benchmark out.

For each `--batch` and `--threads` (comma lists), three copies of the same initial model train
on the same batches, each with its own AdamW: `eager` (the model called as PyTorch calls it),
`tool` (its class patched through `ort_autopatch.patch`, the `--backend` chosen in its
configuration) and `compile` (`torch.compile` of the eager call, default mode). After each
variant's first call, `--steps` rounds follow, each running one step of every variant in an
order that rotates from round to round (so all see the same machine load); a variant's step
time is the median of its rounds. Every step's loss of the tool (and of torch.compile) is
compared with eager's at the same step: the tool's must equal eager's to 4 decimals (absolute
difference below 5e-5) at every step, or stay within eager's own movement at that step (the
same steps from parameters nudged by about one float32 rounding step: after a few AdamW
steps ResNet-50 at batch 2 moves eager's own loss by 6e-2, so no other arithmetic holds 4
decimals there), or the benchmark fails (after writing its JSON, with the reason under
"problems"); the largest difference is in the JSON, beside eager's own. Every call of the tool must
also have run in ONNX Runtime.

Memory and the first call come from fresh processes (`--fresh`; one per variant, model, batch
and thread count), since RSS never goes down in a process that has already held the other
variants. They all run first, before this process builds any model: one holding gigabytes
beside them (this process after an interleaved run, whose freed memory stays in its heap)
slowed them on the benchmark's VMs, eager's ResNet-50 steps by 45 % beside an idle process
holding 6.6 GB, the tool's cold BERT-base first call from 7.3 to 11.8 s. Each builds its model,
times its first step (export, gradient graph, sessions and the step, ONNX Runtime's import
included: what a user pays), then resets the kernel's high-water mark (/proc/self/clear_refs)
and takes two more steps. `step_peak_rss_mb` is the peak RSS of those steps (the training
step's memory), `process_peak_rss_mb` that of the whole process (the first call's export
included).

`--models zoo:NAME` (e.g. `zoo:llama,zoo:unet`) runs an entry of the model zoo
(tests/zoo/models.py) the same way, at the zoo's size and with its first batch.

`--profile bert` adds a fresh process per model named, in which every session the tool builds
runs ONNX Runtime's profiler over four steps (the three after the first call counted): kernel
time per operator type, ms per step, under the tool's `ort_profile`, to set the backends side
by side. The profiler's own allocations keep the heap from handing a step last step's
blocks (GPT-2 small: 113,000 page faults a step profiled, a few hundred not), so the kernels
that write large fresh tensors (ScatterND, Cast, Expand) read slower there than they run:
rank by it, and time a change by steps, not by its profile.

Achieved GFLOP/s is a step's arithmetic over its median time: 6 x parameters x tokens for the
transformers (forward 2, backward 4 multiply-add halves per parameter and token), and for
ResNet 3 x the forward's FLOPs, counted by torch.utils.flop_counter on one image (8.18 GFLOP,
i.e. the 4.09 GMAC usually quoted, for ResNet-50 at 224x224). The matmul rate it is set against
is measured in the same run at each thread count: the median of a 2048x2048 fp32 `torch.mm`.
torch's own FLOP count of one eager step (forward and backward) is recorded beside the formula.

The two backends cannot share an environment: `nox -s bench_scale` (the training build) and
`bench_scale_plain` (the plain backend) each run this with torch 2.14 and torchvision, writing
benchmarks/results/scale_<backend>.json; `benchmarks/render_scale.py` puts both into README's
table. A model whose package is missing (torchvision) is skipped, and its entry says so.
"""

from __future__ import annotations

import os

# OpenMP spin-waiting makes 2-thread steps on small shared VMs erratic: every variant waits
# passively.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy
import importlib.util
import itertools
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VARIANTS = ("eager", "tool", "compile")
SEQUENCE = 128
IMAGE = 224
#: "equal to 4 decimals": the largest absolute loss difference allowed at any step
LOSS_TOLERANCE = 5e-5
MATMUL_N = 2048
#: the relative nudge of eager's parameters that measures its own spread (one rounding step)
NUDGE = 2e-7
#: steps of a profiled child (`--profile`): the first call, then the steps its profile counts
PROFILED_STEPS = 4

Batch = dict[str, torch.Tensor]


# --- models -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One benchmarked model: its package, how to build it and its batches, its loss and the
    FLOPs of one training step by the stated formula."""

    package: str
    describe: Callable[[bool], str]
    build: Callable[[bool], nn.Module]
    batch: Callable[[int, bool, torch.Generator, nn.Module], Batch]
    loss: Callable[[Any, Batch], torch.Tensor]
    flops: Callable[[nn.Module, Batch, bool], tuple[float, str]]


def _no_dropout(model: nn.Module) -> nn.Module:
    """Dropout 0 in every nn.Dropout (transformers' attention dropout reads its config, set to
    0 at construction): ORT's masks are not torch's, so losses could not be compared."""
    for sub in model.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
    return model


def _bert(tiny: bool) -> nn.Module:
    import transformers

    small = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                 intermediate_size=512) if tiny else {}  # fmt: skip
    config = transformers.BertConfig(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small
    )
    return _no_dropout(transformers.BertForMaskedLM(config))


def _gpt2(tiny: bool) -> nn.Module:
    import transformers

    small = dict(n_layer=2, n_embd=128, n_head=2) if tiny else {}
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **small)
    return _no_dropout(transformers.GPT2LMHeadModel(config))


def _resnet(tiny: bool) -> nn.Module:
    import torchvision

    return _no_dropout(torchvision.models.resnet18() if tiny else torchvision.models.resnet50())


def _text_batch(batch: int, tiny: bool, gen: torch.Generator, model: nn.Module) -> Batch:
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 (transformers models only)
    ids = torch.randint(0, vocab, (batch, SEQUENCE), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _image_batch(batch: int, tiny: bool, gen: torch.Generator, model: nn.Module) -> Batch:
    side = 112 if tiny else IMAGE
    return {
        "x": torch.randn(batch, 3, side, side, generator=gen),
        "labels": torch.randint(0, 1000, (batch,), generator=gen),
    }


def _transformer_flops(model: nn.Module, batch: Batch, tiny: bool) -> tuple[float, str]:
    params = sum(p.numel() for p in model.parameters())
    tokens = batch["input_ids"].numel()
    return 6.0 * params * tokens, f"6 x {params:,} parameters x {tokens} tokens"


def _resnet_flops(model: nn.Module, batch: Batch, tiny: bool) -> tuple[float, str]:
    from torch.utils.flop_counter import FlopCounterMode

    one = batch["x"][:1]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        _call(copy.deepcopy(model).eval(), {"x": one})
    forward = float(counter.get_total_flops())
    images = batch["x"].shape[0]
    return 3.0 * forward * images, f"3 x {forward / 1e9:.2f} GFLOP forward x {images} images"


def _hf_loss(out: Any, batch: Batch) -> torch.Tensor:
    return out.loss


def _image_loss(out: Any, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(out, batch["labels"])


MODELS: dict[str, Spec] = {
    "bert": Spec(
        "transformers",
        lambda tiny: "BertForMaskedLM, 2 layers, hidden 128" if tiny else "BERT-base MLM",
        _bert,
        _text_batch,
        _hf_loss,
        _transformer_flops,
    ),
    "gpt2": Spec(
        "transformers",
        lambda tiny: "GPT2LMHeadModel, 2 layers, hidden 128" if tiny else "GPT-2 small LM",
        _gpt2,
        _text_batch,
        _hf_loss,
        _transformer_flops,
    ),
    "resnet50": Spec(
        "torchvision",
        lambda tiny: "ResNet-18, 112x112" if tiny else "ResNet-50, 224x224",
        _resnet,
        _image_batch,
        _image_loss,
        _resnet_flops,
    ),
}


def _zoo() -> dict[str, Any]:
    """The zoo's entries (tests/zoo/models.py), by name."""
    from tests.zoo.models import BY_NAME

    return BY_NAME


def _spec(name: str) -> Spec:
    """A model of MODELS, or `zoo:NAME`: the zoo's entry at the zoo's size and first batch
    (its batch size is the zoo's; `--batch` does not change it), its FLOPs 3 x the forward's
    as torch counts them."""
    if not name.startswith("zoo:"):
        return MODELS[name]
    entry = _zoo()[name.removeprefix("zoo:")]
    return Spec(
        "torch",
        lambda tiny: f"zoo's {entry.name} (the zoo's size and batch)",
        lambda tiny: entry.build(),
        lambda batch, tiny, gen, model: entry.batch(0, gen),
        entry.loss,
        _counted_forward_flops,
    )


def _counted_forward_flops(model: nn.Module, batch: Batch, tiny: bool) -> tuple[float, str]:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        _call(copy.deepcopy(model).eval(), batch)
    forward = float(counter.get_total_flops())
    return 3.0 * forward, f"3 x {forward / 1e9:.3f} GFLOP forward"


def _call(model: nn.Module, batch: Batch) -> Any:
    """The model called as PyTorch calls it: nn.Module.__call__ itself, which the tool's patch
    of the class's own __call__ does not reach (eager and compile share the patched class)."""
    if "x" in batch:
        return nn.Module.__call__(model, batch["x"])
    return nn.Module.__call__(model, **batch)


class _Eager(nn.Module):
    """The eager call as a module, so torch.compile compiles exactly what eager runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: torch.Tensor) -> Any:
        return _call(self.model, batch)


def _patched_call(model: nn.Module) -> Callable[[Batch], Any]:
    """The tool's call: the model called as a user's script calls it, through its patched
    class's __call__."""

    def call(batch: Batch) -> Any:
        return model(batch["x"]) if "x" in batch else model(**batch)

    return call


def _patch(cls: type, backend: str) -> bool:
    """Patch `cls` as a user's allowlist would, with `backend` in the configuration the
    environment and pyproject.toml give (other ORT_AUTOPATCH_* options apply). Builds run in
    the calls that need them (`--foreground-builds`): the first call is the build, and every
    timed step runs in ORT."""
    import ort_autopatch
    from ort_autopatch.config import load_config

    cli = {"backend": backend, "background_builds": False}
    return ort_autopatch.patch(cls, load_config(cli=cli))


def _step(
    call: Callable[[Batch], Any], opt: torch.optim.Optimizer, batch: Batch, spec: Spec
) -> float:
    """One training step: forward, loss, backward, AdamW; its loss."""
    opt.zero_grad(set_to_none=True)
    loss = spec.loss(call(batch), batch)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _variant_call(variant: str, model: nn.Module) -> Callable[[Batch], Any]:
    if variant == "tool":
        return _patched_call(model)
    if variant == "compile":
        compiled = torch.compile(_Eager(model))
        return lambda batch: compiled(**batch)
    return lambda batch: _call(model, batch)


def _batches(spec: Spec, model: nn.Module, batch: int, count: int, tiny: bool) -> list[Batch]:
    gen = torch.Generator().manual_seed(1)
    return [spec.batch(batch, tiny, gen, model) for _ in range(count)]


# --- memory -----------------------------------------------------------------------------------
def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux 4.0+): the peak of what follows alone."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def _process_peak_mb() -> float:
    """This process's peak RSS so far. Linux keeps `ru_maxrss` across fork and exec, so a
    child started by a large parent would report the parent's peak: its own memory's
    high-water mark (VmHWM) comes first."""
    own = _status_mb("VmHWM")
    if own is not None:
        return own
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


# --- child: one variant in a fresh interpreter ---------------------------------------------------
def child(
    name: str, variant: str, batch: int, tiny: bool, backend: str, profile: bool = False
) -> dict[str, Any]:
    """First call, then the peak RSS of two more steps, of one variant in this fresh process;
    with `profile`, ONNX Runtime's per-node profile of the tool's steps instead."""
    if profile:
        return _profiled_child(name, batch, tiny, backend)
    spec = _spec(name)
    torch.manual_seed(0)
    model = spec.build(tiny).train()
    batches = _batches(spec, model, batch, 3, tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant == "tool":
        _patch(type(model), backend)
    call = _variant_call(variant, model)
    rss_model = _status_mb("VmRSS")
    start = time.perf_counter()
    losses = [_step(call, opt, batches[0], spec)]
    first = time.perf_counter() - start
    first_peak = _process_peak_mb()  # before the mark is reset
    reset = _reset_peak()
    times = []
    for b in batches[1:]:
        start = time.perf_counter()
        losses.append(_step(call, opt, b, spec))
        times.append(time.perf_counter() - start)
    step_peak = _status_mb("VmHWM") if reset else None
    return {
        "first_call_s": first,
        "step_s": times,
        "losses": losses,
        "model_rss_mb": rss_model,
        "step_peak_rss_mb": step_peak,  # None where the mark could not be reset
        "process_peak_rss_mb": max(first_peak, _process_peak_mb()),
    }


def _profiled_child(name: str, batch: int, tiny: bool, backend: str) -> dict[str, Any]:
    """Where the tool's step time goes in ONNX Runtime: every session the tool builds profiles
    its nodes (ORT's `enable_profiling`, set through the engine's session options, which no
    public option reaches), over PROFILED_STEPS steps; kernel time per operator type, ms per
    step, summed over the step's sessions (forward and backward), from each node's runs after
    the first call (whose first-call check runs the graphs more than once: counted in, Cast
    and Sub of its float64 reference looked like a tenth of ResNet-50's step)."""
    import dataclasses

    from ort_autopatch.engine import session

    spec = _spec(name)
    torch.manual_seed(0)
    model = spec.build(tiny).train()
    batches = _batches(spec, model, batch, PROFILED_STEPS, tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    newly = _patch(type(model), backend)
    call = _variant_call("tool", model)
    original = session._session_options
    with tempfile.TemporaryDirectory(prefix="bench_scale-profile-") as folder:

        made = itertools.count()

        def profiled(settings: Any, training: bool) -> Any:
            # a prefix of its own per session: ORT names the file by the millisecond the
            # session starts, and two sessions started within one wrote into one file
            prefix = os.path.join(folder, f"ort{next(made)}")
            return original(dataclasses.replace(settings, profile_prefix=prefix), training)

        session._session_options = profiled
        try:
            _step(call, opt, batches[0], spec)  # the first call: builds, checks
            start = time.perf_counter()
            for b in batches[1:]:
                _step(call, opt, b, spec)
            wall = time.perf_counter() - start
            paths = session.end_profiles()
        finally:
            session._session_options = original
            if newly:
                from ort_autopatch import patcher

                patcher.unpatch(type(model))
        runs: dict[tuple[str, str, str], list[float]] = {}  # (session, op, node): ms a run
        for path in paths:
            for event in json.loads(Path(path).read_text()):
                if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                    key = (path, event["args"]["op_name"], event["name"])
                    runs.setdefault(key, []).append(event["dur"] / 1e3)
        counted = PROFILED_STEPS - 1  # each node's last runs: the steps after the first call
        per_op: dict[str, float] = {}
        for (_, op, _), durations in runs.items():
            per_op[op] = per_op.get(op, 0.0) + sum(durations[-counted:]) / counted
    ordered = sorted(per_op.items(), key=lambda kv: -kv[1])
    return {
        "steps": counted,
        "sessions": len(paths),
        "step_wall_ms": wall / counted * 1e3,
        "kernels_ms": sum(per_op.values()),
        "ops_ms": dict(ordered[:25]),
    }


def run_child(
    name: str,
    variant: str,
    batch: int,
    threads: int,
    tiny: bool,
    backend: str,
    profile: bool = False,
) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, variant]
    cmd += ["--batch", str(batch), "--backend", backend, *(["--tiny"] if tiny else [])]
    cmd += ["--profile", name] if profile else []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as cache:
        # inductor's on-disk cache, filled by the in-process run, would make torch.compile's
        # first call a second run's: the fresh process compiles cold, as a first run does
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {name}/{variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the machine's matmul rate -----------------------------------------------------------------
def matmul_rate(threads: int, repeats: int = 7) -> dict[str, Any]:
    """GFLOP/s of a large fp32 matrix product on `threads` threads (median of `repeats`)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(MATMUL_N, MATMUL_N, generator=gen)
    b = torch.randn(MATMUL_N, MATMUL_N, generator=gen)
    torch.mm(a, b)  # warm-up: thread pool and pages
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        rates.append(2.0 * MATMUL_N**3 / (time.perf_counter() - start) / 1e9)
    return {"n": MATMUL_N, "gflops": statistics.median(rates), "samples": rates}


# --- parent: the variants interleaved -----------------------------------------------------------
def interleaved(
    name: str, batch: int, steps: int, tiny: bool, backend: str, variants: tuple[str, ...]
) -> dict[str, Any]:
    """Every variant's first call, then `steps` rounds of one step each, rotating the order;
    per variant its median step, in-process first call and every loss."""
    from ort_autopatch import patcher, report

    spec = _spec(name)
    torch.manual_seed(0)
    model = spec.build(tiny).train()
    batches = _batches(spec, model, batch, steps + 1, tiny)
    flops, formula = spec.flops(model, batches[0], tiny)
    counted = _counted_flops(spec, copy.deepcopy(model), batches[0])
    copies = {v: copy.deepcopy(model) for v in variants}
    cls = type(copies["eager"])
    newly = _patch(cls, backend)
    report.reset()
    try:
        calls = {v: _variant_call(v, copies[v]) for v in variants}
        opts = {v: torch.optim.AdamW(copies[v].parameters(), lr=1e-4) for v in variants}
        losses: dict[str, list[float]] = {v: [] for v in variants}
        times: dict[str, list[float]] = {v: [] for v in variants}
        first: dict[str, float] = {}
        for v in variants:
            start = time.perf_counter()
            losses[v].append(_step(calls[v], opts[v], batches[0], spec))
            first[v] = time.perf_counter() - start
        for k in range(steps):
            order = variants[k % len(variants) :] + variants[: k % len(variants)]
            for v in order:
                start = time.perf_counter()
                losses[v].append(_step(calls[v], opts[v], batches[k + 1], spec))
                times[v].append(time.perf_counter() - start)
        stats = report.stats_for(patcher.class_name(cls)).as_dict()
    finally:
        if newly:
            patcher.unpatch(cls)
    copies.clear()
    own = _eager_spread(spec, model, batches, losses["eager"])
    spread = max(own)
    out: dict[str, Any] = {
        "flops_per_step": flops,
        "flops_formula": formula,
        "flops_counted_per_step": counted,
        "variants": {},
        "eager_nudged_loss_max_abs_diff": spread,
        "eager_nudged_loss_abs_diffs": own,
        "tool_calls": {
            k: stats.get(k) for k in ("ort_calls", "eager_calls", "fallbacks", "exports")
        },
    }
    eager_ms = statistics.median(times["eager"]) * 1e3
    for v in variants:
        step_ms = statistics.median(times[v]) * 1e3
        diffs = [abs(a - e) for a, e in zip(losses[v], losses["eager"], strict=True)]
        out["variants"][v] = {
            "step_ms": step_ms,
            "step_samples_ms": [t * 1e3 for t in times[v]],
            "ratio_over_eager": step_ms / eager_ms,
            "first_call_in_process_s": first[v],
            "gflops": flops / (step_ms / 1e3) / 1e9,
            "losses": losses[v],
            "loss_max_abs_diff": max(diffs),
            "losses_equal_eager": losses_agree(diffs, own),
        }
    return out


def losses_agree(diffs: list[float], own: list[float]) -> bool:
    """Whether the tool's loss differences from eager's (`diffs`, step by step) are float
    rounding: each below `LOSS_TOLERANCE` (4 decimals) or below twice eager's own largest
    movement so far under a rounding-sized nudge (`own`, `_eager_spread`). One nudged run is
    one sample of how far rounding carries a chaotic run, the tool's another: ResNet-50's
    steps moved by 0.050 where the nudge's had by 0.025 (and by 0.059 a step later)."""
    so_far = 0.0
    for d, s in zip(diffs, own, strict=True):
        so_far = max(so_far, s)
        if d >= max(LOSS_TOLERANCE, 2 * so_far):
            return False
    return True


def _eager_spread(
    spec: Spec, model: nn.Module, batches: list[Batch], losses: list[float]
) -> list[float]:
    """How far eager's own loss moves at each step under a rounding-sized disturbance: the
    same steps from parameters times (1 + 2e-7 N(0, 1)), about one float32 rounding step.
    AdamW's first steps move every parameter by about the learning rate whatever its
    gradient's size, so gradients that are rounding noise (BatchNorm over few values) flip
    parameters by 2e-4: where eager itself moves past 4 decimals, so can any other
    implementation's arithmetic."""
    nudged = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in nudged.parameters():
            p.mul_(1 + NUDGE * torch.randn(p.shape, generator=gen))
    opt = torch.optim.AdamW(nudged.parameters(), lr=1e-4)
    moved = [_step(lambda b: _call(nudged, b), opt, b, spec) for b in batches]
    return [abs(a - e) for a, e in zip(moved, losses, strict=True)]


def _counted_flops(spec: Spec, model: nn.Module, batch: Batch) -> float:
    """torch's count of one eager step's FLOPs (forward and backward; the optimizer aside)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        spec.loss(_call(model, batch), batch).backward()
    return float(counter.get_total_flops())


def _check(name: str, key: str, run: dict[str, Any], steps: int) -> list[str]:
    """What makes this run's numbers wrong to report: the tool's losses off eager's, or calls
    of it that did not run in ONNX Runtime."""
    problems = []
    tool = run["variants"].get("tool")
    if tool is not None and not tool["losses_equal_eager"]:
        problems.append(
            f"{name} {key}: the tool's losses differ from eager's by "
            f"{tool['loss_max_abs_diff']:.2e} (losses {tool['losses']} against "
            f"{run['variants']['eager']['losses']})"
        )
    calls = run["tool_calls"]
    if tool is not None and (calls["ort_calls"] != steps + 1 or calls["fallbacks"]):
        problems.append(f"{name} {key}: not every call of the tool ran in ONNX Runtime: {calls}")
    return problems


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for package in ("transformers", "torchvision"):
        if importlib.util.find_spec(package) is None:
            found[package] = None
        else:
            found[package] = __import__(package).__version__
    return found


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="ort-training", choices=("ort-training", "ort"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", default="2", help="comma list of batch sizes (e.g. 2,8)")
    parser.add_argument("--threads", default="2", help="comma list of thread counts (e.g. 1,2)")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds after the first call")
    parser.add_argument("--tiny", action="store_true", help="small models, to try it out")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument(
        "--fresh",
        default=",".join(VARIANTS),
        help="variants measured in fresh processes (first call, peak RSS); '' for none",
    )
    parser.add_argument(
        "--profile",
        default="",
        help="models whose tool steps ONNX Runtime also profiles, in a fresh process of their "
        "own (per operator type, ms per step)",
    )
    parser.add_argument("--output", type=Path, help="default results/scale_<backend>.json")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        name, variant = args.child
        profile = bool(args.profile)
        result = child(name, variant, int(args.batch), args.tiny, args.backend, profile)
        print(json.dumps(result))
        return 0

    from ort_autopatch.engine import backend as registry

    reason = registry.unavailable_reason(args.backend)
    if reason is not None:
        parser.error(f"backend {args.backend} cannot run here: {reason}")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(n for n in names if n not in MODELS and n.removeprefix("zoo:") not in _zoo())
    if unknown:
        parser.error(
            f"unknown model(s) {unknown}; choose from {sorted(MODELS)} or zoo:NAME with NAME "
            f"in {sorted(_zoo())}"
        )
    variants = tuple(v for v in VARIANTS if not (args.no_compile and v == "compile"))
    fresh = [v for v in args.fresh.split(",") if v.strip() and v in variants]
    batches, thread_counts = _ints(args.batch), _ints(args.threads)
    output = args.output or RESULTS_DIR / f"scale_{args.backend}.json"

    report: dict[str, Any] = {
        "environment": {
            "backend": args.backend,
            "onnxruntime": registry.version(args.backend),
            "torch": torch.__version__,
            **_versions(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "tiny": args.tiny,
            "batches": batches,
            "threads": thread_counts,
            "steps": args.steps,
            "variants": list(variants),
            "fresh": fresh,
            "dropout": "0 (ORT's dropout masks are not torch's; losses are compared)",
            "loss_tolerance": LOSS_TOLERANCE,
            "load_average": os.getloadavg(),
        },
        "matmul": {str(t): matmul_rate(t) for t in thread_counts},
        "models": {},
    }
    problems: list[str] = []
    runnable = [n for n in names if importlib.util.find_spec(_spec(n).package) is not None]
    # the fresh processes first, while this one holds no model (the module's docstring)
    children: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for name in runnable:
        for batch in batches:
            for threads in thread_counts:
                print(f"{name} batch {batch}, {threads} threads: fresh processes ...", flush=True)
                made = children[name, batch, threads] = {}
                for v in fresh:
                    made[v] = {
                        "fresh_process": run_child(name, v, batch, threads, args.tiny, args.backend)
                    }
                if name in args.profile.split(",") and "tool" in variants:
                    made.setdefault("tool", {})["ort_profile"] = run_child(
                        name, "tool", batch, threads, args.tiny, args.backend, profile=True
                    )
    for name in names:
        spec = _spec(name)
        entry: dict[str, Any] = {"description": spec.describe(args.tiny), "runs": {}}
        report["models"][name] = entry
        if name not in runnable:
            entry["skipped"] = f"{spec.package} is not installed"
            print(f"{name}: skipped, {entry['skipped']}", flush=True)
            continue
        for batch in batches:
            for threads in thread_counts:
                key = f"batch {batch}, {threads} threads"
                print(f"{name} {key} ...", flush=True)
                torch.set_num_threads(threads)
                run = interleaved(name, batch, args.steps, args.tiny, args.backend, variants)
                matmul = report["matmul"][str(threads)]["gflops"]
                for result in run["variants"].values():
                    result["fraction_of_matmul"] = result["gflops"] / matmul
                for v, made in children[name, batch, threads].items():
                    run["variants"][v].update(made)
                run.update(batch=batch, threads=threads)
                entry["runs"][key] = run
                problems += _check(name, key, run, args.steps)
                _print_run(name, key, run, matmul)
    report["environment"]["load_average_after"] = os.getloadavg()
    report["environment"]["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    report["problems"] = problems
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {output}")
    if problems:
        print("\n".join(["FAILED:", *problems]), file=sys.stderr)
        return 1
    return 0


def _print_run(name: str, key: str, run: dict[str, Any], matmul: float) -> None:
    print(
        f"  {'variant':<8} {'step ms':>9} {'/eager':>7} {'1st call s':>10} {'fresh 1st s':>11} "
        f"{'step peak MB':>12} {'GFLOP/s':>8} {'of mm':>6} {'loss diff':>9}"
    )
    for v, r in run["variants"].items():
        fresh = r.get("fresh_process") or {}
        first = fresh.get("first_call_s")
        peak = fresh.get("step_peak_rss_mb")
        print(
            f"  {v:<8} {r['step_ms']:>9.1f} {r['ratio_over_eager']:>7.2f} "
            f"{r['first_call_in_process_s']:>10.2f} "
            f"{'' if first is None else f'{first:.2f}':>11} "
            f"{'' if peak is None else f'{peak:.0f}':>12} {r['gflops']:>8.1f} "
            f"{r['fraction_of_matmul']:>6.2f} {r['loss_max_abs_diff']:>9.1e}"
        )
    print(
        f"  matmul {matmul:.1f} GFLOP/s; step {run['flops_per_step'] / 1e9:.1f} GFLOP "
        f"({run['flops_formula']}; torch counts {run['flops_counted_per_step'] / 1e9:.1f})",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
