"""Reconciliation as data: what the daemon recorded, what the engine says, and what to do about it.

The daemon's record of an engine is a cache of what it last observed, never the truth
(DESIGN.md §3). ``plan_reconcile`` compares the record with a fresh ``Observation`` and returns a
``Plan``: whether the engine restarted, the record to hold now (what the engine really is), and
the engine calls that drive it back to the desired state. Level-triggered, as kubelet does it:
the same inputs give the same plan, so a plan whose calls failed is simply planned again on the
next tick. Pure, like states.py: no asyncio, no I/O.

Rules, in order:

1. Restart. The incarnation changed; or the engine cannot tell its incarnation and the daemon lost
   sight of it (unreachable, or the daemon itself restarted); or its weight version moved away from
   the committed one while no update was open. A restarted engine is a fresh one: every tag
   resident, serving its launch weights, no update session. Its weights are stale.
2. Adopt. Whatever the engine reports (residency, pause gate, weight version) replaces the record;
   a field it cannot report keeps the record's value.
3. Sessions. An engine-side update session the daemon does not own is ended (its contents are
   unknown: stale). A session the daemon owns on an engine that lost it (restarted) fails.
4. Memory. A restarted engine gets back the memory state the record wanted: the tags that were
   released (during ``train``: the trainer's memory) are released again.
5. Serving. An engine may serve only clean weights on resident memory; otherwise it is paused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..engines.base import MemoryTag, Observation
from .states import EngineState, Generation, NodePhase, TagState, WeightsState

__all__ = ["Action", "Plan", "plan_reconcile"]


class Action(StrEnum):
    """One engine call (or daemon-side step) of a plan, in the order the daemon runs them."""

    FAIL_SESSION = "fail_session"  # the daemon's open weight session cannot finish: the engine lost it
    END_ENGINE_SESSION = "end_engine_session"  # an engine-side update session nobody owns
    PAUSE = "pause"  # stop generation: the weights are stale or memory is released
    RELEASE = "release"  # give the memory back that the desired state has released


@dataclass(frozen=True, slots=True)
class Plan:
    """What one observation means for one engine."""

    engine: str
    restarted: bool
    reason: str | None  # why the engine counts as restarted
    state: EngineState  # the record to hold before acting: what the engine is now
    actions: tuple[Action, ...]
    release: tuple[MemoryTag, ...] = ()  # tags for Action.RELEASE
    findings: tuple[str, ...] = ()  # where the record differed from the engine (adopted)
    end_session_tolerant: bool = False  # END_ENGINE_SESSION on a guess: the engine may have none open

    @property
    def changes_anything(self) -> bool:
        return self.restarted or bool(self.actions) or bool(self.findings)

    def snapshot(self) -> dict[str, object]:
        return {"restarted": self.restarted, "reason": self.reason, "findings": list(self.findings),
                "actions": [a.value for a in self.actions], "release": [t.value for t in self.release]}


def plan_reconcile(recorded: EngineState, observed: Observation, *, phase: NodePhase, owns_session: bool,
                   first_sight: bool, lost_sight: bool) -> Plan:
    """The plan for one engine.

    ``owns_session``: the daemon has an open weight session that includes this engine.
    ``first_sight``: the daemon has no record of this engine at all (fresh daemon, no journal):
    whatever it reports is the baseline. ``lost_sight``: the daemon had a record but did not observe
    the engine continuously since (a failed probe, or the daemon restarted with a journal).
    """
    reason = None if first_sight else _restart_reason(recorded, observed, owns_session, lost_sight)
    restarted = reason is not None
    findings: list[str] = []
    if restarted:
        base = EngineState(name=recorded.name, owned_tags=recorded.owned_tags, weights=WeightsState.STALE,
                           weight_version=observed.weight_version, healthy=True, last_error=recorded.last_error,
                           incarnation=observed.incarnation)
        base = _overlay(base, observed, [])
    else:
        base = _overlay(recorded.with_(incarnation=observed.incarnation or recorded.incarnation), observed, findings)
        if first_sight:
            base = base.with_(weight_version=observed.weight_version)
        elif (observed.weight_version != recorded.weight_version and not owns_session
              and recorded.weights is not WeightsState.UPDATING):
            findings.append(f"weight version {observed.weight_version!r}, record said {recorded.weight_version!r}")
            base = base.with_(weight_version=observed.weight_version, weights=WeightsState.STALE)

    actions: list[Action] = []
    end_tolerant = False
    if owns_session and (restarted or observed.update_session_open is False):
        actions.append(Action.FAIL_SESSION)
        findings.append("the engine lost the open weight session")
        base = base.with_(weights=WeightsState.STALE)
    elif not owns_session and not restarted:
        if observed.update_session_open or recorded.weights is WeightsState.UPDATING:
            actions.append(Action.END_ENGINE_SESSION)
            findings.append("weight-update session open on the engine that this daemon does not own")
            end_tolerant = not observed.update_session_open
            base = base.with_(weights=WeightsState.STALE)
        elif (lost_sight and observed.update_session_open is None and phase is NodePhase.SYNC
              and base.weights is not WeightsState.CLEAN):
            # The engine cannot say, and a daemon that lost sight mid-sync may have left one open.
            actions.append(Action.END_ENGINE_SESSION)
            end_tolerant = True

    release: tuple[MemoryTag, ...] = ()
    if restarted:
        wanted = {t for t in recorded.owned_tags if recorded.tags[t] is TagState.RELEASED}
        release = tuple(t for t in recorded.owned_tags if t in wanted and base.resident(t))
    released_after = [t for t in base.owned_tags if not base.resident(t) or t in release]
    if base.generation is Generation.SERVING and (base.weights is not WeightsState.CLEAN or released_after):
        actions.append(Action.PAUSE)
    if release:
        actions.append(Action.RELEASE)
    return Plan(recorded.name, restarted, reason, base, tuple(actions), release, tuple(findings), end_tolerant)


def _restart_reason(recorded: EngineState, observed: Observation, owns_session: bool, lost_sight: bool) -> str | None:
    if recorded.incarnation is not None and observed.incarnation is not None:
        if recorded.incarnation != observed.incarnation:
            return f"incarnation changed ({recorded.incarnation} -> {observed.incarnation})"
        return None
    if lost_sight:
        return "the engine cannot prove it is the same process after the daemon lost sight of it"
    if (recorded.weights is WeightsState.CLEAN and not owns_session
            and observed.weight_version != recorded.weight_version):
        return f"weight version went from {recorded.weight_version!r} to {observed.weight_version!r}"
    return None


def _overlay(state: EngineState, observed: Observation, findings: list[str]) -> EngineState:
    """The record with every field the engine reports replaced by the engine's answer."""
    if observed.resident is not None:
        for tag in state.owned_tags:
            if tag not in observed.resident or observed.resident[tag] == state.resident(tag):
                continue
            now = TagState.RESIDENT if observed.resident[tag] else TagState.RELEASED
            findings.append(f"tag {tag.value} is {now.value}, record said {state.tags[tag].value}")
            state = state.with_tags((tag,), now)
    if observed.paused is not None:
        generation = Generation.PAUSED if observed.paused else Generation.SERVING
        if generation is not state.generation:
            findings.append(f"generation is {generation.value}, record said {state.generation.value}")
            state = state.with_(generation=generation)
    return state
