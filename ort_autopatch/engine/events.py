"""What the engine tells its caller as it happens: the graphs it builds, the hazards its traces
find and what `--verify` measures.

A caller that counts these (the patcher, into the report's per-class counters) is told by the
engine instead of reading the engine's lists after every call and comparing their lengths, which
cost every call, cache hits included, for what happens only on a miss. Each event arrives once,
on the thread of the call that caused it, before that call returns.

At the bottom of the engine: it imports nothing at run time (the types it names only for type
checkers), so any engine module can tell a listener.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ort_autopatch.engine.hazards import Hazard
    from ort_autopatch.engine.recipe import BuildRecord
    from ort_autopatch.engine.verify import Verification


class BuildListener(Protocol):
    """Told of what one module instance's engine builds and checks (`ModuleEngine(listener=)`)."""

    def built(self, record: BuildRecord) -> None:
        """A graph was built, or loaded from the persistent cache: why, and what it cost."""

    def found(self, hazard: Hazard) -> None:
        """A trace froze something (a value from data or from sizes); each hazard once."""

    def verified(self, verification: Verification) -> None:
        """`--verify` ran a call through a graph and eagerly, or says why it could not."""


class Unheard:
    """The listener of an engine nobody listens to."""

    def built(self, record: BuildRecord) -> None:
        pass

    def found(self, hazard: Hazard) -> None:
        pass

    def verified(self, verification: Verification) -> None:
        pass
