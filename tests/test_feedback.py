"""What the user is told about the selection: close names for a typo, one line when nothing ran."""

from __future__ import annotations

import types

import torch

from ort_autopatch import feedback

CANDIDATES = [
    "model:RNNModel",
    "model:Encoder",
    "__main__:Net",
    "torch.nn.modules.linear:Linear",
]


def test_a_misspelt_class_gets_the_close_name() -> None:
    assert feedback.suggestions("model:RNNModl", CANDIDATES) == ["model:RNNModel"]


def test_a_misspelt_module_gets_the_close_name() -> None:
    assert feedback.suggestions("modle:RNNModel", CANDIDATES) == ["model:RNNModel"]


def test_the_right_class_under_the_wrong_module_is_found_by_its_name() -> None:
    assert feedback.suggestions("train:Net", CANDIDATES) == ["__main__:Net"]


def test_a_class_name_in_the_wrong_case_is_found() -> None:
    assert feedback.suggestions("model:rnnmodel", CANDIDATES) == ["model:RNNModel"]


def test_nothing_close_suggests_nothing() -> None:
    assert feedback.suggestions("data:Loader", CANDIDATES) == []


def test_a_module_never_imported_is_named() -> None:
    message = feedback.unmatched_message("data:Loader", CANDIDATES, modules={})
    assert (
        message
        == "--modules pattern 'data:Loader' matched no class: module 'data' was never imported"
    )


def test_imported_classes_lists_module_subclasses_defined_in_each_module() -> None:
    module = types.ModuleType("user_models")

    Net = type("Net", (torch.nn.Module,), {"__module__": "user_models"})
    module.Net = Net  # type: ignore[attr-defined]
    module.Linear = torch.nn.Linear  # type: ignore[attr-defined]  (imported, not defined here)
    module.plain = object  # type: ignore[attr-defined]
    assert feedback.imported_classes({"torch": torch, "user_models": module}) == ["user_models:Net"]


def test_imported_classes_is_empty_without_torch() -> None:
    assert feedback.imported_classes({}) == []


def test_nothing_ran_names_the_commonest_eager_reasons() -> None:
    classes = {
        "m:A": {
            "instances": 1,
            "ort_calls": 0,
            "eager_reasons": [{"reason": "hooks on submodules", "count": 3}],
        }
    }
    assert feedback.nothing_ran(classes, selected=True) == (
        "nothing ran in ONNX Runtime: every call ran in PyTorch (hooks on submodules (3))"
    )


def test_a_run_that_ended_while_its_graphs_were_built_aside_says_so() -> None:
    classes = {
        "m:A": {
            "instances": 1,
            "ort_calls": 0,
            "eager_reasons": [
                {"reason": "graph building in a helper process", "count": 20},
                {"reason": "waiting for another graph's build", "count": 10},
            ],
        }
    }
    said = feedback.nothing_ran(classes, selected=True)
    assert said is not None
    assert said.startswith(
        "nothing ran in ONNX Runtime yet: the run ended before a helper process had built its "
        "graphs (30 calls ran in PyTorch meanwhile)"
    )
    assert "--foreground-builds" in said and "--cache-dir" in said
    # any other reason among them: the reasons are named as before
    classes["m:A"]["eager_reasons"].append({"reason": "hooks on submodules", "count": 1})
    assert feedback.nothing_ran(classes, selected=True) == (
        "nothing ran in ONNX Runtime: every call ran in PyTorch (graph building in a helper "
        "process (20), waiting for another graph's build (10), hooks on submodules (1))"
    )


def test_nothing_ran_is_silent_when_one_call_ran_in_ort() -> None:
    classes = {"m:A": {"instances": 1, "ort_calls": 1}, "m:B": {"instances": 1, "ort_calls": 0}}
    assert feedback.nothing_ran(classes, selected=True) is None


def test_nothing_ran_names_classes_never_called() -> None:
    assert feedback.nothing_ran({"m:A": {"instances": 0, "ort_calls": 0}}, selected=True) == (
        "nothing ran in ONNX Runtime: the selected classes (m:A) were never called"
    )


def test_nothing_ran_counts_the_uncalled_classes_a_wildcard_selected() -> None:
    assert feedback.nothing_ran({}, selected=True, uncalled=130) == (
        "nothing ran in ONNX Runtime: none of the 130 selected classes was called"
    )
