"""Shared by every test: pytest rewrites the asserts of the helper modules too, so a failing
comparison inside a helper explains itself as one in a test does; and no test may let a line
of ONNX Runtime's C++ logger reach stderr (errors reach users through the tool's messages);
and the ATen executor is compiled before the first test (as `python -m ort_autopatch --check`
does), so every test's graphs use it from the first one and no test's time limit pays for the
build (the tests of the background build compile into folders of their own). FAST names the
quick loop (`nox -s tests_fast`, `pytest -m fast`)."""

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


# The quick loop a developer runs on every change (`nox -s tests_fast`, under 3 minutes on two
# cores): the unit-level files whole, and from each area's slower files one parity test, chosen
# by measured durations (`pytest --durations`). A name here that no longer exists is an error
# of `-m fast`, so a rename cannot shrink the loop unnoticed.
FAST_FILES = {
    "tests/test_autocast.py",
    "tests/test_backward_hooks.py",
    "tests/test_build_safety.py",
    "tests/test_callkey.py",
    "tests/test_config.py",
    "tests/test_engine_reporting.py",
    "tests/test_errors.py",
    "tests/test_feedback.py",
    "tests/test_graph_passes.py",
    "tests/test_objects.py",
    "tests/test_policy.py",
    "tests/test_runtime.py",
    "tests/test_symbolics.py",
    "tests/test_tracing.py",
    "tests/test_versions.py",
}
FAST_TESTS: set[str] = set()  # "tests/file.py::test_name", every parametrization of it


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    collected: set[str] = set()  # files and tests this run collected
    for item in items:
        file = item.path.relative_to(root).as_posix()
        test = f"{file}::{getattr(item, 'originalname', item.name)}"
        collected.update((file, test))
        if file in FAST_FILES or test in FAST_TESTS:
            item.add_marker(pytest.mark.fast)
    if config.option.markexpr != "fast":
        return
    missing = {
        name
        for name in FAST_FILES | FAST_TESTS
        if not (root / name.split("::")[0]).is_file()
        or (name.split("::")[0] in collected and name not in collected)
    }
    if missing:
        raise pytest.UsageError(
            f"tests/conftest.py FAST names what does not exist: {sorted(missing)}"
        )
