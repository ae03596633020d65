"""Child processes: activation travels through the environment into every child Python.

Spawned DataLoader workers, multiprocessing pools (spawn, forkserver, fork), ``subprocess`` calls
to python, the bootstrap ``sitecustomize`` itself (chaining, never failing, once per process)
and ``sitecustomize_example/``. Every case runs real interpreters with a timeout.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import textwrap

from ort_autopatch import versions
from ort_autopatch.cli import BOOTSTRAP_DIR
from tests.proc_helpers import LAUNCHER, PY, REPO, run

NET = textwrap.dedent(
    """\
    import json, os, sys
    import torch
    import ort_autopatch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x).sum()

    def seen(_=None):
        main = sys.modules["__main__"]
        config = ort_autopatch.installed_config()
        return json.dumps({
            "activated": config is not None,
            "modules": list(config.modules) if config else None,
            "net_patched": ort_autopatch.is_patched(main.Net),
            "onnxruntime_imported": "onnxruntime" in sys.modules,
            "bootstrap_on_path": any(p.endswith("bootstrap") for p in sys.path),
        }, sort_keys=True)
    """
)


def test_dataloader_spawn_workers(tmp_path: pathlib.Path) -> None:
    result = run(
        [
            *LAUNCHER,
            "--modules",
            "__main__:Net",
            "--report",
            str(tmp_path / "r.json"),
            str(REPO / "examples" / "dataloader_workers.py"),
            "--epochs",
            "1",
            "--json",
        ],
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    workers = [json.loads(w) for w in out["workers"]]
    assert len({w["pid"] for w in workers}) == 2
    assert out["parent_pid"] not in {w["pid"] for w in workers}
    for worker in workers:
        # Activated from the environment, patched the re-run script's Net (as __mp_main__),
        # never called it, so never paid for onnxruntime.
        assert worker == {
            **worker,
            "activated": True,
            "net_patched": True,
            "onnxruntime_imported": False,
        }
    report = json.loads((tmp_path / "r.json").read_text())
    net = report["classes"]["__main__:Net"]
    assert net["ort_calls"] == 8 and net["eager_calls"] == 0  # 256 / 32 batches, in the parent


def test_multiprocessing_pools(tmp_path: pathlib.Path) -> None:
    (tmp_path / "pools.py").write_text(
        NET
        + textwrap.dedent(
            """\
            if __name__ == "__main__":
                import multiprocessing as mp
                for method in ("spawn", "forkserver", "fork"):  # one worker: each imports torch
                    with mp.get_context(method).Pool(1) as pool:
                        print(method, sorted(set(pool.map(seen, range(2)))))
            """
        )
    )
    result = run([*LAUNCHER, "--modules", "__main__:Net", "pools.py"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert set(lines) == {"spawn", "forkserver", "fork"}
    for method, text in lines.items():
        answers = [json.loads(s) for s in eval(text)]  # a printed list of JSON strings
        assert answers, method
        for answer in answers:
            assert answer == {
                "activated": True,
                "modules": ["__main__:Net"],
                "net_patched": True,
                "onnxruntime_imported": False,
                "bootstrap_on_path": False,
            }, method


def test_subprocess_python_child(tmp_path: pathlib.Path) -> None:
    (tmp_path / "parent.py").write_text(
        NET
        + textwrap.dedent(
            """\
            import subprocess
            net = Net()
            net(torch.randn(2, 4)).backward()
            child = NET + "net = Net()\\nfor _ in range(5): net(torch.randn(2, 4)).backward()\\n"
            child += "print(seen())\\n"
            subprocess.run([sys.executable, "-c", child], check=True)
            """
        ).replace("NET", repr(NET))
    )
    result = run(
        [
            *LAUNCHER,
            "--modules",
            "__main__:Net",
            "--report",
            "r.json",
            "--skip-check",
            "SKIP_CHECK_DEVICE",
            "parent.py",
        ],
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    child = json.loads(result.stdout.splitlines()[-1])
    assert child == {
        "activated": True,
        "modules": ["__main__:Net"],
        "net_patched": True,
        "onnxruntime_imported": True,  # it called Net, through ORT
        "bootstrap_on_path": False,
    }
    # The child ran 5 ORT calls but the report is the parent's own (one report per rank).
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["classes"]["__main__:Net"]["ort_calls"] == 1


# -- the bootstrap sitecustomize -----------------------------------------------------------------

SHOW = (
    "import json, os, sys, ort_autopatch, sitecustomize; c = ort_autopatch.installed_config(); "
    "print(json.dumps([c is not None and list(c.modules), sitecustomize.__file__, "
    "any(p.endswith('bootstrap') for p in sys.path)]))"
)


def test_launcher_child_chains_to_the_users_sitecustomize(tmp_path: pathlib.Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("print('USER SITECUSTOMIZE')\n")
    (tmp_path / "parent.py").write_text(
        f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {SHOW!r}], check=True)\n"
    )
    env = {"PYTHONPATH": f"{user}{os.pathsep}{REPO}"}
    result = run([*LAUNCHER, "--modules", "pkg.mod:Net", "parent.py"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    # The launcher process got it from python itself; the child once, after our activation.
    lines = result.stdout.splitlines()
    assert lines[:2] == ["USER SITECUSTOMIZE", "USER SITECUSTOMIZE"]
    modules, site_file, bootstrap_on_path = json.loads(lines[2])
    assert modules == ["pkg.mod:Net"]
    assert site_file == str(user / "sitecustomize.py")
    assert not bootstrap_on_path


def _bootstrapped(extra: dict[str, str], code: str = SHOW) -> tuple[int, str, str]:
    env = {"PYTHONPATH": f"{BOOTSTRAP_DIR}{os.pathsep}{REPO}", **extra}
    result = run([PY, "-c", code], env=env)
    return result.returncode, result.stdout, result.stderr


def test_bootstrap_never_fails_the_child() -> None:
    rc, out, err = _bootstrapped(
        {"ORT_AUTOPATCH_MODULES": "a:B", "ORT_AUTOPATCH_OPSET": "1"}, "print('alive')"
    )
    assert (rc, out) == (0, "alive\n")
    assert "ERROR not activated" in err and "ORT_AUTOPATCH_OPSET='1'" in err


def test_bootstrap_survives_a_failing_user_sitecustomize(tmp_path: pathlib.Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("raise RuntimeError('user site broke')\n")
    env = {
        "PYTHONPATH": f"{BOOTSTRAP_DIR}{os.pathsep}{tmp_path}{os.pathsep}{REPO}",
        "ORT_AUTOPATCH_MODULES": "a:B",
    }
    result = run(
        [PY, "-c", "import ort_autopatch; print(ort_autopatch.installed_config() is not None)"],
        env=env,
    )
    assert (result.returncode, result.stdout) == (0, "True\n")
    assert "user site broke" in result.stderr


def test_bootstrap_activates_once_and_does_not_recurse() -> None:
    twice = {
        "PYTHONPATH": os.pathsep.join([BOOTSTRAP_DIR, BOOTSTRAP_DIR, str(REPO)]),
        "ORT_AUTOPATCH_MODULES": "a:B",
    }
    result = run([PY, "-c", SHOW], env=twice)
    assert result.returncode == 0, result.stderr
    modules, site_file, bootstrap_on_path = json.loads(result.stdout)
    assert modules == ["a:B"] and not bootstrap_on_path
    assert site_file == os.path.join(BOOTSTRAP_DIR, "sitecustomize.py")  # found no user one
    # A process started while activation runs (the marker is set) does not activate again.
    rc, out, _ = _bootstrapped(
        {"ORT_AUTOPATCH_MODULES": "a:B", "ORT_AUTOPATCH_BOOTSTRAP_ACTIVATING": "1"}
    )
    assert rc == 0 and json.loads(out)[0] is False


def test_bootstrap_respects_disabled() -> None:
    rc, out, err = _bootstrapped({"ORT_AUTOPATCH_MODULES": "a:B", "ORT_AUTOPATCH_ENABLED": "0"})
    assert rc == 0 and json.loads(out)[0] is False and err == ""


# -- sitecustomize_example/ ------------------------------------------------------------------------


def test_sitecustomize_example_activates_without_the_launcher(tmp_path: pathlib.Path) -> None:
    env = {
        "PYTHONPATH": f"{REPO / 'sitecustomize_example'}{os.pathsep}{REPO}",
        "ORT_AUTOPATCH_MODULES": "__main__:Net",
        "ORT_AUTOPATCH_REPORT": str(tmp_path / "r.json"),
    }
    result = run(
        [PY, str(REPO / "examples" / "train_mlp.py"), "--steps", "3"],
        env=env,
        cwd=tmp_path,
        timeout=90,
    )
    assert result.returncode == 0, result.stderr
    assert "train accuracy" in result.stdout
    net = json.loads((tmp_path / "r.json").read_text())["classes"]["__main__:Net"]
    assert net["ort_calls"] == 4 and net["eager_calls"] == 0  # 3 steps + 1 evaluation


def test_sitecustomize_example_is_inert_without_a_selection() -> None:
    env = {"PYTHONPATH": f"{REPO / 'sitecustomize_example'}{os.pathsep}{REPO}"}
    result = run([PY, "-c", "import sys; print('ort_autopatch' in sys.modules)"], env=env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "False\n", "")


def test_bootstrap_ships_in_the_wheel(tmp_path: pathlib.Path) -> None:
    import setuptools  # noqa: F401  (the tests session installs it: a missing one is a failure)

    # A copy without build/ and *.egg-info: setuptools reuses stale files from earlier builds.
    source = tmp_path / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            "build", "*.egg-info", ".*", "__pycache__", "tests", "benchmarks", "examples"
        ),
    )
    result = run(
        [
            PY,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        env={"PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        timeout=120,
    )
    assert result.returncode == 0, f"the wheel does not build: {result.stderr[-2000:]}"
    import zipfile

    (wheel,) = tmp_path.glob("ort_autopatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "ort_autopatch/bootstrap/sitecustomize.py" in names
    assert "ort_autopatch/__main__.py" in names
    assert not any(n.startswith(("sitecustomize", "tests/", "examples/")) for n in names)
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [
        line.removeprefix("Requires-Dist: ")
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    # The declared torch range is the tested one (ort_autopatch/versions.py), and TOML is
    # readable on Python 3.10.
    (torch_requirement,) = [r for r in requires if r.startswith("torch")]
    (major, first), (_, last) = versions.TESTED_TORCH[0], versions.TESTED_TORCH[-1]
    declared = sorted(torch_requirement.removeprefix("torch").split(","))
    assert declared == [f"<{major}.{last + 1}", f">={major}.{first}"]
    assert any(r.startswith("tomli") and 'python_version < "3.11"' in r for r in requires)
