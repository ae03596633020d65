"""DistributedDataParallel through ORT on CPU (gloo), launched every way, and DataParallel.

Two ranks train ``examples/train_ddp.py`` (or ``examples/train_accelerate.py``, the same model
and data through Accelerate) on halves of each global batch; their parameters must be identical
and equal (1e-4 relative) to one eager process training on the whole batch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
from typing import Any

import pytest
import torch

from tests.proc_helpers import LAUNCHER, REPO, free_port, rendezvous, run, torchrun

SCRIPT = REPO / "examples" / "train_ddp.py"
ACCELERATE_SCRIPT = REPO / "examples" / "train_accelerate.py"
STEPS, GLOBAL_BATCH, LR = 5, 32, 0.1


def _example(script: pathlib.Path = SCRIPT) -> Any:
    spec = importlib.util.spec_from_file_location(f"{script.stem}_example", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _eager_reference(script: pathlib.Path) -> dict[str, torch.Tensor]:
    example = _example(script)  # not selected in this process: plain eager PyTorch
    model = example.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = example.make_data(STEPS, GLOBAL_BATCH)
    for step in range(STEPS):
        loss = model(xs[step], ys[step])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _check_run(out: pathlib.Path, stderr: str, script: pathlib.Path = SCRIPT) -> None:
    ranks = [torch.load(out / f"params-{r}.pt") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name} differs between ranks"
    reference = _eager_reference(script)
    initial = _example(script).make_model().state_dict()
    for name, value in reference.items():
        assert not torch.equal(value, initial[name]), f"{name} never trained"
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-4, atol=1e-6)
    for rank in (0, 1):
        report = json.loads((out / f"report-{rank}.json").read_text())
        net = report["classes"]["__main__:Net"]
        assert (net["ort_calls"], net["eager_calls"], net["exports"]) == (STEPS, 0, 1), rank
    assert stderr.count("ort_autopatch 0.1.0 summary") == 1  # rank 0 only


OPTIONS = ["--modules", "__main__:Net", "--log-level", "INFO"]
SCRIPT_ARGS = ["--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH), "--lr", str(LR)]


@pytest.mark.parametrize(
    "form", ["torchrun -m ort_autopatch", "ort_autopatch -m torch.distributed.run"]
)
def test_ddp_two_ranks_through_ort(tmp_path: pathlib.Path, form: str) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    report = ["--report", str(tmp_path / "report-{rank}.json")]
    args = [str(SCRIPT), *SCRIPT_ARGS, "--out", str(tmp_path)]
    if form.startswith("torchrun"):
        command = [*torchrun(), *rendezvous(), "-m", "ort_autopatch", *OPTIONS, *report, *args]
    else:
        torchrun_module = ["-m", "torch.distributed.run", *rendezvous()]
        command = [*LAUNCHER, *OPTIONS, *report, *torchrun_module, *args]
    result = run(command, cwd=tmp_path, timeout=150, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step")] == [
        str(s) for s in range(STEPS)
    ]  # the script prints from rank 0 only
    assert sorted(p.name for p in tmp_path.glob("report-*.json")) == [
        "report-0.json",
        "report-1.json",
    ]
    _check_run(tmp_path, result.stderr)


# Without the launcher: sitecustomize_example/ on PYTHONPATH and the ORT_AUTOPATCH_* variables
# activate the tool in every process the launcher starts.
SITECUSTOMIZE_LAUNCHES = {
    "torchrun": lambda: [*torchrun(), *rendezvous(), str(SCRIPT)],
    "accelerate launch": lambda: [
        str(pathlib.Path(sys.executable).with_name("accelerate")),
        "launch",
        *("--multi_gpu", "--num_processes", "2", "--num_machines", "1"),  # gloo on CPU
        *("--mixed_precision", "no", "--dynamo_backend", "no"),
        *("--main_process_port", str(free_port())),
        str(ACCELERATE_SCRIPT),
    ],
}


@pytest.mark.parametrize("launch", sorted(SITECUSTOMIZE_LAUNCHES))
def test_ddp_two_ranks_through_ort_activated_by_sitecustomize(
    tmp_path: pathlib.Path, launch: str
) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    command = [*SITECUSTOMIZE_LAUNCHES[launch](), *SCRIPT_ARGS, "--out", str(tmp_path)]
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "sitecustomize_example")]),
        "ORT_AUTOPATCH_MODULES": "__main__:Net",
        "ORT_AUTOPATCH_LOG_LEVEL": "INFO",
        "ORT_AUTOPATCH_REPORT": str(tmp_path / "report-{rank}.json"),
        "OMP_NUM_THREADS": "1",
    }
    result = run(command, cwd=tmp_path, timeout=150, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step")]
    assert steps == [str(s) for s in range(STEPS)]  # printed by rank 0 only
    assert sorted(p.name for p in tmp_path.glob("report-*.json")) == [
        "report-0.json",
        "report-1.json",
    ]
    _check_run(tmp_path, result.stderr, ACCELERATE_SCRIPT if "accelerate" in launch else SCRIPT)


def test_data_parallel_on_cpu_just_calls_the_patched_module() -> None:
    """Without GPUs DataParallel keeps no device ids and calls the module itself: ORT runs."""
    import ort_autopatch
    from ort_autopatch import report

    class DPNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    ort_autopatch.patch(DPNet)
    try:
        model = DPNet()
        wrapped = torch.nn.DataParallel(model)
        assert wrapped.device_ids == [] and wrapped.module is model
        for _ in range(2):
            wrapped(torch.randn(3, 4)).backward()
        stats = report.stats_for(f"{DPNet.__module__}:{DPNet.__qualname__}")
        assert (stats.ort_calls, stats.exports) == (2, 1)
        assert model.lin.weight.grad is not None
    finally:
        ort_autopatch.unpatch(DPNet)
