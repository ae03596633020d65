"""Shared by every test: pytest rewrites the asserts of the helper modules too, so a failing
comparison inside a helper explains itself as one in a test does; and no test may let a line
of ONNX Runtime's C++ logger reach stderr (errors reach users through the tool's messages);
and the ATen executor is compiled before the first test (as a user's first CPU training step
would), so no test's own time limit pays for the build."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.register_assert_rewrite("tests.helpers", "tests.proc_helpers")

from tests.proc_helpers import ORT_LOG_LINE  # noqa: E402  (after the rewrite registration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        return
    for title, text in report.sections:
        own = title == f"Captured stderr {report.when}"  # later phases repeat earlier ones
        found = ORT_LOG_LINE.search(text) if own else None
        if found:
            report.outcome = "failed"
            report.longrepr = f"ONNX Runtime's C++ logger wrote to stderr ({title}):\n{found[0]}"
            return


def pytest_sessionstart(session: pytest.Session) -> None:
    from ort_autopatch.engine import aten_nodes

    if aten_nodes.compiler() is not None:
        aten_nodes.build(aten_nodes.default_folder())
