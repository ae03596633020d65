"""Development sessions (`nox -s NAME`; `nox` alone runs `tests`).

- `demo`: examples/train_mlp.py through the launcher, with its summary (plain backend).
- `tests`: the test suite on the training build and torch 2.13; it then runs
  `tests_transformers5`, `tests_plain`, `tests_torch214`, `tests_plain_torch214` and
  `tests_torch215`.
- `tests_fast`: the quick loop for every change, the tests marked `fast` (under 3 minutes).
- `tests_transformers5`: the transformers-dependent tests against transformers 5.x.
- `tests_plain`: the whole suite on the plain backend and the latest (inference-only)
  onnxruntime.
- `tests_torch214`: what can differ between torch releases (export, parity, torchvision's
  models) on torch 2.14.1 with torchvision 0.29.1; `tests_plain_torch214` torchvision's models
  and the symbolics on plain.
- `tests_torch215`: what can differ on torch 2.15.0 (export, parity, every zoo entry) on the
  plain backend (a download of about 3 GB; `tests` runs it).
- `lint`: ruff, ruff format, mypy and the README's generated tables (options, benchmarks).
- `bench`: every benchmark; results in benchmarks/results/*.json. It then runs `bench_plain`.
- `bench_plain`: the engine benchmark on the plain backend (latest onnxruntime), plain.json;
  README's engine table, both backends side by side.
- `bench_scale`, `bench_scale_plain`: BERT-base, GPT-2 small and ResNet-50 against eager and
  torch.compile (torch 2.14), one backend each (`bench` and `bench_plain` run them);
  scale_<backend>.json and README's table of both.
- `zoo`: every zoo model against eager; benchmarks/results/zoo.json and README's zoo table.
- `soak`: every reliability scenario, the 2000-step soak included; README's reliability table.

The plain backend's sessions (`demo`, `tests_plain`, `tests_plain_torch214`, `tests_torch215`,
`bench_plain`, `bench_scale_plain`) and `lint` run on the interpreter nox runs on, any CPython
3.10 or newer. The training build's sessions (all others) need CPython 3.8-3.11
(onnxruntime-training 1.19.2 has no other wheels): they run on a `python3.11` found on PATH,
else on nox's own interpreter if it is 3.10 or 3.11, and elsewhere they are skipped, saying so
there and in nox's closing summary.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]


def _training_python() -> str | bool | None:
    """The interpreter of the training build's sessions: "3.11" where a python3.11 runs, None
    (nox's own) where that is CPython 3.10 or 3.11, False (no venv: the session skips) else."""
    try:
        found = subprocess.run(["python3.11", "-c", ""], capture_output=True, timeout=60)
        if found.returncode == 0:  # a pyenv shim without that version exits non-zero
            return "3.11"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None if sys.version_info[:2] in ((3, 10), (3, 11)) else False


TRAINING_PYTHON = _training_python()
PLAIN_PYTHON = None  # the interpreter at hand: the plain backend takes any CPython >= 3.10
TRAINING_WHEELS = "needs CPython 3.8-3.11 (onnxruntime-training 1.19.2 has no other wheels)"
TRAINING_SKIP = (
    f"the training build {TRAINING_WHEELS} and this machine has no python3.11 (nox runs on "
    f"{sys.version.split()[0]}); the plain backend's sessions run on it"
)
# torch 2.13.0's CPU build lies on this kind of machine's disk, and so do torch 2.14.1 and the
# torchvision built for it (5.8 GB, about 5 minutes to install); any other version (or an
# unpinned torch) downloads a multi-GB CUDA build. The tested range is 2.13 to 2.15
# (ort_autopatch/versions.py): CI runs the suite on 2.13 and what can differ on 2.14 and 2.15.
TORCH = "torch==2.13.0"
TORCH_214 = ("torch==2.14.1", "torchvision==0.29.1")
# No torchvision is built for torch 2.15 (0.29.x is 2.14's): torchvision's models run on 2.14.
TORCH_215 = ("torch==2.15.0",)
TRANSFORMERS = "transformers==4.57.6"
TRANSFORMERS5 = "transformers==5.23.0"
ACCELERATE = "accelerate==1.15.0"  # transformers' Trainer needs it (examples/hf_trainer.py)
# tests/test_libraries.py and the examples: neither pulls another torch (pip --dry-run)
LIGHTNING = "lightning==2.6.6"
PEFT = "peft==0.21.2"


#: Set by .ci/run: each session CI runs removes its venv when it ends. Their venvs together
#: take 22 GB (torch 2.14's CUDA build twice, 2.15's once, four of 1.3 GB): more than a CI
#: machine's disk may have free, where one at a time fits.
DROP_VENVS = os.environ.get("CI_DROP_VENVS") == "1"


def _ci_session(python: str | bool | None) -> Callable[[Callable[[nox.Session], None]], object]:
    """`nox.session` for a session CI runs: its venv is removed when it ends (`DROP_VENVS`)."""

    def decorate(func: Callable[[nox.Session], None]) -> object:
        @functools.wraps(func)
        def run(session: nox.Session) -> None:
            try:
                func(session)
            finally:
                location = getattr(session.virtualenv, "location", None)
                if DROP_VENVS and location and os.path.isdir(location):
                    shutil.rmtree(location, ignore_errors=True)

        return nox.session(python=python)(run)

    return decorate


def _install(session: nox.Session, *extra: str, torch: tuple[str, ...] = (TORCH,)) -> None:
    """The training build's environment (`ort-training`), where most sessions run; skips the
    session where no Python can install it (TRAINING_SKIP), saying so."""
    if TRAINING_PYTHON is False:
        session.skip(TRAINING_SKIP)
    # run_install: what --install-only runs too (plain run() returns None there)
    code = "import sys; print(*sys.version_info[:2], sep='.')"
    version = str(session.run_install("python", "-c", code, silent=True)).strip()
    if version not in ("3.8", "3.9", "3.10", "3.11"):  # nox --force-python 3.12, say
        session.skip(f"the training build {TRAINING_WHEELS}; this session's Python is {version}")
    session.install(*torch)
    session.install("-e", ".[training-cpu]", *extra)


def _install_plain(session: nox.Session, *extra: str, torch: tuple[str, ...] = (TORCH,)) -> None:
    """The plain backend's environment (`ort`, the maintained onnxruntime), on any Python."""
    # A venv made before a session moved to the plain backend may hold the training build: both
    # install the `onnxruntime` package, so it goes first (pip says nothing when it is absent).
    drop = ("onnxruntime-training-cpu", "onnxruntime-training")
    session.run_install("python", "-m", "pip", "uninstall", "-q", "-y", *drop, silent=True)
    session.install(*torch)
    session.install("-e", ".[cpu]", *extra)


# setuptools: test_processes builds the wheel without build isolation.
TEST_DEPS = (
    "pytest",
    "pytest-timeout",
    "setuptools",
    TRANSFORMERS,
    ACCELERATE,
    LIGHTNING,
    PEFT,
    "numpy",
)


@_ci_session(TRAINING_PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite (CPU, onnxruntime-training-cpu); prints its slowest tests and its time.
    Then the other sessions CI runs, the plain backend's too where the training build's skip."""
    if not session.posargs:  # before _install: they run even where the training build skips
        session.notify("tests_transformers5")
        session.notify("tests_plain")
        session.notify("tests_torch214")
        session.notify("tests_plain_torch214")
        session.notify("tests_torch215")
    _install(session, *TEST_DEPS)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--durations=25", *session.posargs)


@nox.session(python=TRAINING_PYTHON)
def tests_fast(session: nox.Session) -> None:
    """The quick loop for every change (under 3 minutes on 2 cores): tests marked `fast`."""
    _install(session, *TEST_DEPS)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "-m", "fast", *session.posargs)


# The tests that touch transformers, again with its current major version: transformers 5
# imports modules the pinned 4.x does not (torchrun's elastic agent, in every process).
# Only the tests that import transformers: the rest of their files cannot differ here.
# (test_tracing.py is left out: it checks a rewrite of a 4.x private function 5.x removed.)
TRANSFORMERS_TESTS = (
    "tests/test_run_report.py::test_the_report_is_written_with_transformers_accelerate_and_lightning_imported",
    "tests/test_engine_parity.py::test_bert_for_sequence_classification_parity",
    "tests/test_examples.py::test_hf_trainer_example",
)


@_ci_session(TRAINING_PYTHON)
def tests_transformers5(session: nox.Session) -> None:
    """The transformers-dependent tests against transformers 5.x (`nox -s tests` runs it)."""
    _install(session, "pytest", "pytest-timeout", TRANSFORMERS5, ACCELERATE, LIGHTNING, "numpy")
    session.run("pytest", "-q", "-p", "no:cacheprovider", *TRANSFORMERS_TESTS, *session.posargs)


# The whole suite again on the plain backend (inference-only onnxruntime, graphs from torch's
# autograd), in an environment with the maintained onnxruntime and no training build: the two
# packages cannot share one. Tests that only make sense on one backend skip with the reason.
# The zoo's fast entries run here, as in `nox -s tests`; every entry runs on the plain backend
# in `tests_torch215`, the torch users who install today get. Once on each torch was 4 minutes
# of CI's 47 (245 s for the whole zoo against about 70 s for the fast entries, 2 cores).


@_ci_session(PLAIN_PYTHON)
def tests_plain(session: nox.Session) -> None:
    """The whole suite on the plain backend and the latest onnxruntime (`nox -s tests` runs
    it)."""
    _install_plain(session, *TEST_DEPS)
    args = ("-q", "-p", "no:cacheprovider", "--durations=15")
    session.run("pytest", *args, *session.posargs)


# What can differ between torch releases: the export (the TorchScript exporter's internals,
# symbolics, trace hazards), numbers against eager, and torchvision's models (torch 2.13's CPU
# wheel and PyPI's torchvision do not import together, so they run here only). Sized for CI's
# budget: about 10 minutes with the install.
TORCH_VERSION_TESTS = (
    "tests/test_engine_parity.py",
    "tests/test_symbolics.py",
    "tests/test_torchvision_models.py",
)
#: On the plain backend the parity tests run on torch 2.13 (`tests_plain`) and 2.15
#: (`tests_torch215`); on 2.14 only what no other plain session can import, and the symbolics.
PLAIN_TORCH_214_TESTS = ("tests/test_symbolics.py", "tests/test_torchvision_models.py")


@_ci_session(TRAINING_PYTHON)
def tests_torch214(session: nox.Session) -> None:
    """The tests torch 2.14 can change, and torchvision's models (`nox -s tests` runs it)."""
    _install(session, "pytest", "pytest-timeout", TRANSFORMERS, "numpy", torch=TORCH_214)
    args = ("-q", "-p", "no:cacheprovider", "--durations=12", *TORCH_VERSION_TESTS)
    session.run("pytest", *args, *session.posargs)


@_ci_session(PLAIN_PYTHON)
def tests_plain_torch214(session: nox.Session) -> None:
    """torchvision's models, which no other plain session can import, and the symbolics, on
    the plain backend (`nox -s tests` runs it)."""
    _install_plain(session, "pytest", "pytest-timeout", TRANSFORMERS, "numpy", torch=TORCH_214)
    args = ("-q", "-p", "no:cacheprovider", "--durations=12", *PLAIN_TORCH_214_TESTS)
    session.run("pytest", *args, *session.posargs)


# What can differ on torch 2.15, on the plain backend (the product; the training build has no
# wheel for the Pythons after 3.11): aot_autograd's trace and the decompositions (the plain
# backend's export), its graph rewrites (FX and ONNX: they match the graphs torch makes), the
# lowering, the TorchScript exporter's symbolics, trace hazards and output, parity against
# eager, version checks, the eager and lowering children (a CUDA build's autograd and fork;
# which first trace a misread table makes), and the whole zoo (9 to 12 minutes with three
# other jobs on the 2 cores, after a 3-minute install). No torchvision exists for 2.15: its
# models stay on 2.14.
TORCH_215_TESTS = (
    "tests/test_engine_parity.py",
    "tests/test_plain_decompositions.py",
    "tests/test_plain_norms.py",
    "tests/test_plain_convolutions.py",
    "tests/test_plain_linears.py",
    "tests/test_plain_matmuls.py",
    "tests/test_plain_activations.py",
    "tests/test_plain_losses.py",
    "tests/test_plain_backend.py",
    "tests/test_plain_eager_child.py",
    "tests/test_plain_offload.py",
    "tests/test_onnx_passes.py",
    "tests/test_stages.py",
    "tests/test_plain_lowering.py",
    "tests/test_plain_dynamic_shapes.py",
    "tests/test_symbolics.py",
    "tests/test_hazards.py",
    "tests/test_quiet_export.py",
    "tests/test_versions.py",
    "tests/zoo",
)


@_ci_session(PLAIN_PYTHON)
def tests_torch215(session: nox.Session) -> None:
    """What torch 2.15.0 can change, on the plain backend, every zoo entry (`nox -s tests`
    runs it; torch's PyPI wheel and its CUDA libraries: about 3 GB the first time)."""
    _install_plain(session, "pytest", "pytest-timeout", TRANSFORMERS, "numpy", torch=TORCH_215)
    args = ("-q", "-p", "no:cacheprovider", "--durations=12", *TORCH_215_TESTS)
    session.run("pytest", *args, *session.posargs, env={"ZOO_MODELS": "all"})


@_ci_session(PLAIN_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff and mypy over the package; the README's generated option and benchmark tables.
    On the plain backend's environment: none of it needs the training build (mypy finds no
    issue either way), so it runs on any Python."""
    _install_plain(session, "ruff", "mypy")
    checked = ("ort_autopatch", "tests", "benchmarks", "examples", "tools", "noxfile.py")
    session.run("ruff", "check", *checked)
    session.run("ruff", "format", "--check", "ort_autopatch", "tools", "noxfile.py")
    session.run("mypy")
    session.run("python", "tools/readme_options.py", "--check")
    # the README's benchmark tables are those of the committed results
    session.run("python", "benchmarks/render_engine.py", "--check")
    session.run("python", "benchmarks/render_scale.py", "--check")
    session.run("python", "benchmarks/render_zoo.py", "--check")


@nox.session(python=PLAIN_PYTHON)
def demo(session: nox.Session) -> None:
    """Run an unchanged training script through the launcher on the plain backend (any Python
    3.10 or newer); the summary says what ran in ORT."""
    _install_plain(session)
    session.run(
        "python",
        "-m",
        "ort_autopatch",
        "--modules",
        "__main__:Net",
        "--report",
        "-",
        # its 30 short steps end before a helper process would have built the graph (the
        # default for a real run): the demo's first call waits for it, and every call shows
        # in ONNX Runtime
        "--foreground-builds",
        "examples/train_mlp.py",
        *session.posargs,
    )


def _compile_bytecode(session: nox.Session) -> None:
    """The package's bytecode, as `pip install` writes it: an editable install has none, and
    with PYTHONDONTWRITEBYTECODE set (as on these VMs) every fresh process of a first-call
    measurement would compile the modules the first call imports from source (about 7 ms)."""
    session.run("python", "-m", "compileall", "-q", "ort_autopatch")


@nox.session(python=TRAINING_PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks; results land in benchmarks/results/*.json."""
    # pytest: bench_export_paths.py reads the input-variety suite's models, then the zoo runs
    _install(session, "psutil", "pytest", "matplotlib", TRANSFORMERS)
    _compile_bytecode(session)
    session.run("python", "benchmarks/bench_engine.py", *session.posargs)
    session.run("python", "benchmarks/bench_profile.py")
    session.run("python", "benchmarks/bench_import_hook.py")
    session.run("python", "benchmarks/bench_launcher.py")
    session.run("python", "benchmarks/bench_dispatch.py")
    session.run("python", "benchmarks/bench_export_paths.py")
    session.run("python", "benchmarks/bench_cache.py")  # warm first call: median of 7
    session.run("python", "benchmarks/bench_loops.py", "--backend", "ort-training")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/zoo", env=ZOO_ENV)
    session.run("python", "benchmarks/render_engine.py")
    session.run("python", "benchmarks/render_zoo.py")
    session.run("python", "benchmarks/render_report.py")
    session.notify("bench_plain")  # renders README's engine table again, with its numbers
    session.notify("bench_scale")


@nox.session(python=PLAIN_PYTHON)
def bench_plain(session: nox.Session) -> None:
    """The engine benchmark on the plain backend (`nox -s bench` runs it): the training
    build's models, the CNN among them, in the plain backend's environment (the two builds
    cannot share one); README's engine table then shows both backends."""
    _install_plain(session, "psutil")
    _compile_bytecode(session)
    session.run("python", "benchmarks/bench_plain.py", *session.posargs)
    session.run("python", "benchmarks/bench_cache.py", "--backend", "ort")
    session.run("python", "benchmarks/bench_loops.py", "--backend", "ort")
    session.run("python", "benchmarks/render_engine.py")
    session.notify("bench_scale_plain")


@nox.session(python=TRAINING_PYTHON)
def bench_scale(session: nox.Session) -> None:
    """BERT-base, GPT-2 small and ResNet-50 against eager and torch.compile on the training
    build (`nox -s bench` runs it): torch 2.14, the one torch torchvision's wheel imports
    with. Options after `--` go to bench_scale.py (`--batch 2,8 --threads 1,2`)."""
    _install(session, TRANSFORMERS, torch=TORCH_214)
    _compile_bytecode(session)
    session.run(
        "python", "benchmarks/bench_scale.py", "--backend", "ort-training", *session.posargs
    )


@nox.session(python=PLAIN_PYTHON)
def bench_scale_plain(session: nox.Session) -> None:
    """The same on the plain backend (`nox -s bench_plain` runs it), then README's table of
    both backends (`benchmarks/render_scale.py`)."""
    _install_plain(session, TRANSFORMERS, torch=TORCH_214)
    _compile_bytecode(session)
    session.run("python", "benchmarks/bench_scale.py", "--backend", "ort", *session.posargs)
    session.run("python", "benchmarks/render_scale.py")


# The whole zoo, timed with one thread on each side: tiny models measure per-operator overhead,
# and OMP_WAIT_POLICY=PASSIVE with 2 threads makes eager steps 10x slower on these VMs.
ZOO_ENV = {
    "ZOO_MODELS": "all",
    "ZOO_TIMING_STEPS": "20",
    "ZOO_RESULTS": "benchmarks/results/zoo.json",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
}


@nox.session(python=TRAINING_PYTHON)
def zoo(session: nox.Session) -> None:
    """Every zoo model against eager; writes benchmarks/results/zoo.json and README's table."""
    _install(session, "pytest", "pytest-timeout", TRANSFORMERS, "numpy")
    session.run(
        "pytest", "-q", "-p", "no:cacheprovider", "tests/zoo", *session.posargs, env=ZOO_ENV
    )
    session.run("python", "benchmarks/render_zoo.py")


@nox.session(python=TRAINING_PYTHON)
def soak(session: nox.Session) -> None:
    """Every reliability scenario, the 2000-step soak included; rewrites README's table."""
    _install(session, "pytest", "pytest-timeout", "numpy")
    results = "benchmarks/results/reliability.json"
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "soak or not soak",
        "tests/reliability",
        *session.posargs,
        env={"ORT_AUTOPATCH_RELIABILITY_RESULTS": results, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    session.run("python", "benchmarks/render_reliability.py", results)
