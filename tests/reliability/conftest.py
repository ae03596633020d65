"""Reliability scenarios: count what was tried and what survived, for the README.

With ORT_AUTOPATCH_RELIABILITY_RESULTS=path set (the `soak` nox session sets
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

# node id -> (scenario group, survived so far). A scenario is tried once it is collected and
# started; it survives only if setup, call and teardown all pass, so an error in a fixture, a skip
# or a file that fails to import counts as tried and not survived instead of vanishing.
_scenarios: dict[str, tuple[str, bool]] = {}


def _group(path: str) -> str:
    return Path(path.split("::")[0]).stem.removeprefix("test_")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if "reliability" not in str(item.fspath):
        return
    _, survived = _scenarios.get(item.nodeid, ("", True))
    _scenarios[item.nodeid] = (_group(str(item.fspath)), survived and report.passed)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed and "reliability" in report.nodeid:
        _scenarios[report.nodeid] = (_group(report.nodeid), False)


def _results() -> dict[str, dict[str, int]]:
    results: dict[str, dict[str, int]] = defaultdict(lambda: {"tried": 0, "survived": 0})
    for group, survived in _scenarios.values():
        results[group]["tried"] += 1
        results[group]["survived"] += int(survived)
    return dict(sorted(results.items()))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get("ORT_AUTOPATCH_RELIABILITY_RESULTS")
    results = _results()
    if target and results:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(results, indent=2) + "\n")
