"""Shared by every test: pytest rewrites the asserts of the helper modules too, so a failing
comparison inside a helper explains itself as one in a test does; and no test may let a line
of ONNX Runtime's C++ logger reach stderr (errors reach users through the tool's messages);
and the ATen executor is compiled before the first test (as `python -m ort_autopatch --check`
does), so every test's graphs use it from the first one and no test's time limit pays for the
build (the tests of the background build compile into folders of their own). FAST names the
quick loop (`nox -s tests_fast`, `pytest -m fast`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Every test's graphs are built by the call that needs them, which then runs in ONNX Runtime
# (the tests of helper-process builds, tests/test_background_builds.py, turn them on).
os.environ["ORT_AUTOPATCH_BACKGROUND_BUILDS"] = "0"

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
    from ort_autopatch.engine.backends.ort_training.torch_in_graph import aten_executor

    if aten_executor.compiler() is not None:
        aten_executor.build(aten_executor.default_folder())


# The quick loop a developer runs on every change (`nox -s tests_fast`, under 3 minutes on two
# cores): the unit-level files whole, and from each area's slower files one parity test, chosen
# by measured durations (`pytest --durations`). A name here that no longer exists is an error
# of `-m fast`, so a rename cannot shrink the loop unnoticed.
FAST_FILES = {
    "tests/test_autocast.py",
    "tests/test_backends.py",
    "tests/test_backward_hooks.py",
    "tests/test_run_plumbing.py",
    "tests/test_build_safety.py",
    "tests/test_callkey.py",
    "tests/test_config.py",
    "tests/test_cuda_setup.py",
    "tests/test_engine_reporting.py",
    "tests/test_engine_semantics.py",
    "tests/test_errors.py",
    "tests/test_feedback.py",
    "tests/test_graph_passes.py",
    "tests/test_hazards.py",
    "tests/test_layout.py",
    "tests/test_objects.py",
    "tests/test_passes.py",
    "tests/test_persist.py",
    "tests/test_policy.py",
    "tests/test_random_ops.py",
    "tests/test_recompute.py",
    "tests/test_rng.py",
    "tests/test_runtime.py",
    "tests/test_session.py",
    "tests/test_side_effects.py",
    "tests/test_static_shapes.py",
    "tests/test_symbolics.py",
    "tests/test_tracing.py",
    "tests/test_verify.py",
    "tests/test_versions.py",
}
# "file::test" takes every parametrization, "file::test[id]" one.
FAST_TESTS = {
    "tests/reliability/test_concurrency.py::test_four_threads_training_their_own_instances_match_serial_training",
    "tests/reliability/test_faults.py::test_gradient_builder_failing_falls_back_with_eager_state",
    "tests/reliability/test_faults.py::test_ort_failing_inside_backward_raises_typed_and_writes_no_gradient",
    "tests/reliability/test_inputs.py::test_non_contiguous_inputs_give_eager_results",
    "tests/test_aten_nodes.py::test_an_aten_node_reads_a_scalar_argument",
    "tests/test_autograd_promises.py::test_in_place_update_of_a_saved_input_raises_eager_s_error",
    "tests/test_autograd_promises.py::test_in_place_update_of_an_output_backward_does_not_read_is_allowed_as_in_eager",
    "tests/test_engine_parity.py::test_bert_for_sequence_classification_parity[sdpa]",
    "tests/test_engine_parity.py::test_cnn_batchnorm_maxpool_parity_with_dropout_in_eval",
    "tests/test_engine_parity.py::test_mlp_adamw_parity",
    "tests/test_engine_parity.py::test_transformer_encoder_layer_parity_dropout_zero",
    "tests/test_input_variety.py::test_a_branch_on_a_size_keeps_one_graph_until_the_branch_flips",
    "tests/test_input_variety.py::test_len_of_the_batch_gives_each_batch_size_its_own_graph",
    "tests/test_patcher.py::test_each_fallback_flag_covers_its_kind_of_failure",
    "tests/test_patcher.py::test_training_step_calling_self_trains_through_ort",
    "tests/test_patcher.py::test_unsupported_input_falls_back_with_one_warning",
    "tests/test_patcher.py::test_writing_an_attribute_forward_reads_rebuilds_and_a_toggle_back_reuses",
    "tests/test_randomness.py::test_dropout_is_reproducible_under_manual_seed_and_leaves_the_stream_alone",
    "tests/test_torch_nodes.py::test_a_large_gelus_gradient_runs_in_torch_with_eager_numbers",
    "tests/test_torch_nodes.py::test_max_min_reductions_and_einsum_train_with_eager_gradients",
    "tests/test_torch_nodes.py::test_straight_through_estimator_runs_its_own_backward_in_the_graph",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    collected: set[str] = set()  # files and tests this run collected
    for item in items:
        file = item.path.relative_to(root).as_posix()
        test = f"{file}::{getattr(item, 'originalname', item.name)}"
        one = f"{file}::{item.name}"  # with its parameters' id
        collected.update((file, test, one))
        if file in FAST_FILES or test in FAST_TESTS or one in FAST_TESTS:
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
