"""A persistent graph cache on disk, so a second run of a script skips export and gradient build.

Layout under the cache folder (created 0700):

    <static key>/paths.json             attribute paths whose values join the key (union)
    <static key>/<full key>.json        the recipe: feeds, outputs, gradient info (JSON)
    <static key>/<full key>.<part>.onnx the graphs: the export after the passes, the gradient
                                        graph, and ORT's optimised form of the one that runs
    derived/<key>.json, <key>.*.onnx    what a backend derives from a stored graph (facts read
                                        from its ONNX, a rewritten form), keyed by its digest

The static key covers what decides a graph apart from attribute values (class sources, state
names/shapes/dtypes, input signature, mode, opset, pass version, torch/ORT versions); the full
key adds the values of the attributes forward read. Only ONNX bytes and JSON are ever read back
(never pickle); every file is written to a temporary name and renamed, so readers never see half
a file and concurrent writers (DDP ranks) cannot corrupt each other. A corrupt, truncated or
foreign entry is reported once and rebuilt. The folder is bounded by size, least recently used
entries going first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ort_autopatch.files import write_atomically

log = logging.getLogger("ort_autopatch")

FORMAT = 1
DEFAULT_MAX_BYTES = 2 * 1024**3
#: the folder of what a backend derives from stored graphs (read back like entries, under
#: keys of its own; not an entry: `clear` removes it without counting it)
DERIVED = "derived"


def digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class StoredEntry:
    meta: dict[str, Any]
    graphs: dict[str, bytes]  # part name -> ONNX bytes


class GraphStore:
    """Reads and writes entries; any problem disables it or skips the entry, never the call."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.usable = self._prepare()
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    # -- folder safety -----------------------------------------------------------------------
    def _prepare(self) -> bool:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = self.root.stat()
        except OSError as exc:
            log.warning(
                "ort_autopatch: graph cache %s unusable (%s); running without it", self.root, exc
            )
            return False
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            log.warning(
                "ort_autopatch: graph cache %s belongs to another user; running without it "
                "(choose a folder of your own with ORT_AUTOPATCH_CACHE_DIR)",
                self.root,
            )
            return False
        if info.st_mode & stat.S_IWOTH:
            log.warning(
                "ort_autopatch: graph cache %s is world-writable; running without it "
                "(chmod 700 it or choose another folder)",
                self.root,
            )
            return False
        return True

    # -- entries -----------------------------------------------------------------------------
    def paths(self, static_key: str) -> list[str]:
        data = self._read_json(self.root / static_key / "paths.json")
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            return []
        return data

    def load(self, static_key: str, key: str) -> StoredEntry | None:
        if not self.usable:
            return None
        folder = self.root / static_key
        meta_path = folder / f"{key}.json"
        if not meta_path.exists():
            return None
        meta = self._read_json(meta_path)
        try:
            if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("key") != key:
                raise ValueError("not an entry of this version")
            graphs = {}
            for part, checksum in dict(meta["graphs"]).items():
                data = (folder / f"{key}.{part}.onnx").read_bytes()
                if digest_bytes(data) != checksum:
                    raise ValueError(f"{part} graph checksum mismatch (truncated or modified)")
                graphs[str(part)] = data
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._warn_once(str(meta_path), f"ignoring cache entry {meta_path}: {exc}; rebuilding")
            return None
        try:
            os.utime(meta_path)  # recency for the LRU bound
        except OSError:
            pass
        return StoredEntry(meta, graphs)

    def save(
        self,
        static_key: str,
        key: str,
        meta: dict[str, Any],
        graphs: dict[str, bytes],
        paths: list[str],
    ) -> None:
        if not self.usable:
            return
        folder = self.root / static_key
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            meta = {
                **meta,
                "format": FORMAT,
                "key": key,
                "graphs": {part: digest_bytes(data) for part, data in graphs.items()},
            }
            for part, data in graphs.items():
                self._write(folder / f"{key}.{part}.onnx", data)
            # The sidecar last: an entry exists only once all its graphs are complete.
            self._write(folder / f"{key}.json", json.dumps(meta, sort_keys=True).encode())
            known = self.paths(static_key)
            union = known + [p for p in paths if p not in known]
            if union != known:
                self._write(folder / "paths.json", json.dumps(union).encode())
            self._evict()
        except OSError as exc:
            self._warn_once(str(self.root), f"cannot write the graph cache {self.root}: {exc}")

    def clear(self) -> int:
        """Remove every entry; returns how many entry folders went."""
        count = 0
        if not self.root.is_dir():
            return 0
        for child in self.root.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                count += child.name != DERIVED
        return count

    # -- helpers -----------------------------------------------------------------------------
    def _write(self, path: Path, data: bytes) -> None:
        write_atomically(path, data)

    def _read_json(self, path: Path) -> Any:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._warn_once(str(path), f"ignoring unreadable cache file {path}: {exc}")
            return None

    def _evict(self) -> None:
        """Drop least recently used entries while the folder is over its size bound."""
        with self._lock:
            entries = []
            total = 0
            for meta in self.root.glob("*/*.json"):
                if meta.name == "paths.json":
                    continue
                stem = meta.name[: -len(".json")]
                files = [meta, *meta.parent.glob(f"{stem}.*onnx")]
                try:
                    size = sum(f.stat().st_size for f in files)
                    used = meta.stat().st_mtime
                except OSError:
                    continue
                entries.append((used, size, files))
                total += size
            for _, size, files in sorted(entries, key=lambda e: e[0]):
                if total <= self.max_bytes:
                    break
                for f in files:
                    try:
                        f.unlink()
                    except OSError:
                        pass
                total -= size

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ort_autopatch: %s", message)


def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
