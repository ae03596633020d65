"""Keep what torch's ONNX exporter prints from C++ off the user's stderr.

The TorchScript exporter writes some remarks straight to file descriptor 2 with `std::cerr`,
outside Python's warnings: "In-place op on output of tensor.shape" once per BatchNorm in
training mode (344 lines for torchvision's BatchNorm models). They are about the exporter's
work, not the user's code, so during an export fd 2 goes to a pipe; a thread passes every
other line on to the real stderr as it comes (the build's own progress messages, other
threads' output) and keeps the exporter's lines, which are logged at DEBUG once the export is
over (logging them from the thread would write them into the pipe again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

log = logging.getLogger("ort_autopatch")

#: Lines the exporter's C++ code prints on fd 2.
EXPORTER_LINES = re.compile(rb"^In-place op on output of tensor\.shape")
#: How long the end of an export waits for the forwarding thread to see the pipe close.
_JOIN_SECONDS = 2.0


@contextlib.contextmanager
def captured() -> Iterator[None]:
    """Send the exporter's fd-2 lines to the DEBUG log while the block runs (one block at a
    time: the caller holds the export lock)."""
    try:
        sys.stderr.flush()
        target = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no fd 2 (pythonw, closed stderr)
        yield
        return
    read_end, write_end = os.pipe()
    kept: list[bytes] = []
    forwarder = threading.Thread(
        target=_forward, args=(read_end, target, kept), name="ort_autopatch-exporter-output"
    )
    forwarder.daemon = True
    forwarder.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(target, 2)  # closes the pipe's last write end: the thread reads to its end
        forwarder.join(_JOIN_SECONDS)
        if not forwarder.is_alive():
            os.close(target)
        # else a process forked meanwhile still holds the pipe: the thread keeps passing its
        # output on to `target`, which therefore stays open.
        for line in kept:
            log.debug("torch's ONNX exporter: %s", line.decode(errors="replace").rstrip())


def _forward(read_end: int, target: int, kept: list[bytes]) -> None:
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                _route(line + b"\n", target, kept)
        if pending:
            _route(pending, target, kept)


def _route(line: bytes, target: int, kept: list[bytes]) -> None:
    if EXPORTER_LINES.match(line):
        kept.append(line)
        return
    with contextlib.suppress(OSError):
        os.write(target, line)
