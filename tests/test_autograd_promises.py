"""Autograd's promises around a patched module: in-place writes to what backward needs raise
eager's error, writes to what it does not need are allowed, and nothing of a step outlives it."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from ort_autopatch import patcher, report
from tests.proc_helpers import run_side_by_side

EAGER_ERROR = "one of the variables needed for gradient computation has been modified by an inplace"


class SoftmaxHead(nn.Module):
    """Softmax's backward reads its output; the linear layer's reads its input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return torch.softmax(h, -1), h * 2


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    report.reset()
    yield
    patcher.unpatch_all()


def _both(
    scenario: Callable[[nn.Module, torch.Tensor], None],
) -> tuple[BaseException | None, BaseException | None]:
    """Run `scenario` eagerly, then through ORT; return what each raised."""
    results: list[BaseException | None] = []
    for patched in (False, True):
        if patched:
            patcher.patch(SoftmaxHead)
        torch.manual_seed(0)
        model, x = SoftmaxHead(), torch.randn(4, 8, requires_grad=True)
        try:
            scenario(model, x)
            results.append(None)
        except RuntimeError as exc:
            results.append(exc)
    assert report.stats_for(patcher.class_name(SoftmaxHead)).ort_calls == 1
    return results[0], results[1]


def test_in_place_update_of_an_output_backward_reads_raises_eager_s_error() -> None:
    def scenario(model: nn.Module, x: torch.Tensor) -> None:
        probs, _ = model(x)
        probs.add_(1)
        probs.square().sum().backward()

    eager, ours = _both(scenario)
    assert eager is not None and EAGER_ERROR in str(eager)
    assert ours is not None and EAGER_ERROR in str(ours)


def test_in_place_update_of_a_saved_input_raises_eager_s_error() -> None:
    def scenario(model: nn.Module, x: torch.Tensor) -> None:
        data = x.detach()  # the same buffer, no gradient of its own
        probs, _ = model(data)
        data.mul_(3)
        probs.sum().backward()

    eager, ours = _both(scenario)
    assert eager is not None and EAGER_ERROR in str(eager)
    assert ours is not None and EAGER_ERROR in str(ours)


def test_in_place_update_of_an_output_backward_does_not_read_is_allowed_as_in_eager() -> None:
    grads = []

    def scenario(model: nn.Module, x: torch.Tensor) -> None:
        _, doubled = model(x)
        doubled.add_(1)
        doubled.square().sum().backward()
        grads.append(model.fc.weight.grad.clone())

    eager, ours = _both(scenario)
    assert eager is None and ours is None
    torch.testing.assert_close(grads[1], grads[0])


def test_rss_over_steps_of_varying_size_without_the_cyclic_collector_stays_at_eager_s() -> None:
    """64 MiB inputs of varying size, `gc.disable()`: whatever a step allocates (ORT's
    buffers included) is freed when its tensors are, so memory stays flat as in eager. (A
    session's own ORT arena grew by about three inputs a step here: eight steps show it.)"""
    script = textwrap.dedent(
        """
        import gc, json, os, sys
        import torch
        from torch import nn
        from ort_autopatch import patcher, report

        def rss():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        class Wide(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = nn.Parameter(torch.ones(256))
                self.shift = nn.Parameter(torch.zeros(256))

            def forward(self, x):  # elementwise: memory-bound, cheap in time
                return torch.tanh(x * self.scale + self.shift)

        if sys.argv[1] == "ort":
            patcher.patch(Wide)
        torch.manual_seed(0)
        model = Wide()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        # builds and imports: a first size, and another (the plain backend's symbolic graph)
        model(torch.randn(8, 256)).sum().backward()
        model(torch.randn(9, 256)).sum().backward()
        gc.collect()
        gc.disable()
        rows = 2**16  # 64 MiB of float32: above glibc's largest mmap threshold
        start, peak = rss(), 0.0
        for step in range(8):  # each of 4 sizes twice
            x = torch.full((rows + 512 * (step % 4), 256), 0.5, requires_grad=step % 2 == 0)
            out = model(x)
            loss = out.sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            del x, out, loss
            peak = max(peak, rss() - start)
        calls = report.stats_for(patcher.class_name(Wide)).ort_calls
        print(json.dumps({"growth": rss() - start, "peak": peak, "ort_calls": calls}))
        """
    )
    results = {}
    modes = ("eager", "ort")
    runs = [[sys.executable, "-c", script, mode] for mode in modes]
    finished = run_side_by_side(runs, {"OMP_NUM_THREADS": "1"}, timeout=300)
    for mode, done in zip(modes, finished, strict=True):
        assert done.returncode == 0, done.stderr
        results[mode] = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert results["ort"]["ort_calls"] == 10  # the two warm-up calls and eight steps
    assert results["ort"]["growth"] < results["eager"]["growth"] + 16, results
    assert results["ort"]["peak"] < results["eager"]["peak"] + 75, results
