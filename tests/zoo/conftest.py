"""The zoo's results file: `ZOO_RESULTS=path` makes a run write every entry's result there."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def zoo_results() -> Iterator[list[dict[str, Any]]]:
    results: list[dict[str, Any]] = []
    yield results
    target = os.environ.get("ZOO_RESULTS")
    if target and results:
        import onnxruntime
        import transformers

        document = {
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
            "transformers": transformers.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "threads": torch.get_num_threads(),
            "models": sorted(results, key=lambda r: r["order"]),
        }
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(document, indent=1) + "\n")
