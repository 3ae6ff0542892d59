"""Which weight versions exist, in order, and which one every engine served in each rollout.

A version is *started* once the trainer has it: its weight session opened, or the trainer reported it
(``trainer.weights.started_version``: an async push's snapshot was taken, the push may come later). An
engine's *staleness* is how many started versions are newer than the one it serves. The rule that bounds
it is ``states.check_rollout_staleness``; this module only counts. The book lives in memory: a restarted
daemon starts counting from the versions it sees again (it never reports more staleness than it knows of).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["RolloutVersions", "VersionBook"]

_KEPT_VERSIONS = 256  # far more than any bound; older ones only ever count as "older than all kept"
_KEPT_ROLLOUTS = 32


@dataclass(frozen=True, slots=True)
class RolloutVersions:
    """What one rollout phase served: each engine's version and how far it lagged the latest started one."""

    step: int
    latest: str | None
    served: Mapping[str, str | None]
    staleness: Mapping[str, int]
    bound: int
    mode: str

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "latest_version": self.latest, "rollout_versions": dict(self.served),
                "staleness_versions": dict(self.staleness), "max_staleness_versions": self.bound, "mode": self.mode}


class VersionBook:
    """Started versions in order (oldest first), and the last rollouts' versions."""

    def __init__(self) -> None:
        self._order: deque[str] = deque(maxlen=_KEPT_VERSIONS)
        self.rollouts: deque[RolloutVersions] = deque(maxlen=_KEPT_ROLLOUTS)

    def started(self, version: str | None) -> None:
        """``version`` exists now (a repeat of a known version changes nothing)."""
        if version is not None and version not in self._order:
            self._order.append(version)

    @property
    def latest(self) -> str | None:
        return self._order[-1] if self._order else None

    def staleness(self, served: str | None) -> int:
        """Started versions newer than ``served``; one the book never saw is older than every kept one."""
        if served in self._order:
            return len(self._order) - 1 - list(self._order).index(served)  # type: ignore[arg-type]
        return len(self._order)

    def lags(self, served: Mapping[str, str | None]) -> dict[str, int]:
        return {name: self.staleness(version) for name, version in served.items()}

    def record(self, entry: RolloutVersions) -> None:
        self.rollouts.append(entry)

    def snapshot(self, bound: int, mode: str, served: Iterable[tuple[str, str | None]]) -> dict[str, Any]:
        """``/v1/status``'s ``versions``: the latest started version, each engine's lag now, the bound, and the
        last rollouts' versions (newest last)."""
        now = dict(served)
        return {"latest_started": self.latest, "mode": mode, "max_staleness_versions": bound,
                "staleness_versions": self.lags(now), "rollouts": [r.to_json() for r in self.rollouts]}
