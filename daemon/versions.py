"""Which weight versions exist, in order, and which one every engine served in each rollout.

A version counts once it *committed*, while an *open session* carries it (withdrawn if that session ends
without a commit), or once the trainer *reported* it (``trainer.weights.started_version``: an async push's
snapshot was taken). Re-committing a version that committed before (a rollback) makes it the latest again and
withdraws every version counted after it. An engine's *staleness* is how many counted versions are newer than
the one it serves (``states.check_rollout_staleness`` bounds it). The book lives in memory: a restarted daemon
counts from the versions it sees again, so it never reports more staleness than it knows of.
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
    """Counted versions in order (oldest first), why each counts, and the last rollouts' versions."""

    COMMITTED = "committed"
    REPORTED = "reported by the trainer, no session carries it yet"

    def __init__(self) -> None:
        self._order: deque[str] = deque(maxlen=_KEPT_VERSIONS)
        self._why: dict[str, str] = {}  # version → COMMITTED, REPORTED, or "session <id> open"
        self.rollouts: deque[RolloutVersions] = deque(maxlen=_KEPT_ROLLOUTS)

    def _add(self, version: str, why: str) -> None:
        if len(self._order) == self._order.maxlen:
            self._why.pop(self._order[0], None)
        self._order.append(version)
        self._why[version] = why

    def started(self, version: str | None) -> None:
        """The trainer reports it has ``version``; a known version changes nothing."""
        if version is not None and version not in self._why:
            self._add(version, self.REPORTED)

    def opened(self, version: str, session_id: str) -> None:
        """A committed version keeps its place and reason (a re-push); a reported one is now this session's."""
        why = self._why.get(version)
        if why is None:
            self._add(version, _session(session_id))
        elif why != self.COMMITTED:
            self._why[version] = _session(session_id)

    def committed(self, version: str) -> None:
        """A version that had committed before is a rollback: the versions counted after it are withdrawn."""
        if self._why.get(version) == self.COMMITTED:
            while self._order and self._order[-1] != version:
                self._why.pop(self._order.pop(), None)
        elif version not in self._why:
            self._add(version, self.COMMITTED)
        self._why[version] = self.COMMITTED

    def withdrawn(self, version: str, session_id: str) -> None:
        """``session_id`` ended without committing: its version no longer counts, unless it committed before."""
        if self._why.get(version) == _session(session_id):
            del self._why[version]
            self._order.remove(version)

    @property
    def latest(self) -> str | None:
        return self._order[-1] if self._order else None

    def staleness(self, served: str | None) -> int:
        """Counted versions newer than ``served``; one the book never saw is older than every kept one."""
        return len(self.newer(served))

    def newer(self, served: str | None) -> list[tuple[str, str]]:
        """The versions newer than ``served``, oldest first, each with why it counts."""
        order = list(self._order)
        start = order.index(served) + 1 if served in self._why else 0
        return [(v, self._why[v]) for v in order[start:]]

    def lags(self, served: Mapping[str, str | None]) -> dict[str, int]:
        return {name: self.staleness(version) for name, version in served.items()}

    def snapshot(self, bound: int, mode: str, served: Iterable[tuple[str, str | None]]) -> dict[str, Any]:
        """``/v1/status``'s ``versions``."""
        now = dict(served)
        return {"latest_started": self.latest, "mode": mode, "max_staleness_versions": bound,
                "staleness_versions": self.lags(now), "rollouts": [r.to_json() for r in self.rollouts],
                "counted": [{"version": v, "why": self._why[v]} for v in self._order]}


def _session(session_id: str) -> str:
    return f"session {session_id} open"
