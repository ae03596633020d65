"""Writing a file so that no reader ever sees half of it.

The data goes to a temporary file in the target's folder, which is then renamed over the target
(`os.replace` is atomic on POSIX and Windows within one file system). Concurrent writers (DDP
ranks writing one cache entry or one report) each rename a complete file; the last one wins.
Imports nothing from the package, so the engine and the report can share it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def write_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` in one step; the folder must exist."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
