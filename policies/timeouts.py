"""Every step the daemon times, and one ``Timeouts`` model for the node config and the policy document: the
node config's are the defaults, a document overrides exactly the fields it sets (``Timeouts.over``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HEALTH_INTERVAL_S", "SESSION_IDLE_S", "STEP_S", "Budget", "Timeouts"]


class Budget(StrEnum):
    """A step the daemon bounds in time; ``Timeouts`` has a ``<value>_s`` field for each."""

    PAUSE = "pause"  # pause_generation and continue_generation
    FLUSH = "flush"  # every retry of a refused flush, together
    RELEASE = "release"  # release_memory_occupation
    MEMORY_CONFIRM = "memory_confirm"  # NVML shows the released bytes free
    RESUME = "resume"  # resume_memory_occupation
    WEIGHT_UPDATE = "weight_update"  # an engine's begin/end of an update, its version bump, its parameter list
    CHUNK = "chunk"  # one chunk: gather from every rank plus every engine's load (or one broadcast)
    START = "start"  # from a session's open until every rank it needs joined and sent its first chunk
    GROUP = "group"  # an engine joins or leaves a weight-update group
    MASTER_REACH = "master_reach"  # the trainer's TCPStore accepts a connection
    OBSERVE = "observe"  # one observation of one engine
    HEALTH_INTERVAL = "health_interval"  # the pause between two passes of the health loop
    SESSION_IDLE = "session_idle"  # a weight session with no activity this long expires
    QUIESCE = "quiesce"  # closing a failed session waits this long for the engine calls it issued


# Bounds of every budget, in seconds. A step budget below 0.1 s leaves an engine call no room for one loopback
# round trip under load, and one over an hour is a hang, not a budget. The health loop's floor is what keeps a
# policy from spinning it (at 1e-9 s the daemon and the engine burned ~100 times their idle CPU); 50 ms is still
# finer than any engine restart. A weight session idle for under a second is a trainer between two buckets.
STEP_S = (0.1, 3600.0)
HEALTH_INTERVAL_S = (0.05, 3600.0)
SESSION_IDLE_S = (1.0, 3600.0)


def _seconds(default: float | None, description: str, bounds: tuple[float, float] = STEP_S) -> Any:
    return Field(default, ge=bounds[0], le=bounds[1], description=description)


class Timeouts(BaseModel):
    """One default budget plus per-step values in seconds (httpx's ``Timeout`` shape); ``None`` uses ``default_s``.

    In a policy document, a field left out keeps the node config's value (these defaults are the node's).
    Every value lies within its bounds (``STEP_S`` unless the field names others).
    """

    # strict: a number is a duration, ``true`` is not 1 s and ``"30"`` is not 30 s (an int is still a float).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    default_s: float = _seconds(30.0, "budget of any step without its own value")
    pause_s: float | None = _seconds(None, "pause_generation, and continue_generation")
    flush_s: float | None = _seconds(None, "total budget for flush retries")
    release_s: float | None = _seconds(None, "engines release memory")
    memory_confirm_s: float | None = _seconds(None, "NVML wait for the released bytes")
    resume_s: float | None = _seconds(None, "engines take memory back")
    weight_update_s: float | None = _seconds(
        None, "an engine begins or ends a weight update, bumps its version, lists its parameters")
    chunk_s: float | None = _seconds(None, "one chunk: gather from all ranks + engine load (or one broadcast)")
    start_s: float | None = _seconds(
        60.0, "from a weight session's open until every trainer rank an engine needs has joined and sent its first "
        "chunk (a late rank is named); chunk_s applies from a rank's first chunk on")
    group_s: float | None = _seconds(None, "an engine joins or destroys a weight-update group")
    master_reach_s: float | None = _seconds(
        3.0, "how long POST /v1/weights/groups waits for the trainer's TCPStore to accept a connection before "
        "answering 422 (it may be a moment from listening)")
    observe_s: float | None = _seconds(None, "one observation of one engine")
    health_interval_s: float | None = _seconds(
        5.0, "interval of the health loop's observations and reconciliation", HEALTH_INTERVAL_S)
    session_idle_s: float | None = _seconds(
        60.0, "a weight session with no chunk, commit or engine load for this long expires (the trainer is presumed "
        "gone): aborted, its shm segments unlinked", SESSION_IDLE_S)
    quiesce_s: float | None = _seconds(
        None, "closing a failed/aborted/expired session waits this long for the engine calls it issued; engines "
        "whose calls are still running are then marked stale")

    def budget(self, name: Budget) -> float:
        """Seconds allowed for the engine call or stage ``name``."""
        value: float | None = getattr(self, f"{name.value}_s")
        return self.default_s if value is None else value

    def over(self, base: Timeouts) -> Timeouts:
        """``base`` with every field this object was given explicitly (the fields a document sets)."""
        return Timeouts.model_validate({**base.model_dump(), **self.model_dump(include=self.model_fields_set)})
