"""``PolicySet``: the validated, frozen bundle of every policy and setting the daemon runs with; ``PolicyStore``
holds the active one and swaps in a staged one only at a transition boundary (no asyncio, no I/O)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .cleanup import CleanupPolicy
from .pipeline import PipelinePolicy
from .process_groups import ProcessGroupPolicy
from .settings import AdapterSettings, EngineSettings, PauseModeName, SyncSettings
from .timeouts import Timeouts

__all__ = ["API_VERSION", "PolicySet", "PolicyStore"]

API_VERSION = "colocd/v1"


@dataclass(frozen=True, slots=True, eq=False)
class PolicySet:
    """Everything one policy document decides, validated. ``version``: the ``PolicyStore``'s (0 = never applied);
    ``fingerprint`` hashes the normalised document, whatever the YAML's layout, comments or version."""

    process_groups: ProcessGroupPolicy
    pipeline: PipelinePolicy
    cleanup: CleanupPolicy
    engines: EngineSettings = field(default_factory=EngineSettings)
    timeouts: Timeouts = field(default_factory=Timeouts)
    sync: SyncSettings = field(default_factory=SyncSettings)
    adapters: AdapterSettings = field(default_factory=AdapterSettings)
    version: int = 0
    source: str | None = None  # where it came from, for logs: a path, "PUT /v1/policies", "defaults"
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        canonical = json.dumps(self.as_document(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "fingerprint", hashlib.sha256(canonical.encode()).hexdigest()[:16])

    def as_document(self) -> dict[str, Any]:
        """The normalised document, defaults filled in; loading it back gives an equal PolicySet."""
        return {"apiVersion": API_VERSION, "process_groups": self.process_groups.settings(),
                "pipeline": self.pipeline.settings(), "cleanup": self.cleanup.settings(),
                "engines": self.engines.model_dump(mode="json"), "timeouts": self.timeouts.model_dump(mode="json"),
                "sync": self.sync.model_dump(mode="json"), "adapters": self.adapters.model_dump(mode="json")}

    def info(self) -> dict[str, str]:
        """Labels for the ``colocd_policy_info`` metric and ``/v1/status``."""
        specs = {str(p.family): p.spec for p in (self.process_groups, self.pipeline, self.cleanup)}
        return {"version": str(self.version), "fingerprint": self.fingerprint, **specs}

    def over_node(self, timeouts: Timeouts, pause_mode: PauseModeName) -> PolicySet:
        """This document over the node config's own values: each timeout and the pause mode the document
        sets wins, the rest are the node's. Computed once per document (when staged), never per call."""
        engines = self.engines
        if "pause_mode" not in engines.model_fields_set:
            engines = EngineSettings.model_validate({**engines.model_dump(include=engines.model_fields_set),
                                                     "pause_mode": pause_mode})
        return dataclasses.replace(self, engines=engines, timeouts=self.timeouts.over(timeouts))

    def with_version(self, version: int, source: str | None = None) -> PolicySet:
        """A copy carrying ``version`` (and ``source`` if given); the fingerprint is unchanged."""
        return dataclasses.replace(self, version=version, source=self.source if source is None else source)

    def __eq__(self, other: object) -> bool:
        # Equal policies, whatever their version or source.
        return isinstance(other, PolicySet) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)


class PolicyStore:
    """The active PolicySet (version 1 at first) plus at most one pending swap, which takes effect at the next
    ``at_boundary()`` or ``transition()``."""

    def __init__(self, initial: PolicySet) -> None:
        self._lock = threading.Lock()  # not asyncio's: a SIGHUP reload stages from a worker thread
        self._active = initial.with_version(1)
        self._pending: PolicySet | None = None
        self._next_version = 2
        self._in_transition = False

    @property
    def active(self) -> PolicySet:
        return self._active

    @property
    def pending(self) -> PolicySet | None:
        return self._pending

    def stage(self, new: PolicySet) -> PolicySet:
        """Record ``new`` for the next boundary and return it with its version. The last stage wins; versions only
        grow; staging what is active drops any pending swap, so re-applying the same file is a no-op."""
        with self._lock:
            if new.fingerprint == self._active.fingerprint:
                self._pending = None
                return self._active
            if self._pending is not None and new.fingerprint == self._pending.fingerprint:
                return self._pending
            self._pending = new.with_version(self._next_version)
            self._next_version += 1
            return self._pending

    def at_boundary(self) -> PolicySet | None:
        """Swap in the pending PolicySet and return it (None: nothing pending); a RuntimeError inside
        ``transition()``, where a swap would land mid-transition."""
        with self._lock:
            if self._in_transition:
                raise RuntimeError("policy swap requested while a transition is in progress")
            return self._swap_locked()

    @contextmanager
    def transition(self) -> Iterator[PolicySet]:
        """Apply any pending swap, then pin the active set for the body (one transition)."""
        with self._lock:
            if self._in_transition:
                raise RuntimeError("transitions do not nest")
            self._swap_locked()
            self._in_transition = True
            pinned = self._active
        try:
            yield pinned
        finally:
            with self._lock:
                self._in_transition = False

    def _swap_locked(self) -> PolicySet | None:
        if self._pending is None:
            return None
        self._active, self._pending = self._pending, None
        return self._active
