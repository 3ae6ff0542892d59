"""Reconciliation as specifications: what the daemon recorded, what the engine says, what it then does."""

from __future__ import annotations

from colocd.daemon.reconcile import Action, Desired
from colocd.daemon.reconcile import plan as plan_toward
from colocd.daemon.states import EngineRecord, Generation, NodePhase, TagState, WeightsState
from colocd.engines.base import ALL_TAGS, MemoryTag, Observation

W, KV, CG = MemoryTag.WEIGHTS, MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH
ALL_RESIDENT = {W: True, KV: True, CG: True}


def serving(version: str = "v3", incarnation: str | None = "boot-1") -> EngineRecord:
    """An engine in rollout at a committed version: everything resident, generation on."""
    return EngineRecord(name="e0", weight_version=version, incarnation=incarnation)


def trained(incarnation: str | None = "boot-1") -> EngineRecord:
    """An engine after 'train': paused, every tag released (so weights stale), version kept."""
    return serving(incarnation=incarnation).with_(generation=Generation.PAUSED).with_tags(ALL_TAGS, TagState.RELEASED)


def synced(incarnation: str | None = "boot-1") -> EngineRecord:
    """After 'sync': weights resident (stale until the push commits), KV cache and graphs still released."""
    return trained(incarnation).with_tags((W,), TagState.RESIDENT)


def fresh(incarnation: str | None = "boot-2", version: str = "default") -> Observation:
    """What a just-restarted reference engine reports: all resident, serving its seed weights."""
    return Observation(incarnation=incarnation, weight_version=version, resident=dict(ALL_RESIDENT),
                       paused=False, update_session_open=False)


def plan(recorded: EngineRecord, observed: Observation, phase: NodePhase = NodePhase.ROLLOUT, *,
         owns_session: bool = False, first_sight: bool = False, lost_sight: bool = False):  # type: ignore[no-untyped-def]
    # A reconcile: the desired state is the record itself.
    return plan_toward(Desired.holding(recorded), recorded, observed, phase=phase, owns_session=owns_session,
                       first_sight=first_sight, lost_sight=lost_sight)


def test_an_engine_that_matches_its_record_needs_nothing() -> None:
    p = plan(serving(), Observation("boot-1", "v3", dict(ALL_RESIDENT), paused=False, update_session_open=False))
    assert not p.restarted and p.actions == () and p.findings == ()
    assert p.state == serving()


def test_a_new_incarnation_during_train_is_a_restart_paused_and_released_again_with_stale_weights() -> None:
    p = plan(trained(), fresh(), NodePhase.TRAIN)
    assert p.restarted and "boot-1 -> boot-2" in (p.reason or "")
    assert p.actions == (Action.PAUSE, Action.RELEASE)
    assert p.release == (W, KV, CG)  # the trainer keeps its memory
    assert p.state.weights is WeightsState.STALE
    assert p.state.incarnation == "boot-2" and p.state.weight_version == "default"
    assert p.state.generation is Generation.SERVING  # what the engine is now; PAUSE is what follows


def test_a_restart_during_rollout_pauses_generation_and_releases_nothing() -> None:
    p = plan(serving(), fresh(), NodePhase.ROLLOUT)
    assert p.restarted and p.actions == (Action.PAUSE,) and p.release == ()
    assert p.state.weights is WeightsState.STALE


def test_a_restart_during_sync_releases_only_what_sync_left_released() -> None:
    p = plan(synced(), fresh(), NodePhase.SYNC)
    assert p.actions == (Action.PAUSE, Action.RELEASE) and p.release == (KV, CG)


def test_a_restart_mid_update_fails_the_daemons_session_and_never_ends_one_on_the_new_engine() -> None:
    updating = synced().with_(weights=WeightsState.UPDATING)
    p = plan(updating, fresh(), NodePhase.SYNC, owns_session=True)
    assert p.lost_session is not None and p.actions == (Action.PAUSE, Action.RELEASE)
    assert Action.END_ENGINE_SESSION not in p.actions


def test_an_engine_that_cannot_tell_its_incarnation_counts_as_restarted_after_the_daemon_lost_sight() -> None:
    p = plan(serving(incarnation=None), Observation(None, "v3", None, None, None), lost_sight=True)
    assert p.restarted and "cannot prove" in (p.reason or "")
    assert p.actions == (Action.PAUSE,)


def test_the_same_incarnation_after_an_outage_is_not_a_restart() -> None:
    p = plan(serving(), Observation("boot-1", "v3", dict(ALL_RESIDENT), False, False), lost_sight=True)
    assert not p.restarted and p.actions == ()


def test_a_weight_version_back_at_the_launch_default_on_clean_weights_is_a_restart() -> None:
    p = plan(serving(incarnation=None), Observation(None, "default", None, None, None))
    assert p.restarted and "'v3' to 'default'" in (p.reason or "")
    assert p.actions == (Action.PAUSE,)


def test_the_first_sight_of_an_engine_adopts_whatever_it_reports() -> None:
    p = plan(EngineRecord(name="e0"), Observation("boot-1", "default", dict(ALL_RESIDENT), False, False),
             first_sight=True)
    assert not p.restarted and p.actions == ()
    assert (p.state.weight_version, p.state.incarnation, p.state.weights) == ("default", "boot-1", WeightsState.CLEAN)


def test_an_engine_side_session_nobody_owns_is_ended_and_the_weights_are_stale() -> None:
    p = plan(synced(), Observation("boot-1", "v3", {W: True, KV: False, CG: False}, True, True), NodePhase.SYNC,
             lost_sight=True)
    assert not p.restarted
    assert p.actions == (Action.END_ENGINE_SESSION,) and not p.end_session_tolerant
    assert p.state.weights is WeightsState.STALE


def test_a_record_still_updating_without_a_daemon_session_ends_the_engines_session_tolerantly() -> None:
    p = plan(synced().with_(weights=WeightsState.UPDATING), Observation("boot-1", "v3", None, None, None),
             NodePhase.SYNC)
    assert p.actions == (Action.END_ENGINE_SESSION,) and p.end_session_tolerant


def test_an_engine_that_cannot_report_sessions_gets_a_tolerant_end_after_the_daemon_lost_sight_mid_sync() -> None:
    p = plan(synced(), Observation("boot-1", "v3", None, None, None), NodePhase.SYNC, lost_sight=True)
    assert p.actions == (Action.END_ENGINE_SESSION,) and p.end_session_tolerant


def test_the_daemons_own_open_session_is_left_alone() -> None:
    updating = synced().with_(weights=WeightsState.UPDATING)
    p = plan(updating, Observation("boot-1", "v4", {W: True, KV: False, CG: False}, True, True), NodePhase.SYNC,
             owns_session=True)
    assert p.actions == () and p.state.weights is WeightsState.UPDATING


def test_what_the_engine_reports_replaces_the_record_after_a_half_done_step() -> None:
    # A resume that timed out on the daemon's side but happened on the engine's.
    p = plan(trained(), Observation("boot-1", "v3", {W: True, KV: False, CG: False}, True, False), NodePhase.TRAIN)
    assert not p.restarted and p.actions == ()
    assert p.state.resident(W) and not p.state.resident(KV)
    assert any("tag weights is resident" in f for f in p.findings)


def test_an_engine_serving_stale_weights_is_paused_even_without_a_restart() -> None:
    stale = serving().with_(weights=WeightsState.STALE)
    p = plan(stale, Observation("boot-1", "v3", dict(ALL_RESIDENT), False, False))
    assert p.actions == (Action.PAUSE,)


def test_a_weight_version_changed_behind_the_daemons_back_makes_the_weights_stale() -> None:
    p = plan(serving(), Observation("boot-1", "v9", dict(ALL_RESIDENT), False, False))
    assert not p.restarted and p.state.weights is WeightsState.STALE and p.actions == (Action.PAUSE,)
