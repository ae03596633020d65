"""Reliability scenarios: count what was tried and what survived, for the README.

With ORT_AUTOPATCH_RELIABILITY_RESULTS=path set (the `soak` and `reliability` nox sessions set
it), the counts per file go to that JSON file at the end of the run;
benchmarks/render_reliability.py turns it into the README's reliability section.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

_results: dict[str, dict[str, int]] = defaultdict(lambda: {"tried": 0, "survived": 0})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and "reliability" in str(item.fspath):
        group = Path(str(item.fspath)).stem.removeprefix("test_")
        _results[group]["tried"] += 1
        _results[group]["survived"] += int(report.passed)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get("ORT_AUTOPATCH_RELIABILITY_RESULTS")
    if target and _results:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(dict(sorted(_results.items())), indent=2) + "\n")
