"""The engine sync's plan as a table: what each desired state, record and observation lead to.

One row per behaviour: the phase transitions and manual steps (plans on the record just observed), and the
health loop, relaunch and daemon-restart paths (plans on a fresh observation, the desired state holding the
record). daemon/reconcile.py is the function under test; tests/unit/test_reconcile.py specifies the
observation rules in more detail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from colocd.daemon.reconcile import Action, Desired, plan
from colocd.daemon.states import EngineRecord, Generation, NodePhase, TagState, WeightsState
from colocd.engines.base import ALL_TAGS, MemoryTag, Observation, PauseMode

W, KV, CG = MemoryTag.WEIGHTS, MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH
P, R, RS, C = Action.PAUSE, Action.RELEASE, Action.RESUME, Action.CONTINUE
END = Action.END_ENGINE_SESSION

SERVING = EngineRecord(name="e0", weight_version="v3", incarnation="boot-1")
TRAINED = SERVING.with_(generation=Generation.PAUSED).with_tags(ALL_TAGS, TagState.RELEASED)
SYNCED = TRAINED.with_tags((W,), TagState.RESIDENT)
PUSHED = SYNCED.with_(weights=WeightsState.CLEAN, weight_version="v4")  # a complete push committed
ROLLED = PUSHED.with_tags(ALL_TAGS, TagState.RESIDENT).with_(generation=Generation.SERVING)
SLEPT_KV = SERVING.with_(generation=Generation.PAUSED).with_tags((KV,), TagState.RELEASED)
ASLEEP = SERVING.with_(generation=Generation.PAUSED).with_tags(ALL_TAGS, TagState.RELEASED)
RESIDENT = {W: True, KV: True, CG: True}


def fresh(incarnation: str = "boot-2") -> Observation:
    """A just-restarted engine: everything resident, serving its launch weights."""
    return Observation(incarnation, "default", dict(RESIDENT), paused=False, update_session_open=False)


def same(state: EngineRecord, **changes: object) -> Observation:
    """The engine reporting exactly its record (with ``changes``)."""
    fields: dict[str, object] = {"incarnation": state.incarnation, "weight_version": state.weight_version,
                                 "resident": {t: state.resident(t) for t in ALL_TAGS},
                                 "paused": state.generation is Generation.PAUSED, "update_session_open": False}
    return Observation(**{**fields, **changes})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Row:
    desired: Desired
    recorded: EngineRecord
    observed: Observation | None
    phase: NodePhase
    actions: tuple[Action, ...]
    release: tuple[MemoryTag, ...] = ()
    resume: tuple[MemoryTag, ...] = ()
    pause_mode: PauseMode | None = None  # checked where the plan pauses
    owns_session: bool = False
    lost_sight: bool = False
    lost_session: bool = False  # the plan says the engine lost the daemon's session (the session fails on it)


ROWS = {
    # -- phase transitions and manual steps: the record was just observed --------------------------------
    "train pauses in the policy's mode and releases every owned tag":
        Row(Desired.for_train(SERVING, None, PauseMode.RETRACT), SERVING, None, NodePhase.TRAIN, (P, R),
            release=(W, KV, CG), pause_mode=PauseMode.RETRACT),
    "train releases only the tags the policy names":
        Row(Desired.for_train(SERVING, (KV,), PauseMode.IN_PLACE), SERVING, None, NodePhase.TRAIN, (P, R),
            release=(KV,), pause_mode=PauseMode.IN_PLACE),
    "train on an engine already paused and released does nothing":
        Row(Desired.for_train(TRAINED, None, PauseMode.ABORT), TRAINED, None, NodePhase.TRAIN, ()),
    "sync resumes only the weights memory and stays paused":
        Row(Desired.for_sync(TRAINED), TRAINED, None, NodePhase.SYNC, (RS,), resume=(W,)),
    "rollout resumes the rest and continues on clean weights":
        Row(Desired(), PUSHED, None, NodePhase.ROLLOUT, (RS, C), resume=(KV, CG)),
    "rollout on an engine already serving does nothing":
        Row(Desired(), ROLLED, None, NodePhase.ROLLOUT, ()),
    "rollout never continues on stale weights":
        Row(Desired(), SYNCED, None, NodePhase.ROLLOUT, (RS,), resume=(KV, CG)),
    "sleep pauses and releases the tags asked for":
        Row(Desired.for_train(SERVING, (KV,), PauseMode.ABORT), SERVING, None, NodePhase.ROLLOUT, (P, R),
            release=(KV,), pause_mode=PauseMode.ABORT),
    "resume in rollout continues once everything is resident":
        Row(Desired.for_resume(SLEPT_KV, (KV,), NodePhase.ROLLOUT), SLEPT_KV, None, NodePhase.ROLLOUT, (RS, C),
            resume=(KV,)),
    "resume of some tags in rollout stays paused while others are released":
        Row(Desired.for_resume(ASLEEP, (KV,), NodePhase.ROLLOUT), ASLEEP, None, NodePhase.ROLLOUT, (RS,),
            resume=(KV,)),
    "resume outside rollout never continues":
        Row(Desired.for_resume(SLEPT_KV, (KV,), NodePhase.TRAIN), SLEPT_KV, None, NodePhase.TRAIN, (RS,),
            resume=(KV,)),
    # -- health loop, relaunch, daemon restart: a fresh observation, desired holding the record ------------
    "an engine as recorded needs nothing":
        Row(Desired.holding(SERVING), SERVING, same(SERVING), NodePhase.ROLLOUT, ()),
    "a restart during train is paused (abort) and released again":
        Row(Desired.holding(TRAINED), TRAINED, fresh(), NodePhase.TRAIN, (P, R), release=(W, KV, CG),
            pause_mode=PauseMode.ABORT),
    "a restart aborts what runs, whatever the desired state's pause mode":
        Row(Desired.for_train(TRAINED, None, PauseMode.RETRACT), TRAINED, fresh(), NodePhase.TRAIN, (P, R),
            release=(W, KV, CG), pause_mode=PauseMode.ABORT),
    "a restart during sync gets back what sync left released":
        Row(Desired.holding(SYNCED), SYNCED, fresh(), NodePhase.SYNC, (P, R), release=(KV, CG)),
    "a restart during rollout is paused and releases nothing":
        Row(Desired.holding(ROLLED), ROLLED, fresh(), NodePhase.ROLLOUT, (P,), pause_mode=PauseMode.ABORT),
    "a restart mid-update fails the daemon's session":
        Row(Desired.holding(SYNCED), SYNCED.with_(weights=WeightsState.UPDATING), fresh(), NodePhase.SYNC,
            (P, R), release=(KV, CG), owns_session=True, lost_session=True),
    "an engine that lost the daemon's open session fails it":
        Row(Desired.holding(SYNCED), SYNCED.with_(weights=WeightsState.UPDATING),
            same(SYNCED, weight_version="v3", update_session_open=False), NodePhase.SYNC, (),
            owns_session=True, lost_session=True),
    "a session on the engine nobody owns is ended":
        Row(Desired.holding(SYNCED), SYNCED, same(SYNCED, update_session_open=True), NodePhase.SYNC, (END,)),
    "a half-done release is taken at the engine's word, not redone":
        Row(Desired.holding(SERVING), SERVING, same(SERVING, resident={W: True, KV: False, CG: True},
                                                    paused=True), NodePhase.ROLLOUT, ()),
    "a half-done resume is taken at the engine's word, not undone":
        Row(Desired.holding(TRAINED), TRAINED, same(TRAINED, resident={W: True, KV: False, CG: False}),
            NodePhase.TRAIN, ()),
    "a serving engine whose version moved behind the daemon's back is paused (abort)":
        Row(Desired.holding(SERVING), SERVING, same(SERVING, weight_version="v9"), NodePhase.ROLLOUT, (P,),
            pause_mode=PauseMode.ABORT),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_the_plan(row: Row) -> None:
    p = plan(row.desired, row.recorded, row.observed, phase=row.phase, owns_session=row.owns_session,
             lost_sight=row.lost_sight)
    assert p.actions == row.actions
    assert (p.release, p.resume) == (row.release, row.resume)
    assert (p.lost_session is not None) == row.lost_session
    if row.pause_mode is not None:
        assert p.pause_mode is row.pause_mode


def test_a_restarted_engine_is_planned_from_what_it_is_now_not_from_its_record() -> None:
    p = plan(Desired.holding(TRAINED), TRAINED, fresh(), phase=NodePhase.TRAIN, owns_session=False)
    assert p.restarted and p.state.incarnation == "boot-2" and p.state.weights is WeightsState.STALE
    assert p.state.generation is Generation.SERVING  # what the engine is now; PAUSE is what follows


def test_a_plan_whose_actions_ran_plans_nothing_more() -> None:
    """Level-triggered: once the record is what the desired state asks for, the same desired state is a no-op."""
    desired = Desired.for_train(SERVING, None, PauseMode.ABORT)
    assert plan(desired, TRAINED, None, phase=NodePhase.TRAIN, owns_session=False).actions == ()
    assert plan(desired, TRAINED, same(TRAINED), phase=NodePhase.TRAIN, owns_session=False).actions == ()
