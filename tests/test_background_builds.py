"""Graphs built by a helper process while their calls run in PyTorch (engine/aside.py).

Each test runs a real training script through the launcher in a fresh interpreter, with
background builds on (as users get them), and compares every step with an eager twin of the
model: where each call ran (the report's counters, read after each step) and its loss and
gradients. On the training build, whose builds stay in the process, the first call runs in
ONNX Runtime.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import plain_backend
from tests.proc_helpers import LAUNCHER, run

pytestmark = pytest.mark.skipif(
    not __import__("ort_autopatch.engine.sandbox", fromlist=["available"]).available(),
    reason="helper processes are forked: Linux only",
)

#: A script that trains `Net` (and, with TWO set, a second class `Head`) beside an eager twin
#: and prints one JSON line per step: where each selected class's call ran, and how far the
#: losses and gradients are from the twin's.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import torch
    from torch import nn
    from ort_autopatch import report

    class Net(nn.Module):
        def __init__(self):
            nn.Module.__init__(self)  # shared with the twin classes below
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 4)

        def forward(self, x):
            h = torch.tanh(self.fc1(x))
            if os.environ.get("CRASH_IN_HELPER") and os.getpid() != PARENT:
                os.abort()  # a helper that dies mid-build
            if os.environ.get("DATA_DEPENDENT") and h.sum() > 0:
                h = h * 2
            return self.fc2(h)

    class Head(nn.Module):
        def __init__(self):
            nn.Module.__init__(self)  # shared with the twin classes below
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x).relu()

    class Twin(nn.Module):  # Net's code, unselected: the eager reference
        __init__, forward = Net.__init__, Net.forward

    class TwinHead(nn.Module):
        __init__, forward = Head.__init__, Head.forward

    PARENT = os.getpid()
    STEPS = int(os.environ.get("STEPS", "3000"))  # a minute or more: builds on a busy machine
    torch.manual_seed(0)
    net, head = Net(), Head()
    twin, twin_head = Twin(), TwinHead()
    twin.load_state_dict(net.state_dict())
    twin_head.load_state_dict(head.state_dict())
    two = bool(os.environ.get("TWO"))
    if os.environ.get("BUSY_THREAD"):
        stop = []
        def spin():  # working, not at rest in `threading`, but leaving the GIL to the build
            while not stop:
                sum(range(1000))
                time.sleep(0.001)
        threading.Thread(target=spin, daemon=True).start()

    def ort_calls(name):
        return report.snapshot().get(name, {}).get("ort_calls", 0)

    x = torch.randn(8, 16)
    for step in range(STEPS):
        if step == 1 and os.environ.get("SWITCH_SHAPE"):
            x = torch.randn(4, 16)  # the first shape's graph, built aside, is never used
        if step == 1 and os.environ.get("FORK_WORKER"):
            worker = os.fork()  # a data loader's worker, say, that calls the model too
            if worker == 0:
                torch.set_num_threads(1)  # as a data loader's workers do: OpenMP and fork
                end = time.monotonic() + 4
                while time.monotonic() < end:
                    net(x)
                    time.sleep(0.02)
                os._exit(0)
            os.waitpid(worker, 0)
        before = {n: ort_calls("__main__:" + n) for n in ("Net", "Head")}
        out = net(x)
        if two:
            out = head(out)
        loss = out.pow(2).mean()
        loss.backward()
        ref = twin(x)
        if two:
            ref = twin_head(ref)
        ref_loss = ref.pow(2).mean()
        ref_loss.backward()
        where = {
            n: "ort" if ort_calls("__main__:" + n) > before[n] else "eager"
            for n in (("Net", "Head") if two else ("Net",))
        }
        grad = max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(
                list(net.parameters()) + list(head.parameters()),
                list(twin.parameters()) + list(twin_head.parameters()),
            )
            if a.grad is not None
        )
        print(json.dumps({"step": step, "where": where,
                          "loss": abs(loss.item() - ref_loss.item()), "grad": grad}), flush=True)
        for model in (net, head, twin, twin_head):
            model.zero_grad()
        if all(w == "ort" for w in where.values()) and os.environ.get("UNTIL_ORT"):
            break
        if os.environ.get("UNTIL_FALLBACK") and report.snapshot()["__main__:Net"]["fallbacks"]:
            break
        time.sleep(0.02)  # a step's worth of other work: the helper gets its core
    if os.environ.get("BUSY_THREAD"):
        stop.append(True)
    """
)


def _train(
    folder: Path, modules: str = "__main__:Net", timeout: float = 240, **env: str
) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    script = folder / "train.py"
    script.write_text(SCRIPT)
    report = folder / "report.json"
    done = run(
        [*LAUNCHER, "--modules", modules, "--report", str(report), str(script)],
        env={"ORT_AUTOPATCH_BACKGROUND_BUILDS": "1", "UNTIL_ORT": "1", **env},
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return steps, json.loads(report.read_text())["classes"], done.stderr


def _assert_eager_numbers(steps: list[dict[str, Any]]) -> None:
    for step in steps:
        assert step["loss"] <= 1e-5 and step["grad"] <= 1e-5, step


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_calls_run_in_pytorch_while_a_helper_builds_then_in_ort(tmp_path: Path) -> None:
    steps, classes, stderr = _train(tmp_path)
    _assert_eager_numbers(steps)
    where = [s["where"]["Net"] for s in steps]
    assert where[0] == "eager", "the first call waited for its build"
    assert where[-1] == "ort", f"no call reached ONNX Runtime in {len(steps)} steps"
    first_ort = where.index("ort")
    assert set(where[first_ort:]) == {"ort"}, where
    net = classes["__main__:Net"]
    assert net["eager_reasons"] == [
        {"reason": "graph building in a helper process", "count": first_ort}
    ]
    assert net["exports"] == 1 and net["cache_loads"] == 0 and not net["fallbacks"]
    # the helper's check of its first call against eager is reported here
    assert net["verify"]["calls"] == 1 and net["verify"]["mismatches"] == 0
    assert "still building" not in stderr, "the helper wrote to the user's stderr"


@pytest.mark.skipif(plain_backend(), reason="the training build builds in the process")
def test_the_training_build_builds_in_the_process(tmp_path: Path) -> None:
    steps, classes, _ = _train(tmp_path)
    _assert_eager_numbers(steps)
    assert steps[0]["where"] == {"Net": "ort"}
    assert classes["__main__:Net"]["eager_calls"] == 0


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_a_working_thread_keeps_the_build_in_this_process(tmp_path: Path) -> None:
    """A lock such a thread holds at a fork would stay held in the child for good."""
    steps, classes, _ = _train(tmp_path, BUSY_THREAD="1")
    _assert_eager_numbers(steps)
    assert steps[0]["where"] == {"Net": "ort"}
    assert classes["__main__:Net"]["eager_calls"] == 0


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_one_helper_at_a_time_and_both_classes_reach_ort(tmp_path: Path) -> None:
    steps, classes, _ = _train(tmp_path, "__main__:Net,__main__:Head", TWO="1")
    _assert_eager_numbers(steps)
    assert steps[0]["where"] == {"Net": "eager", "Head": "eager"}
    assert steps[-1]["where"] == {"Net": "ort", "Head": "ort"}
    head = {r["reason"]: r["count"] for r in classes["__main__:Head"]["eager_reasons"]}
    assert head.get("waiting for another graph's build", 0) >= 1, head
    for name in ("__main__:Net", "__main__:Head"):
        assert classes[name]["exports"] == 1 and not classes[name]["fallbacks"]


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_a_helper_that_dies_leaves_the_build_to_this_process(tmp_path: Path) -> None:
    steps, classes, stderr = _train(tmp_path, CRASH_IN_HELPER="1")
    _assert_eager_numbers(steps)
    where = [s["where"]["Net"] for s in steps]
    assert where[0] == "eager" and where[-1] == "ort", where
    net = classes["__main__:Net"]
    assert net["exports"] == 1 and not net["fallbacks"], net
    assert "abort" not in stderr.lower(), stderr[-2000:]


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_a_helper_failure_is_the_failure_of_a_build_here(tmp_path: Path) -> None:
    """A forward deciding from data: the helper refuses it, this process then builds it (and
    refuses it in the same words as without the helper)."""
    until = {"DATA_DEPENDENT": "1", "UNTIL_ORT": "", "UNTIL_FALLBACK": "1"}
    aside_steps, aside, _ = _train(tmp_path, **until)
    here_steps, here, _ = _train(tmp_path, **until, ORT_AUTOPATCH_BACKGROUND_BUILDS="0")
    _assert_eager_numbers(aside_steps)
    assert all(s["where"] == {"Net": "eager"} for s in aside_steps + here_steps)
    assert len(here_steps) == 1 and len(aside_steps) > 1, "the helper's call waited for it"
    assert aside["__main__:Net"]["fallbacks"] == here["__main__:Net"]["fallbacks"] != []
    assert aside["__main__:Net"]["trace_hazards"] == here["__main__:Net"]["trace_hazards"]
    reasons = {r["reason"] for r in aside["__main__:Net"]["eager_reasons"]}
    assert reasons == {
        "graph building in a helper process",
        "fallback: data-dependent control flow",
    }


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_a_build_over_budget_in_the_helper_is_refused_for_good(tmp_path: Path) -> None:
    steps, classes, _ = _train(
        tmp_path, UNTIL_ORT="", UNTIL_FALLBACK="1", ORT_AUTOPATCH_MAX_GRAPH_NODES="3"
    )
    _assert_eager_numbers(steps)
    assert all(s["where"] == {"Net": "eager"} for s in steps)
    net = classes["__main__:Net"]
    assert [f["reason"] for f in net["fallbacks"]] == ["build over budget"], net
    assert net["exports"] == 0


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_the_graph_goes_to_the_users_cache_and_loads_there_next_run(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, classes, _ = _train(tmp_path, ORT_AUTOPATCH_CACHE_DIR=str(cache))
    assert classes["__main__:Net"]["exports"] == 1
    second, classes, _ = _train(tmp_path, ORT_AUTOPATCH_CACHE_DIR=str(cache))
    _assert_eager_numbers(first + second)
    assert second[0]["where"] == {"Net": "ort"}, "a stored graph waits for no helper"
    assert classes["__main__:Net"]["cache_loads"] == 1 and classes["__main__:Net"]["exports"] == 0


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_the_private_store_goes_with_the_process(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    _train(tmp_path, TMPDIR=str(tmp))
    assert not [p for p in tmp.iterdir() if p.name.startswith("ort_autopatch-builds-")]


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_a_run_that_ends_while_its_graph_builds_exits_at_once(tmp_path: Path) -> None:
    """The helper is ended with the run, not waited for; its private store goes too, and the
    run says why nothing reached ONNX Runtime."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    steps, classes, stderr = _train(tmp_path, timeout=30, STEPS="2", UNTIL_ORT="", TMPDIR=str(tmp))
    _assert_eager_numbers(steps)
    assert [s["where"] for s in steps] == [{"Net": "eager"}] * 2
    assert classes["__main__:Net"]["exports"] == 0
    assert "nothing ran in ONNX Runtime yet" in stderr
    assert not list(tmp.iterdir())


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_a_helper_whose_graph_no_call_asks_for_again_ends_with_the_run(tmp_path: Path) -> None:
    """The first shape's helper finishes, and no call of that shape comes to read it: its
    engine still holds it when the interpreter exits, and the run must end all the same."""
    steps, classes, _ = _train(tmp_path, timeout=60, SWITCH_SHAPE="1")
    _assert_eager_numbers(steps)
    assert steps[0]["where"] == {"Net": "eager"} and steps[-1]["where"] == {"Net": "ort"}
    assert classes["__main__:Net"]["exports"] == 1


@pytest.mark.skipif(not plain_backend(), reason="the plain backend builds aside")
def test_a_forked_worker_leaves_the_parents_helper_alone(tmp_path: Path) -> None:
    """A process forked while a helper builds inherits the engine, not the helper: its calls
    neither read the helper's answer nor end it, and the parent loads the graph it built."""
    steps, _, stderr = _train(tmp_path, FORK_WORKER="1", ORT_AUTOPATCH_LOG_LEVEL="DEBUG")
    _assert_eager_numbers(steps)
    assert steps[0]["where"] == {"Net": "eager"} and steps[-1]["where"] == {"Net": "ort"}
    assert "built in this process" not in stderr, stderr[-3000:]
