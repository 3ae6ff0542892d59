"""``PolicySet``: the validated, frozen bundle of every policy and setting the daemon runs with."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .cleanup import CleanupPolicy
from .pipeline import PipelinePolicy
from .process_groups import ProcessGroupPolicy
from .settings import AdapterSettings, EngineSettings, PauseModeName, SyncSettings
from .timeouts import Timeouts

__all__ = ["API_VERSION", "PolicySet"]

API_VERSION = "colocd/v1"


@dataclass(frozen=True, slots=True, eq=False)
class PolicySet:
    """Everything one policy document decides, validated.

    ``version`` is assigned by the ``PolicyStore`` (0 = never applied) and only ever grows;
    ``fingerprint`` hashes the normalised document, so the same policies give the same fingerprint
    whatever the YAML's layout, comments or version.
    """

    process_groups: ProcessGroupPolicy
    pipeline: PipelinePolicy
    cleanup: CleanupPolicy
    engines: EngineSettings = field(default_factory=lambda: EngineSettings())
    timeouts: Timeouts = field(default_factory=lambda: Timeouts())
    sync: SyncSettings = field(default_factory=lambda: SyncSettings())
    adapters: AdapterSettings = field(default_factory=lambda: AdapterSettings())
    version: int = 0
    source: str | None = None  # where it came from, for logs: a path, "PUT /v1/policies", "defaults"
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        canonical = json.dumps(self.as_document(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "fingerprint", hashlib.sha256(canonical.encode()).hexdigest()[:16])

    def as_document(self) -> dict[str, Any]:
        """The normalised document, defaults filled in; loading it back gives an equal PolicySet."""
        return {
            "apiVersion": API_VERSION,
            "process_groups": self.process_groups.settings(),
            "pipeline": self.pipeline.settings(),
            "cleanup": self.cleanup.settings(),
            "engines": self.engines.model_dump(mode="json"),
            "timeouts": self.timeouts.model_dump(mode="json"),
            "sync": self.sync.model_dump(mode="json"),
            "adapters": self.adapters.model_dump(mode="json"),
        }

    def info(self) -> dict[str, str]:
        """Labels for the ``colocd_policy_info`` metric and ``/v1/status``."""
        return {
            "version": str(self.version),
            "fingerprint": self.fingerprint,
            "process_groups": self.process_groups.spec,
            "pipeline": self.pipeline.spec,
            "cleanup": self.cleanup.spec,
        }

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
