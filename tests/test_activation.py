"""install()/uninstall() and the import orders a user can hit, each in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.proc_helpers import FOREGROUND_BUILDS

ROOT = Path(__file__).resolve().parent.parent

MODELS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


class Other(nn.Module):
    def forward(self, x):
        return x
"""

REPORT = """
from ort_autopatch import report
stats = report.snapshot().get("mymodels:Net", {})
print(stats.get("ort_calls"), ort_autopatch.is_patched(mymodels.Net))
"""


def _run(
    tmp_path: Path, body: str, modules: str = "mymodels:Net", report: bool = False, **env: str
) -> str:
    (tmp_path / "mymodels.py").write_text(MODELS)
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(body) + (REPORT if report else ""))
    result = _launch(tmp_path, script, modules, **env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _launch(
    tmp_path: Path, script: Path, modules: str, **env: str
) -> subprocess.CompletedProcess[str]:
    environ = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{ROOT}:{tmp_path}",
        "ORT_AUTOPATCH_MODULES": modules,
        **FOREGROUND_BUILDS,
        **env,
    }
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=environ
    )


def test_hook_installed_before_the_import(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import ort_autopatch
        ort_autopatch.install()
        import torch, mymodels
        mymodels.Net()(torch.randn(3, 4))
        """,
        report=True,
    )
    assert out == "1 True"


def test_module_imported_before_install_is_patched_at_once(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import torch, mymodels, ort_autopatch
        ort_autopatch.install()
        mymodels.Net()(torch.randn(3, 4))
        """,
        report=True,
    )
    assert out == "1 True"


def test_a_name_imported_before_install_sees_the_patch(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import torch, ort_autopatch
        from mymodels import Net
        import mymodels
        ort_autopatch.install()
        Net()(torch.randn(3, 4))
        """,
        report=True,
    )
    assert out == "1 True"


def test_unselected_classes_keep_their_call(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import torch, ort_autopatch
        ort_autopatch.install()
        import mymodels
        print(mymodels.Other.__call__ is torch.nn.Module.__call__)
        """,
    )
    assert out == "True"


def test_a_subclass_of_a_selected_class_is_patched(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import torch, ort_autopatch
        ort_autopatch.install()
        import mymodels

        class Wider(mymodels.Net):
            pass

        Wider()(torch.randn(3, 4))
        from ort_autopatch import report
        print(report.snapshot()["__main__:Wider"]["ort_calls"])
        """,
    )
    assert out == "1"


def test_reload_patches_the_new_class_once(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import importlib, torch, ort_autopatch
        ort_autopatch.install()
        import mymodels
        old = mymodels.Net
        importlib.reload(mymodels)
        print(mymodels.Net is not old, ort_autopatch.is_patched(mymodels.Net))
        mymodels.Net()(torch.randn(3, 4))
        """,
        report=True,
    )
    assert out.splitlines() == ["True True", "1 True"]


def test_install_twice_is_a_no_op_and_uninstall_restores(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import sys, torch, ort_autopatch
        finders = len(sys.meta_path)
        print(ort_autopatch.install(), ort_autopatch.install(), len(sys.meta_path) - finders)
        import mymodels
        ort_autopatch.uninstall()
        print(len(sys.meta_path) == finders, ort_autopatch.is_patched(mymodels.Net),
              "__call__" in mymodels.Net.__dict__)
        """,
    )
    assert out.splitlines() == ["True False 1", "True False False"]


def test_excluded_class_is_not_patched(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import torch, ort_autopatch
        ort_autopatch.install()
        import mymodels
        print(ort_autopatch.is_patched(mymodels.Net), ort_autopatch.unmatched_patterns())
        """,
        modules="mymodels:*,typo.module:Net",
        ORT_AUTOPATCH_EXCLUDE="mymodels:Net",
    )
    assert out == "False ['typo.module:Net']"


def test_a_bad_configuration_names_the_variable_and_patches_nothing(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import ort_autopatch
        try:
            ort_autopatch.install()
        except ort_autopatch.ConfigError as exc:
            print(exc)
        import mymodels
        print(ort_autopatch.is_patched(mymodels.Net))
        """,
        ORT_AUTOPATCH_FALLBACK_POLICY="FALLBACK_BOGUS",
    )
    first, second = out.splitlines()
    assert "ORT_AUTOPATCH_FALLBACK_POLICY='FALLBACK_BOGUS' is not valid" in first
    assert "FALLBACK_DISABLE" in first and second == "False"


def test_policies_from_the_environment_reach_patched_calls(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import torch, ort_autopatch
        ort_autopatch.install()
        import mymodels
        try:
            mymodels.Net()(torch.randn(3, 4), object())
        except Exception as exc:
            print(type(exc).__name__)
        """,
        ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE",
    )
    assert out == "UnsupportedInputError"


def test_a_python_without_a_training_build_says_why_once_and_runs_eagerly(
    tmp_path: Path,
) -> None:
    (tmp_path / "mymodels.py").write_text(MODELS)
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(
            """
            import ort_autopatch.engine.backend as registry
            registry.unavailable_reason = lambda b: "no ONNX Runtime training build is installed"
            import torch, ort_autopatch
            print(ort_autopatch.install())
            import mymodels
            mymodels.Net()(torch.randn(3, 4))
            mymodels.Net()(torch.randn(3, 4))
            print(ort_autopatch.is_patched(mymodels.Net))
            """
        )
    )
    result = _launch(tmp_path, script, "mymodels:Net")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
    assert result.stderr.count("nothing is accelerated") == 1
    assert "no ONNX Runtime training build is installed" in result.stderr


def test_auto_activation_logs_through_the_scripts_own_handlers(tmp_path: Path) -> None:
    (tmp_path / "mymodels.py").write_text(MODELS)
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(
            """
            import logging, sys
            logging.basicConfig(stream=sys.stdout, format="MINE %(name)s %(message)s")
            import ort_autopatch.auto
            import torch, mymodels
            mymodels.Net()(torch.randn(3, 4))
            """
        )
    )
    result = _launch(tmp_path, script, "mymodels:Net,mymodels:Nett")
    assert result.returncode == 0, result.stderr
    # The tool's records reach the script's handler (they propagate), and no handler of ours
    # prints them a second time on stderr.
    assert (
        "MINE ort_autopatch --modules pattern 'mymodels:Nett' matched no class; did you mean "
        "mymodels:Net?" in result.stdout
    )
    assert "ort_autopatch" not in result.stderr


def test_install_leaves_the_loggers_level_and_propagation_alone() -> None:
    import logging

    import ort_autopatch
    from ort_autopatch.config import Config

    logger = logging.getLogger("ort_autopatch")
    before = (logger.level, logger.propagate, list(logger.handlers))
    installed = ort_autopatch.install(Config(modules=("nowhere:Nothing",), log_level="DEBUG"))
    ort_autopatch.uninstall()
    assert installed
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


@pytest.mark.parametrize(
    ("argv", "launcher"),
    [
        # sys.orig_argv: the interpreter first, then the console script's path
        (["/venv/bin/python", "/venv/bin/accelerate", "launch", "--cpu", "train.py"], True),
        (["/venv/bin/python", "/venv/bin/accelerate-launch", "train.py"], True),
        (["python", "-W", "ignore", "-m", "accelerate.commands.launch", "train.py"], True),
        (["python", "-m", "accelerate.commands.accelerate_cli", "launch", "train.py"], True),
        (["/venv/bin/python", "/venv/bin/accelerate", "env"], False),
        (["python", "train.py", "accelerate", "launch"], False),
        (["python", "-c", "import accelerate"], False),
    ],
)
def test_a_launcher_command_leaves_the_report_to_the_script_it_starts(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], launcher: bool
) -> None:
    # `accelerate launch --cpu` runs the script in one child with no rank: were the launcher
    # to claim the report (and tell its children so), the summary would say nothing ran
    from ort_autopatch import activation

    monkeypatch.setattr(sys, "orig_argv", argv)
    assert activation.is_launcher_command() is launcher
