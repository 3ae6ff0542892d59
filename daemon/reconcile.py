"""Engine sync as data: what each engine should be (``Desired``), what the daemon recorded, what the engine
says, and the engine calls that close the gap. Pure, like states.py: no asyncio, no I/O.

The daemon's record of an engine is a cache of what it last observed, never the truth (DESIGN.md §3).
``plan(desired, recorded, observed)`` returns a ``Plan``: whether the engine restarted, the record to hold
now, and the actions that drive it to ``desired``. Level-triggered, as kubelet does it: a plan whose calls
failed is simply planned again. Every path that drives an engine plans here (daemon/worker.py runs the plans).

Rules, in order:

1. Restart. The incarnation changed; or the engine cannot tell its incarnation and the daemon lost
   sight of it (unreachable, or the daemon itself restarted); or its weight version moved away from
   the committed one while no update was open. A restarted engine is a fresh one: every tag
   resident, serving its launch weights, no update session. Its weights are stale.
2. Adopt. Whatever the engine reports (residency, pause gate, weight version) replaces the record;
   a field it cannot report keeps the record's value. What a same engine reports replaces the desired
   state of that field too (a half-done step is taken at the engine's word; the trainer re-asks).
3. Sessions. An engine-side update session the daemon does not own is ended (its contents are
   unknown: stale). An engine that lost a session the daemon owns (restarted, or reports none open) has
   stale weights, and the plan says why (``lost_session``: the session fails on it). A weight
   session's open and close set the desired weights (``WeightsGoal``): the update session begins, or ends
   committing a version (clean) or not (the weights the session leaves).
4. Memory. Tags the desired state has released are released (a restarted engine gets back the
   memory state the record wanted: during ``train``, the trainer's memory), the others resumed.
5. Serving. An engine may serve only clean weights on resident memory; otherwise it is paused. It
   pauses in the desired state's mode unless its weights or memory forbid serving now (abort: what
   runs would run on weights that are not committed); it continues only where the desired state serves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from ..engines.base import MemoryTag, Observation, PauseMode
from .states import EngineRecord, Generation, NodePhase, TagState, WeightsState

__all__ = ["Action", "Desired", "Plan", "WeightsGoal", "plan"]


class Action(StrEnum):
    """One engine call of a plan, in the order the daemon runs them."""

    BEGIN_ENGINE_SESSION = "begin_engine_session"
    END_ENGINE_SESSION = "end_engine_session"  # a commit or close (the plan's ``weights`` says which), or unowned
    PAUSE = "pause"  # stop generation: the desired state pauses, the weights are stale or memory is released
    RELEASE = "release"  # flush the prefix cache (idle first), then give back what the desired state released
    RESUME = "resume"  # take back the memory the desired state has resident
    CONTINUE = "continue"  # flush the prefix cache (no stale KV across a weight change), then serve


@dataclass(frozen=True, slots=True)
class WeightsGoal:
    """What a weight session wants of one engine's weights: its update session open (``session``), or ended,
    serving ``version`` (a commit) or holding ``after`` (a close without commit: what the session left)."""

    session: str | None = None
    version: str | None = None
    after: WeightsState | None = None


@dataclass(frozen=True, slots=True)
class Desired:
    """What one engine should be: serving or paused (and how it pauses), which owned tags are released, and
    what a weight session wants of its weights (None: nothing)."""

    generation: Generation = Generation.SERVING
    released: frozenset[MemoryTag] = frozenset()
    pause_mode: PauseMode = PauseMode.ABORT
    weights: WeightsGoal | None = None

    @classmethod
    def holding(cls, state: EngineRecord) -> Desired:
        """The engine as recorded: what the health loop, a relaunch and a daemon restart drive toward."""
        return cls(state.generation, frozenset(t for t in state.owned_tags if not state.resident(t)))

    def to_resume(self, state: EngineRecord) -> tuple[MemoryTag, ...]:
        return tuple(t for t in state.owned_tags if t not in self.released and not state.resident(t))

    def adopting(self, recorded: EngineRecord, now: EngineRecord) -> Desired:
        """Where the engine reported something other than the record, that is what it should be."""
        released = {t for t in self.released
                    if not (now.resident(t) and not recorded.resident(t))}
        released |= {t for t in now.owned_tags if not now.resident(t) and recorded.resident(t)}
        generation = now.generation if now.generation is not recorded.generation else self.generation
        return replace(self, generation=generation, released=frozenset(released))

    @classmethod
    def for_train(cls, state: EngineRecord, release: tuple[MemoryTag, ...] | None, mode: PauseMode) -> Desired:
        """Paused, ``release`` (None: every owned tag) released as well: train's and a manual sleep's."""
        tags = state.owned_tags if release is None else tuple(t for t in release if t in state.owned_tags)
        return cls(Generation.PAUSED, cls.holding(state).released | set(tags), mode)

    @classmethod
    def for_sync(cls, state: EngineRecord) -> Desired:
        """The weights memory back, for the push; the rest stays as it is."""
        held = cls.holding(state)
        return replace(held, released=held.released - {MemoryTag.WEIGHTS})

    @classmethod
    def for_resume(cls, state: EngineRecord, tags: tuple[MemoryTag, ...], phase: NodePhase) -> Desired:
        """``tags`` resident again; in rollout the engine serves once it may (else it stays paused)."""
        held = cls.holding(state)
        generation = Generation.SERVING if phase is NodePhase.ROLLOUT else held.generation
        return cls(generation, held.released - set(tags))


@dataclass(frozen=True, slots=True)
class Plan:
    """What one observation (or none: the record is fresh) means for one engine, and what to do."""

    engine: str
    restarted: bool
    reason: str | None  # why the engine counts as restarted
    state: EngineRecord  # the record to hold before acting: what the engine is now
    actions: tuple[Action, ...]
    release: tuple[MemoryTag, ...] = ()  # tags for Action.RELEASE
    findings: tuple[str, ...] = ()  # where the record differed from the engine (adopted)
    end_session_tolerant: bool = False  # END_ENGINE_SESSION on a guess: the engine may have none open
    resume: tuple[MemoryTag, ...] = ()  # tags for Action.RESUME
    pause_mode: PauseMode = PauseMode.ABORT  # for Action.PAUSE
    weights: WeightsGoal | None = None  # for Action.BEGIN_ENGINE_SESSION and Action.END_ENGINE_SESSION
    lost_session: str | None = None  # why the engine lost the daemon's open weight session (None: it did not)

    @property
    def changes_anything(self) -> bool:
        return self.restarted or bool(self.actions) or bool(self.findings)

    def snapshot(self) -> dict[str, object]:
        return {"restarted": self.restarted, "reason": self.reason, "findings": list(self.findings),
                "actions": [a.value for a in self.actions], "release": [t.value for t in self.release]}


def plan(desired: Desired, recorded: EngineRecord, observed: Observation | None, *, phase: NodePhase,
         owns_session: bool, first_sight: bool = False, lost_sight: bool = False) -> Plan:
    """The plan that drives one engine from ``recorded`` (corrected by ``observed``) to ``desired``. ``owns_session``:
    an open weight session includes it; ``first_sight``: no record at all (what it reports is the baseline);
    ``lost_sight``: a record, but not observed continuously since (a failed probe, or a restart with a journal)."""
    reason: str | None = None
    findings: list[str] = []
    actions: list[Action] = []
    end_tolerant = False
    lost: str | None = None
    goal = desired.weights
    base = recorded
    if observed is not None:
        reason = None if first_sight else _restart_reason(recorded, observed, owns_session, lost_sight)
        base = _observed(recorded, observed, reason is not None, first_sight, owns_session, findings)
        if reason is None:
            desired = desired.adopting(recorded, base)
        if owns_session and (reason is not None or observed.update_session_open is False):
            lost = reason or "it reports no open weight-update session"
            findings.append("the engine lost the open weight session")
            base = base.with_(weights=WeightsState.STALE)
        elif not owns_session and reason is None:
            if observed.update_session_open or recorded.weights is WeightsState.UPDATING:
                actions.append(Action.END_ENGINE_SESSION)
                findings.append("weight-update session open on the engine that this daemon does not own")
                end_tolerant = not observed.update_session_open
                goal = WeightsGoal(after=WeightsState.STALE)
                base = base.with_(weights=WeightsState.STALE)
            elif (lost_sight and observed.update_session_open is None and phase is NodePhase.SYNC
                  and base.weights is not WeightsState.CLEAN):
                # The engine cannot say, and a daemon that lost sight mid-sync may have left one open.
                actions.append(Action.END_ENGINE_SESSION)
                end_tolerant = True
                goal = WeightsGoal(after=base.weights)

    if lost is None and not actions and goal is not None:
        if goal.session is not None and base.weights is not WeightsState.UPDATING:
            actions.append(Action.BEGIN_ENGINE_SESSION)
        elif goal.session is None and base.weights is WeightsState.UPDATING:
            actions.append(Action.END_ENGINE_SESSION)
    release = tuple(t for t in base.owned_tags if t in desired.released and base.resident(t))
    resume = desired.to_resume(base)
    after = base.with_tags(release, TagState.RELEASED).with_tags(resume, TagState.RESIDENT)
    may_serve = base.weights is WeightsState.CLEAN and all(after.resident(t) for t in after.owned_tags)
    mode = desired.pause_mode
    if base.weights is not WeightsState.CLEAN or any(not base.resident(t) for t in base.owned_tags):
        mode = PauseMode.ABORT
    if base.generation is Generation.SERVING and (desired.generation is Generation.PAUSED or not may_serve):
        actions.append(Action.PAUSE)
    if release:
        actions.append(Action.RELEASE)
    if resume:
        actions.append(Action.RESUME)
    if base.generation is Generation.PAUSED and desired.generation is Generation.SERVING and may_serve:
        actions.append(Action.CONTINUE)
    return Plan(recorded.name, reason is not None, reason, base, tuple(actions), release, tuple(findings),
                end_tolerant, resume, mode, goal, lost)


def _observed(recorded: EngineRecord, observed: Observation, restarted: bool, first_sight: bool,
              owns_session: bool, findings: list[str]) -> EngineRecord:
    """What the engine is now: a fresh process (restarted), or the record overlaid with the engine's report."""
    if restarted:
        fresh = EngineRecord(name=recorded.name, owned_tags=recorded.owned_tags, weights=WeightsState.STALE,
                            weight_version=observed.weight_version, healthy=True, last_error=recorded.last_error,
                            incarnation=observed.incarnation)
        return _overlay(fresh, observed, [])
    base = _overlay(recorded.with_(incarnation=observed.incarnation or recorded.incarnation), observed, findings)
    if first_sight:
        return base.with_(weight_version=observed.weight_version)
    if (observed.weight_version != recorded.weight_version and not owns_session
            and recorded.weights is not WeightsState.UPDATING):
        findings.append(f"weight version {observed.weight_version!r}, record said {recorded.weight_version!r}")
        return base.with_(weight_version=observed.weight_version, weights=WeightsState.STALE)
    return base


def _restart_reason(recorded: EngineRecord, observed: Observation, owns_session: bool, lost_sight: bool) -> str | None:
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


def _overlay(state: EngineRecord, observed: Observation, findings: list[str]) -> EngineRecord:
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

