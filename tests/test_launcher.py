"""``python -m ort_autopatch``: a script or ``-m`` module runs exactly as under ``python``.

Every test runs real interpreters: the probe script prints what python gives a main module, and
the outputs of ``python ...`` and ``python -m ort_autopatch ...`` must be equal.
"""

from __future__ import annotations

import json
import pathlib
import sys
import textwrap

import pytest

from ort_autopatch import cli
from ort_autopatch.config import load_config
from tests.proc_helpers import LAUNCHER, PY, REPO, run


def _installed_ort() -> tuple[str, str, bool]:
    """The ONNX Runtime installed here: distribution, version, whether a training build."""
    from importlib import metadata

    for name in ("onnxruntime-training-cpu", "onnxruntime-training", "onnxruntime"):
        try:
            return name, metadata.version(name), "training" in name
        except metadata.PackageNotFoundError:
            continue
    raise AssertionError("no ONNX Runtime installed")

PROBE = textwrap.dedent(
    """\
    import os, pickle, sys
    print("at start: torch", "torch" in sys.modules, "multiprocessing",
          "multiprocessing" in sys.modules)
    print("argv", sys.argv)
    print("path0", sys.path[0])
    print("name", __name__, "package", __package__)
    print("file", __file__, "cached", __cached__)
    print("spec", None if __spec__ is None else (__spec__.name, __spec__.origin, __spec__.parent))
    print("loader", type(__loader__).__name__, "builtins", type(__builtins__).__name__)
    print("globals", sorted(globals()))
    print("main module", sys.modules["__main__"].__dict__ is globals())
    print("excepthook untouched", sys.excepthook is sys.__excepthook__)

    class Point:
        def __init__(self, x):
            self.x = x

    p = pickle.loads(pickle.dumps(Point(3)))
    print("pickle", type(p).__module__, type(p).__qualname__, p.x, type(p) is Point)
    import multiprocessing
    print("mp_main alias", sys.modules["__mp_main__"] is sys.modules["__main__"])

    def fail(how):
        if how == "raise":
            raise ValueError("boom")
        if how == "kbd":
            raise KeyboardInterrupt
        sys.exit(int(how) if how.isdigit() else how)

    sys.stdout.flush()
    fail(os.environ.get("PROBE_EXIT", "0"))
    """
)


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("probe")
    (root / "probe.py").write_text(PROBE)
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(PROBE)
    (pkg / "__main__.py").write_text(PROBE)
    return root


def _both(
    args: list[str], cwd: pathlib.Path, exit_how: str
) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    env = {"PROBE_EXIT": exit_how}
    plain = run([PY, *args], cwd=cwd, env=env, timeout=30)
    # A selection that matches nothing: the hook is installed, nothing is patched, and at exit
    # the launcher says so (the only difference to python's output).
    ours = run([*LAUNCHER, "--modules", "nowhere.at_all:Nothing", *args], cwd=cwd, env=env)
    stderr, feedback = _split_feedback(ours.stderr)
    if exit_how != "kbd":
        assert feedback == NOTHING_MATCHED, ours.stderr
    return (
        (plain.returncode, plain.stdout, plain.stderr),
        (ours.returncode, ours.stdout, stderr),
    )


NOTHING_MATCHED = [
    "[ort_autopatch] WARNING --modules pattern 'nowhere.at_all:Nothing' matched no class: "
    "module 'nowhere.at_all' was never imported",
    "[ort_autopatch] WARNING nothing ran in ONNX Runtime: no selected class was found (see the "
    "patterns above)",
]


def _split_feedback(stderr: str) -> tuple[str, list[str]]:
    """(stderr without the launcher's lines, the launcher's lines)."""
    ours = [line for line in stderr.splitlines() if line.startswith("[ort_autopatch]")]
    rest = "".join(
        line for line in stderr.splitlines(keepends=True) if not line.startswith("[ort_autopatch]")
    )
    return rest, ours


def _without_runpy_frames(stderr: str) -> str:
    # python -m shows two frames of its own runpy; the launcher shows the user's frames only.
    return "\n".join(line for line in stderr.splitlines() if "<frozen runpy>" not in line)


ENTRIES = {
    "script": (["probe.py", "a", "b"], ""),
    "relative-script": (["../probe.py", "--flag", "c"], "pkg"),
    "-m-module": (["-m", "pkg.mod", "a", "b"], ""),
    "-m-package": (["-m", "pkg", "x"], ""),
    "folder": (["pkg", "y"], ""),  # a folder with __main__.py
}
# Every way in with an exception (its traceback's frames depend on the way in), and each other
# way out (exit 0, exit 3, sys.exit("bye"), ^C) through two or three ways in, not all 25 pairs.
PROBES = [(entry, "raise") for entry in ENTRIES] + [
    ("script", "0"),
    ("-m-module", "0"),
    ("folder", "0"),
    ("relative-script", "3"),
    ("-m-package", "3"),
    ("script", "bye"),
    ("-m-package", "bye"),
    ("-m-module", "kbd"),
    ("folder", "kbd"),
]


@pytest.mark.parametrize(
    ("args", "subdir", "exit_how"),
    [(*ENTRIES[entry], exit_how) for entry, exit_how in PROBES],
    ids=[f"{exit_how}-{entry}" for entry, exit_how in PROBES],
)
def test_probe_parity(probe_dir: pathlib.Path, args: list[str], subdir: str, exit_how: str) -> None:
    plain, ours = _both(args, probe_dir / subdir, exit_how)
    assert ours[0] == plain[0], ours[2]
    assert ours[1] == plain[1]
    assert "at start: torch False multiprocessing False" in ours[1]
    assert "pickle __main__ Point 3 True" in ours[1]
    assert "mp_main alias True" in ours[1]
    assert ours[2] == _without_runpy_frames(plain[2]) + ("\n" if plain[2] else "") or (
        ours[2] == plain[2]
    )


def test_probe_parity_spot_checks(probe_dir: pathlib.Path) -> None:
    """What the parity test compares is what it should be (not equal by being empty)."""
    plain, ours = _both(["-m", "pkg.mod", "a"], probe_dir, "raise")
    out = ours[1]
    assert f"argv ['{probe_dir / 'pkg' / 'mod.py'}', 'a']" in out
    assert f"path0 {probe_dir}" in out
    assert "spec ('pkg.mod'" in out and "name __main__ package pkg" in out
    assert ours[0] == 1
    assert ours[2].startswith("Traceback (most recent call last):\n")
    assert "ort_autopatch" not in ours[2] and "ValueError: boom" in ours[2]
    assert plain[0] == 1 and ours[2] == _without_runpy_frames(plain[2]) + "\n"


def test_kbd_exits_by_sigint_like_python(probe_dir: pathlib.Path) -> None:
    plain, ours = _both(["probe.py"], probe_dir, "kbd")
    assert plain[0] == ours[0] == -2  # killed by SIGINT, as python does on ^C
    assert ours[2] == plain[2] and "KeyboardInterrupt" in ours[2]


def test_missing_script_and_module_like_python(tmp_path: pathlib.Path) -> None:
    for args in (["nosuch.py"], ["-m", "nosuch_mod_xyz"], ["-m", "nosuch_pkg_xyz.mod"]):
        plain = run([PY, *args], cwd=tmp_path)
        ours = run([*LAUNCHER, *args], cwd=tmp_path)
        assert (ours.returncode, ours.stdout, ours.stderr) == (
            plain.returncode,
            plain.stdout,
            plain.stderr,
        )


def test_syntax_error_like_python(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bad.py").write_text("x = 1\ndef (:\n")
    plain = run([PY, "bad.py"], cwd=tmp_path)
    ours = run([*LAUNCHER, "bad.py"], cwd=tmp_path)
    assert (ours.returncode, ours.stderr) == (plain.returncode, plain.stderr)


def test_user_excepthook_gets_the_trimmed_traceback(tmp_path: pathlib.Path) -> None:
    (tmp_path / "hooked.py").write_text(
        textwrap.dedent(
            """\
            import sys, traceback
            def hook(kind, value, tb):
                print("HOOK", [f.name for f in traceback.extract_tb(tb)], file=sys.stderr)
            sys.excepthook = hook
            def inner():
                raise RuntimeError("x")
            inner()
            """
        )
    )
    plain = run([PY, "hooked.py"], cwd=tmp_path)
    ours = run([*LAUNCHER, "--modules", "nowhere.at_all:Nothing", "hooked.py"], cwd=tmp_path)
    stderr, feedback = _split_feedback(ours.stderr)
    assert plain.stderr == stderr == "HOOK ['<module>', 'inner']\n"
    assert feedback == NOTHING_MATCHED
    assert plain.returncode == ours.returncode == 1


# -- options, errors, --check, --version ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--opset", "3"], {}, "--opset='3' is not valid: out of range"),
        (["--log-level", "LOUD"], {}, "--log-level='LOUD' is not valid"),
        (["--skip-check", "SKIP_NOTHING"], {}, "--skip-check='SKIP_NOTHING' is not valid"),
        ([], {"ORT_AUTOPATCH_MODULES": "no_colon"}, "ORT_AUTOPATCH_MODULES='no_colon'"),
        (["--bogus"], {}, "unrecognized arguments: --bogus"),
    ],
)
def test_bad_option_exits_2_before_the_script(
    tmp_path: pathlib.Path, args: list[str], env: dict[str, str], message: str
) -> None:
    (tmp_path / "script.py").write_text("print('SCRIPT RAN')\n")
    result = run([*LAUNCHER, *args, "script.py"], cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert "SCRIPT RAN" not in result.stdout


def test_nothing_to_run_is_a_usage_error() -> None:
    result = run([*LAUNCHER, "--modules", "a:B"])
    assert result.returncode == 2 and "nothing to run" in result.stderr
    assert "usage: python -m ort_autopatch [options] script.py" in result.stderr


def test_script_options_are_not_ours(tmp_path: pathlib.Path) -> None:
    (tmp_path / "s.py").write_text("import sys; print(sys.argv)\n")
    result = run(
        [*LAUNCHER, "--log-level", "ERROR", "s.py", "--log-level", "--check", "-m"], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "['s.py', '--log-level', '--check', '-m']\n"


def test_help_has_an_example() -> None:
    result = run([*LAUNCHER, "--help"])
    assert result.returncode == 0
    assert "examples:" in result.stdout and "torchrun --nproc_per_node 2 -m ort_autopatch" in (
        result.stdout
    )
    for flag in (
        "--modules",
        "--exclude",
        "--disable",
        "--skip-check",
        "--fallback",
        "--report",
        "--log-level",
        "--cache-dir",
        "--save-onnx",
        "--opset",
        "--threads",
        "--cache-size",
        "--check",
        "--version",
    ):
        assert flag in result.stdout


def test_version_imports_neither_torch_nor_onnxruntime() -> None:
    code = (
        "import sys; from ort_autopatch.cli import main; main(['--version']); "
        "print('torch' in sys.modules, 'onnxruntime' in sys.modules)"
    )
    result = run([PY, "-c", code])
    first, second = result.stdout.splitlines()
    assert first.startswith("ort_autopatch 0.1.0 (Python 3.")
    assert "torch 2." in first and f"onnxruntime {_installed_ort()[1]}" in first
    assert second == "False False"


def test_check_reports_a_working_setup() -> None:
    result = run([*LAUNCHER, "--modules", "mypkg.models:Net", "--check"], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    name, version, training = _installed_ort()
    kind = "training build" if training else "inference-only build"
    assert f"{name} {version} ({kind})" in out
    assert "CPUExecutionProvider" in out
    assert "accelerate    yes" in out
    # compiled (here at the session's start); the training build's only (its ATen nodes)
    assert ("ATen executor ready (" in out) == training
    assert "ORT_AUTOPATCH_MODULES=mypkg.models:Net" in out
    assert f"Python        {sys.version.split()[0]}" in out


def test_check_names_an_inference_build_as_the_problem_of_the_training_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ort_autopatch.engine import runtime

    monkeypatch.setattr(runtime, "installed_distributions", lambda: {"onnxruntime": "1.20.1"})
    text, ok = cli.check(load_config(environ={"ORT_AUTOPATCH_BACKEND": "ort-training"}))
    assert not ok
    assert "onnxruntime 1.20.1 (inference-only build)" in text
    assert "problem: onnxruntime==1.20.1 is an inference-only build" in text
    assert "accelerate    no" in text


def test_check_says_which_backend_and_onnx_runtime_run() -> None:
    text, ok = cli.check(load_config(environ={}))
    assert ok
    _, version, training = _installed_ort()
    backend = "ort-training" if training else "ort"
    assert f"backend       {backend} (ONNX Runtime {version})" in text


def test_check_names_two_conflicting_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from ort_autopatch.engine import runtime

    both = {"onnxruntime-training-cpu": "1.19.2", "onnxruntime": "1.20.1"}
    monkeypatch.setattr(runtime, "installed_distributions", lambda: both)
    text, ok = cli.check(load_config(environ={}))
    assert not ok and "Uninstall onnxruntime" in text


def test_split_argv() -> None:
    split = cli.split_argv
    assert split(["--modules", "a:B", "s.py", "--modules", "x"]) == (
        ["--modules", "a:B"],
        ("script", "s.py"),
        ["--modules", "x"],
    )
    assert split(["--disable", "-m", "pkg.mod", "-m"]) == (
        ["--disable"],
        ("module", "pkg.mod"),
        ["-m"],
    )
    assert split(["--report=r.json", "-mpkg", "a"]) == (
        ["--report=r.json"],
        ("module", "pkg"),
        ["a"],
    )
    assert split(["--", "-weird.py"]) == ([], ("script", "-weird.py"), [])
    assert split(["--disable", "-c", "print(1)", "-c", "x"]) == (
        ["--disable"],
        ("code", "print(1)"),
        ["-c", "x"],
    )
    assert split(["-cpass"]) == ([], ("code", "pass"), [])
    assert split(["--check"]) == (["--check"], None, [])


CODE_PROBE = (
    "import sys; print(sys.argv, repr(sys.path[0]), sorted(globals()), __name__, "
    "__spec__, __package__, type(__loader__).__name__)"
)


def test_dash_c_runs_code_like_python(tmp_path: pathlib.Path) -> None:
    plain = run([PY, "-c", CODE_PROBE, "a", "-b"], cwd=tmp_path)
    ours = run([*LAUNCHER, "--modules", "x:Y", "-c", CODE_PROBE, "a", "-b"], cwd=tmp_path)
    assert plain.returncode == ours.returncode == 0, ours.stderr
    assert ours.stdout == plain.stdout
    assert "['-c', 'a', '-b'] ''" in ours.stdout


def test_dash_c_code_trains_its_own_classes_through_ort(tmp_path: pathlib.Path) -> None:
    result = run(
        [*LAUNCHER, "--modules", "__main__:Net", "--report", "r.json", "-c", TRAIN], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    net = json.loads((tmp_path / "r.json").read_text())["classes"]["__main__:Net"]
    assert (net["ort_calls"], net["eager_calls"]) == (3, 0)


def test_a_compiled_script_runs_and_a_bad_one_is_refused(tmp_path: pathlib.Path) -> None:
    import py_compile

    (tmp_path / "s.py").write_text("import sys\nprint('compiled', sys.argv)\n")
    py_compile.compile(str(tmp_path / "s.py"), cfile=str(tmp_path / "s.pyc"))
    ours = run([*LAUNCHER, "s.pyc", "x"], cwd=tmp_path)
    assert (
        ours.stdout == run([PY, "s.pyc", "x"], cwd=tmp_path).stdout == "compiled ['s.pyc', 'x']\n"
    )
    (tmp_path / "bad.pyc").write_bytes(b"not a pyc file at all")
    bad = run([*LAUNCHER, "bad.pyc"], cwd=tmp_path)
    assert bad.returncode == 1 == run([PY, "bad.pyc"], cwd=tmp_path).returncode
    assert "bad magic number" in bad.stderr


# -- the exit report --------------------------------------------------------------------------

TRAIN = textwrap.dedent(
    """\
    import torch
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)
        def forward(self, x):
            return self.lin(x).relu().sum()
    net = Net()
    for _ in range(3):
        net(torch.randn(5, 4)).backward()
    print("done")
    """
)


def test_report_file_content(tmp_path: pathlib.Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    result = run(
        [
            *LAUNCHER,
            "--modules",
            "__main__:Net,nowhere:Nothing",
            "--report",
            "out/r.json",
            "train.py",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    # WARNING level: no summary; the one pattern that matched nothing is the only line but
    # for a build slower than 2 s (the plain backend's first), which says so while it runs
    said = [line for line in result.stderr.splitlines(True) if "still building" not in line]
    assert "".join(said) == (
        "[ort_autopatch] WARNING --modules pattern 'nowhere:Nothing' matched no class: "
        "module 'nowhere' was never imported\n"
    )
    data = json.loads((tmp_path / "out" / "r.json").read_text())
    assert data["version"] == "0.1.0"
    assert data["torch"].startswith("2.") and data["onnxruntime"] == _installed_ort()[1]
    assert data["unmatched"] == ["nowhere:Nothing"]
    net = data["classes"]["__main__:Net"]
    for key in (
        "instances",
        "ort_calls",
        "eager_calls",
        "exports",
        "rebuilds",
        "fallbacks",
        "export_seconds",
        "ignored_writes",
    ):
        assert key in net
    assert (net["instances"], net["ort_calls"], net["eager_calls"], net["exports"]) == (1, 3, 0, 1)


def test_a_typo_in_the_selection_names_the_class_it_meant(tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.py").write_text(
        "import torch\nclass RNNModel(torch.nn.Module):\n    def forward(self, x):\n"
        "        return x * 2\n"
    )
    (tmp_path / "train.py").write_text(
        "import torch\nimport model\nmodel.RNNModel()(torch.ones(2))\n"
    )
    result = run([*LAUNCHER, "--modules", "model:RNNModl", "train.py"], cwd=tmp_path)
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "[ort_autopatch] WARNING --modules pattern 'model:RNNModl' matched no class; did you mean "
        "model:RNNModel?",
        "[ort_autopatch] WARNING nothing ran in ONNX Runtime: no selected class was found (see the "
        "patterns above)",
    ]


def test_the_right_class_under_the_wrong_module_is_suggested(tmp_path: pathlib.Path) -> None:
    (tmp_path / "train.py").write_text(
        "import torch\nclass Net(torch.nn.Linear):\n    pass\nNet(2, 2)(torch.ones(2))\n"
    )
    result = run([*LAUNCHER, "--modules", "train:Net", "train.py"], cwd=tmp_path)
    assert "'train:Net' matched no class; did you mean __main__:Net?" in result.stderr


def test_a_run_where_every_call_fell_back_says_so_in_one_line(tmp_path: pathlib.Path) -> None:
    (tmp_path / "train.py").write_text(
        "import torch\nclass Net(torch.nn.Module):\n    def forward(self, x):\n"
        "        return x.numpy().sum()\n"  # not traceable: the export fails
        "Net()(torch.ones(2))\n"
    )
    result = run([*LAUNCHER, "--modules", "__main__:Net", "train.py"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(
        "[ort_autopatch] WARNING nothing ran in ONNX Runtime: every call ran in PyTorch (fallback: "
    ), result.stderr


def test_a_run_without_a_selection_says_nothing_ran(tmp_path: pathlib.Path) -> None:
    (tmp_path / "s.py").write_text("print('hi')\n")
    result = run([*LAUNCHER, "s.py"], cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "hi\n")
    assert result.stderr == (
        "[ort_autopatch] WARNING nothing ran in ONNX Runtime: no class is selected (give "
        "--modules or ORT_AUTOPATCH_MODULES)\n"
    )


def test_check_says_nothing_selected() -> None:
    result = run([*LAUNCHER, "--check"])
    assert "selection     nothing selected: give --modules PATTERNS or ORT_AUTOPATCH_MODULES" in (
        result.stdout
    )


def test_check_warns_about_a_typo_with_a_suggestion(tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.py").write_text("import torch\nclass RNNModel(torch.nn.Module):\n    pass\n")
    result = run(
        [*LAUNCHER, "--check", "--modules", "model:RNNModl,model:RNNModel,__main__:Net"],
        cwd=tmp_path,
    )
    lines = result.stdout.splitlines()
    assert "  selection     model:RNNModel" in lines
    assert (
        "  WARNING --modules pattern 'model:RNNModl' matched no class; did you mean "
        "model:RNNModel?" in lines
    )
    assert "  (checked when the script runs: __main__:Net)" in lines


@pytest.mark.parametrize(
    ("rank", "template", "written", "summary"),
    [
        (None, "r.json", "r.json", True),
        ("0", "r-{rank}.json", "r-0.json", True),
        ("1", "r-{rank}.json", "r-1.json", False),
        ("1", "r.json", None, False),  # without {rank} only rank 0 writes
    ],
)
def test_report_per_rank(
    tmp_path: pathlib.Path, rank: str | None, template: str, written: str | None, summary: bool
) -> None:
    (tmp_path / "s.py").write_text("print('ok')\n")
    env = {"RANK": rank} if rank is not None else {}
    result = run(
        [*LAUNCHER, "--modules", "a:B", "--report", template, "--log-level", "INFO", "s.py"],
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in tmp_path.glob("r*.json"))
    assert files == ([written] if written else [])
    if written:
        data = json.loads((tmp_path / written).read_text())
        assert data["classes"] == {} and data["unmatched"] == ["a:B"]
    assert ("summary" in result.stderr) is summary


def test_report_dash_prints_summary_only(tmp_path: pathlib.Path) -> None:
    (tmp_path / "s.py").write_text("import sys; sys.exit(4)\n")
    result = run([*LAUNCHER, "--modules", "a:B", "--report", "-", "s.py"], cwd=tmp_path)
    assert result.returncode == 4
    assert "summary" in result.stderr and "patterns that matched no class: a:B" in result.stderr
    assert list(tmp_path.glob("*.json")) == [] and not (tmp_path / "-").exists()


def test_disable_runs_plainly(tmp_path: pathlib.Path) -> None:
    (tmp_path / "s.py").write_text(
        "import os, ort_autopatch; print(ort_autopatch.installed_config(), "
        "os.environ['ORT_AUTOPATCH_ENABLED'])\n"
    )
    result = run(
        [*LAUNCHER, "--disable", "--modules", "a:B", "--report", "r.json", "s.py"], cwd=tmp_path
    )
    assert result.stdout == "None 0\n" and not (tmp_path / "r.json").exists()


def test_main_module_file_is_the_launcher_entry() -> None:
    assert (REPO / "ort_autopatch" / "__main__.py").is_file()
    assert pathlib.Path(cli.BOOTSTRAP_DIR, "sitecustomize.py").is_file()
