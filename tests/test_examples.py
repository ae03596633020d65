"""The examples users copy run through the launcher and really train in ORT."""

from __future__ import annotations

import json
import pathlib

from tests.proc_helpers import LAUNCHER, REPO, run


def _classes(path: pathlib.Path) -> dict[str, dict[str, object]]:
    classes: dict[str, dict[str, object]] = json.loads(path.read_text())["classes"]
    return classes


def test_train_mlp_example_shows_the_summary(tmp_path: pathlib.Path) -> None:
    result = run(
        [
            *LAUNCHER,
            "--modules",
            "__main__:Net",
            "--log-level",
            "INFO",
            "--report",
            str(tmp_path / "r.json"),
            str(REPO / "examples" / "train_mlp.py"),
            "--steps",
            "5",
        ],
        cwd=tmp_path,
        timeout=90,
    )
    assert result.returncode == 0, result.stderr
    assert "train accuracy" in result.stdout
    assert "__main__:Net" in result.stderr and "summary" in result.stderr
    net = _classes(tmp_path / "r.json")["__main__:Net"]
    assert (net["ort_calls"], net["eager_calls"]) == (6, 0)


def test_hf_trainer_example(tmp_path: pathlib.Path) -> None:
    name = "transformers.models.bert.modeling_bert:BertForSequenceClassification"
    result = run(
        [
            *LAUNCHER,
            "--modules",
            name,
            "--report",
            str(tmp_path / "r.json"),
            str(REPO / "examples" / "hf_trainer.py"),
        ],
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "trained 6 steps" in result.stdout
    bert = _classes(tmp_path / "r.json")[name]
    # The first call sets `config.problem_type`, which a graph would not do again: it runs in
    # PyTorch, and every later call in ORT.
    counts = (bert["ort_calls"], bert["eager_calls"], bert["exports"])
    assert counts == (5, 1, 1), (bert["eager_reasons"], result.stderr[-2000:])
    assert bert["eager_reasons"] == [
        {"reason": "forward changed state: traced again next call", "count": 1}
    ]


def test_lightning_example(tmp_path: pathlib.Path) -> None:
    # (parity with eager call by call: tests/test_libraries.py; the accelerate example runs in
    # tests/test_ddp.py)
    result = run(
        [
            *LAUNCHER,
            "--modules",
            "__main__:Classifier",
            "--report",
            str(tmp_path / "r.json"),
            str(REPO / "examples" / "train_lightning.py"),
            "--steps",
            "6",
        ],
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "trained 6 steps" in result.stdout
    classifier = _classes(tmp_path / "r.json")["__main__:Classifier"]
    assert (classifier["ort_calls"], classifier["eager_calls"], classifier["exports"]) == (6, 0, 1)
