"""What torch's exporter prints from C++ stays out of the user's stderr; the rest gets through."""

from __future__ import annotations

import json
import pathlib
import textwrap

from tests.proc_helpers import LAUNCHER, PY, run, without_progress

BATCH_NORM_SCRIPT = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.bn2(torch.relu(self.bn(self.conv(x)))).mean((2, 3)))


net = Net()
x = torch.randn(2, 3, 8, 8)
for _ in range(2):
    net(x).sum().backward()
net.eval()
with torch.no_grad():
    net(x)
print("done")
"""


def test_a_batch_norm_model_trains_without_exporter_lines_on_stderr(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(BATCH_NORM_SCRIPT))
    report = tmp_path / "report.json"
    options = ["--modules", "__main__:Net", "--report", str(report)]
    result = run([*LAUNCHER, *options, "train.py"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "done\n"
    assert without_progress(result.stderr) == ""
    net = json.loads(report.read_text())["classes"]["__main__:Net"]
    assert net["ort_calls"] == 3 and net["eager_calls"] == 0


def test_exporter_lines_go_to_the_debug_log_and_other_output_gets_through(
    tmp_path: pathlib.Path,
) -> None:
    code = """
        import logging, os, sys
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="log: %(message)s")
        from ort_autopatch.engine import chatter
        with chatter.captured():
            os.write(2, b"In-place op on output of tensor.shape. See https://pytorch.org\\n")
            os.write(2, b"a line of the user's\\n")
            print("python's stderr", file=sys.stderr, flush=True)
        print("after", file=sys.stderr)
    """
    result = run([PY, "-c", textwrap.dedent(code)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "a line of the user's\npython's stderr\nafter\n"
    assert result.stdout == (
        "log: torch's ONNX exporter: In-place op on output of tensor.shape. "
        "See https://pytorch.org\n"
    )
