"""A bounded LRU of built graphs that builds each key once, even under concurrent misses."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from ort_autopatch.engine.errors import BuildingAside

V = TypeVar("V")


class _Failed:
    """A remembered build failure: the same key is not rebuilt on every call."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        # Tracebacks hold the frames of the failed build, and with them the module: a
        # remembered failure must not keep a model alive.
        seen: set[int] = set()
        pending: list[BaseException | None] = [error]
        while pending:
            link = pending.pop()
            if link is None or id(link) in seen:
                continue  # chains can loop (a context that is also a cause)
            seen.add(id(link))
            link.__traceback__ = None
            pending += [link.__cause__, link.__context__]
        self.error = error


class GraphCache(Generic[V]):
    def __init__(self, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, V | _Failed] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[Hashable, threading.Lock] = {}
        # failures remembered for good, beyond the LRU: a rebuild would cost as much again
        self._refused: dict[Hashable, _Failed] = {}
        self.builds = 0
        self.evictions = 0

    def __len__(self) -> int:
        return sum(1 for v in self._entries.values() if not isinstance(v, _Failed))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def holds(self, key: Hashable) -> bool:
        """Whether `key` has an entry (or a remembered failure), without touching the LRU."""
        return key in self._entries or key in self._refused

    def get(self, key: Hashable) -> V | None:
        """A hit, or None; a remembered failure is raised again."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                value = self._refused.get(key)
                if value is None:
                    return None
            else:
                self._entries.move_to_end(key)
        if isinstance(value, _Failed):
            raise value.error
        return value

    def get_or_build(self, key: Hashable, build: Callable[[], V]) -> V:
        """The entry for `key`, building it at most once; a failed build is remembered."""
        value = self.get(key)
        if value is not None:
            return value
        with self._lock:
            gate = self._building.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                value_or_failure = self._entries.get(key)
            if isinstance(value_or_failure, _Failed):
                raise value_or_failure.error
            if value_or_failure is not None:
                return value_or_failure
            try:
                value = build()
            except BuildingAside:  # built elsewhere meanwhile: nothing to remember
                raise
            except Exception as exc:
                self._store(key, _Failed(exc))
                raise
            finally:
                with self._lock:
                    self._building.pop(key, None)
            self._store(key, value)
            self.builds += 1
            return value

    def fail(self, key: Hashable, error: BaseException) -> None:
        """Remember `key` as failed: its next lookups raise `error` again."""
        self._store(key, _Failed(error))

    @property
    def refusals(self) -> int:
        return len(self._refused)

    def refuse(self, key: Hashable, error: BaseException) -> None:
        """Remember `key` as failed for good: no eviction, no `clear()`, forgets it."""
        with self._lock:
            self._refused[key] = _Failed(error)

    def rekey(self, old: Hashable, new: Hashable) -> None:
        """File an entry under a more specific key (a graph that turned out shape-specific)."""
        with self._lock:
            if old in self._entries:
                self._entries[new] = self._entries.pop(old)

    def _store(self, key: Hashable, value: V | _Failed) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.evictions += 1
