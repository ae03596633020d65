"""Activation shared by the launcher and the child-process bootstrap.

Both do the same three things in a process, once: install the patching from a Config, set up the
tool's log output, and register the exit report. The launcher's process tree owns its output: the
records go to stderr (rank 0 only, errors only on other ranks) and not to the script's own logging
setup. Activated from inside a script (`import ort_autopatch.auto`), the tool behaves as a library:
only the level of the `ort_autopatch` logger is set (from ORT_AUTOPATCH_LOG_LEVEL), its records
propagate to the script's handlers (or to Python's last-resort handler, warnings and up).

Which process reports is decided here so that a run writes one report per rank, never one per
worker: a process reports when no ancestor already reports for the same rank (the ancestor's
RANK travels in `ORT_AUTOPATCH_REPORTER_RANK`), when it is not a multiprocessing helper (spawn
workers, forkserver, resource tracker) and, at exit, when it is not torchrun's agent (its ranks
report).
Nothing here imports torch or onnxruntime.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any

from ort_autopatch import (
    feedback,
    install,
    named_outright,
    refused_reason,
    unmatched_patterns,
)
from ort_autopatch import report as _report
from ort_autopatch.config import Config, load_config
from ort_autopatch.errors import OrtAutopatchError

__all__ = [
    "ENV_REPORTER",
    "activate",
    "activate_from_environment",
    "current_rank",
    "is_multiprocessing_helper",
]

#: RANK ("" without one) of the nearest process that reports; its children with the same rank
#: (DataLoader workers, subprocess calls) leave the report to it.
ENV_REPORTER = "ORT_AUTOPATCH_REPORTER_RANK"

_log = logging.getLogger("ort_autopatch")
_lock = threading.Lock()
_activated = False
# What torchrun's agent runs to start its ranks. Not the elastic agent's own modules:
# transformers 5 (through accelerate) imports those in every process.
_LAUNCHER_MODULE = "torch.distributed.launcher.api"
_RUN_MODULE = "torch.distributed.run"


def current_rank() -> int | None:
    """This process's distributed rank from `RANK` (torchrun sets it), None without one."""
    raw = os.environ.get("RANK", "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def is_torchrun_agent() -> bool:
    """Whether this process is torchrun's agent (`torchrun` or `python -m
    torch.distributed.run`), which starts the ranks and owes no report of its own."""
    if _LAUNCHER_MODULE in sys.modules:
        return True  # elastic_launch ran (or is about to): this process launches ranks
    run = sys.modules.get(_RUN_MODULE)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return run is not None and (
        getattr(spec, "name", None) == _RUN_MODULE or getattr(main, "main", None) is run.main
    )


#: Command lines that only start the user's script in a child of their own (which reports):
#: `accelerate launch` (its single-process launcher runs `python script.py` with no rank).
_LAUNCHER_COMMANDS = {
    ("accelerate", "launch"),
    ("accelerate-launch",),
    ("-m", "accelerate.commands.launch"),
    ("-m", "accelerate.commands.accelerate_cli", "launch"),
}
#: Interpreter options that take a value (`python -W error -m x`).
_VALUED_OPTIONS = {"-W", "-X", "-Q"}


def is_launcher_command() -> bool:
    """Whether this interpreter runs a launcher's command line (`accelerate launch`), read from
    argv, as sitecustomize can before the launcher's code is imported."""
    argv = list(getattr(sys, "orig_argv", sys.argv))[1:]
    while argv and argv[0].startswith("-") and argv[0] != "-m":
        if argv[0] == "-c":
            return False
        argv = argv[2:] if argv[0] in _VALUED_OPTIONS else argv[1:]
    if argv and argv[0] != "-m":
        argv[0] = os.path.basename(argv[0])
    return any(tuple(argv[: len(command)]) == command for command in _LAUNCHER_COMMANDS)


def is_multiprocessing_helper() -> bool:
    """Whether multiprocessing started this interpreter (spawn child, forkserver, tracker)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return any(arg == "--multiprocessing-fork" or "from multiprocessing." in arg for arg in argv)


def activate(config: Config, own_output: bool = False) -> bool:
    """Install from `config` in this process (once) and arrange the exit report.

    `own_output`: the launcher's process tree, whose log records go to stderr through our own
    handler; otherwise records propagate as a library's do. Returns whether this call installed
    anything; a disabled config installs nothing, logs nothing and reports nothing.
    """
    global _activated
    with _lock:
        if _activated:
            return False
        _activated = True
    if not config.enabled:
        return False
    rank = current_rank()
    installed = install(config)
    _configure_logging(config.log_level, rank, own_output)
    # A run the tool refused (an untested torch, no ONNX Runtime) still owes the report that
    # was asked for, saying why nothing was accelerated.
    owes = installed or (refused_reason() is not None and _wants_output(config))
    if owes and _claims_report(rank):
        # Import now what writing needs: an import while the interpreter finalizes resets its
        # "KeyboardInterrupt went unhandled" flag, and ^C would then exit 1 instead of by SIGINT.
        _report.prepare()
        atexit.register(_at_exit, config, os.getpid(), rank)
    return installed


def activate_from_environment(strict: bool, own_output: bool = False) -> bool:
    """`activate(load_config())`: the one rule every entry point follows.

    `strict` (`import ort_autopatch.auto`, inside the user's own script): a bad setting raises
    its `ConfigError`. Otherwise (sitecustomize files, which run in every Python): one error line
    on stderr and the process runs without the tool. `own_output`: see `activate`.
    """
    try:
        return activate(load_config(), own_output=own_output)
    except OrtAutopatchError as exc:
        if strict:
            raise
        sys.stderr.write(
            f"[ort_autopatch] ERROR not activated in {sys.executable} (pid {os.getpid()}), which "
            f"runs without the tool: {exc}\n"
        )
        return False


def _wants_output(config: Config) -> bool:
    return bool(config.report) or logging.getLevelName(config.log_level) <= logging.INFO


def _claims_report(rank: int | None) -> bool:
    if is_multiprocessing_helper() or is_launcher_command():
        return False
    mine = "" if rank is None else str(rank)
    if os.environ.get(ENV_REPORTER) == mine:
        return False  # a parent with the same rank reports for this process too
    os.environ[ENV_REPORTER] = mine
    return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (scripts and tests redirect it)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> object:
        return sys.stderr


def _configure_logging(level: str, rank: int | None, own_output: bool) -> None:
    logger = logging.getLogger("ort_autopatch")
    if not own_output:
        logger.setLevel(level)
        return
    # Ranks other than 0 keep errors only: N copies of every warning drown a distributed log.
    logger.setLevel(level if not rank else max(logging.getLevelName(level), logging.ERROR))
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[ort_autopatch] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        # Our records go to stderr once, whatever logging setup the user's script makes.
        logger.propagate = False


def _at_exit(config: Config, pid: int, rank: int | None) -> None:
    try:
        if os.getpid() != pid:
            return  # an os.fork()ed child running the parent's atexit handlers
        if rank is None and is_torchrun_agent():
            return  # torchrun's agent: its ranks write their own reports
        finish_report(config, rank)
    except Exception:
        _log.error("ort_autopatch could not write its report", exc_info=True)


def tell_selection(data: dict[str, Any], selected: bool) -> None:
    """One warning per pattern that matched no class (with close names), and one line when
    nothing ran in ONNX Runtime: a typo must not pass as a plain, unaccelerated run."""
    candidates: list[str] | None = None
    for pattern in data["unmatched"]:
        if candidates is None:
            candidates = feedback.imported_classes()
        _log.warning("%s", feedback.unmatched_message(pattern, candidates))
    line = feedback.nothing_ran(data["classes"], selected, data.get("uncalled_classes", 0))
    if line is not None:
        _log.warning("%s", line)


def finish_report(config: Config, rank: int | None) -> None:
    """Say what the selection did, and write the JSON report and/or the text summary this
    process owes (rank rules apply)."""
    data = _report.build(unmatched_patterns(), refused=refused_reason(), named=named_outright)
    if not rank and data["refused"] is None:  # a refusal was said when it happened
        tell_selection(data, selected=bool(config.modules))
    target = config.report
    if target and target != "-":
        path = _report.report_path(target, rank)
        if path is not None:
            _report.write(path, data)
            if not rank:
                _log.info("report written to %s", path)
    wants_summary = target == "-" or logging.getLevelName(config.log_level) <= logging.INFO
    if wants_summary and not rank:
        sys.stderr.write(_report.summary(data) + "\n")
        sys.stderr.flush()
