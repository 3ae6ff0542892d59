"""Built-in policies as pure functions: snapshot in, decision out."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from colocd.policies import (
    AggressiveCleanupPolicy,
    AutoPolicy,
    Budget,
    CleanupAction,
    DeferredCooldownPolicy,
    DestroyPolicy,
    EmptyCachePolicy,
    GroupAction,
    GroupDirective,
    GroupSnapshot,
    KeepAlivePolicy,
    NoCleanupPolicy,
    OverlapPolicy,
    PipelineSnapshot,
    RebuildMode,
    SerialPolicy,
    SuspendPolicy,
    Timeouts,
    Transport,
    WaitPoint,
)

GIB = 1 << 30
MIB = 1 << 20


def snap(**kw: object) -> GroupSnapshot:
    return GroupSnapshot(group_count=14, **kw)  # type: ignore[arg-type]


def test_destroy_waits_the_full_time_right_after_destroying() -> None:
    d = DestroyPolicy().before_pause(snap())
    assert (d.action, d.wait_s, d.wait_point) == (GroupAction.DESTROY, 2.0, WaitPoint.AFTER_DESTROY)
    assert "14 groups" in d.reason


def test_deferred_cooldown_moves_the_wait_to_the_next_rebuild() -> None:
    d = DeferredCooldownPolicy(DeferredCooldownPolicy.Config(post_destroy_wait_s=0.5)).before_pause(snap())
    assert (d.action, d.wait_s, d.wait_point) == (GroupAction.DESTROY, 0.5, WaitPoint.BEFORE_REBUILD)


def test_keep_alive_keeps_and_carries_its_canary_timeout() -> None:
    d = KeepAlivePolicy(KeepAlivePolicy.Config(canary_timeout_s=7)).before_pause(snap(resident_bytes=GIB))
    assert (d.action, d.canary_timeout_s) == (GroupAction.KEEP, 7)
    assert "1.00 GiB" in d.reason


def test_keep_alive_after_a_failure_destroys_with_no_wait() -> None:
    d = KeepAlivePolicy().before_pause(snap(keep_alive_disabled=True))
    assert (d.action, d.wait_s) == (GroupAction.DESTROY, 0.0)


@pytest.mark.parametrize(
    ("resident", "action"),
    [
        (3 * GIB, GroupAction.KEEP),
        (4 * GIB, GroupAction.KEEP),
        (4 * GIB + 1, GroupAction.DESTROY),
        (None, GroupAction.DESTROY),
    ],
)
def test_auto_keeps_only_within_its_measured_budget(resident: int | None, action: GroupAction) -> None:
    policy = AutoPolicy(AutoPolicy.Config(max_resident_gib=4, post_destroy_wait_s=1.5))
    d = policy.before_pause(snap(resident_bytes=resident))
    assert d.action == action
    if action == GroupAction.DESTROY:
        # auto's other branch is deferred_cooldown, never the expensive on-the-spot wait.
        assert (d.wait_s, d.wait_point) == (1.5, WaitPoint.BEFORE_REBUILD)


def test_auto_never_keeps_once_keep_alive_was_disabled() -> None:
    d = AutoPolicy(AutoPolicy.Config(max_resident_gib=100)).before_pause(
        snap(resident_bytes=0, keep_alive_disabled=True)
    )
    assert d.action == GroupAction.DESTROY


def test_suspend_asks_for_suspend_and_carries_the_fallback() -> None:
    d = SuspendPolicy(SuspendPolicy.Config(fallback="destroy", post_destroy_wait_s=1)).before_pause(snap())
    assert d.action == GroupAction.SUSPEND
    assert d.fallback is not None
    assert (d.fallback.action, d.fallback.wait_s, d.fallback.wait_point) == (
        GroupAction.DESTROY,
        1,
        WaitPoint.AFTER_DESTROY,
    )


@pytest.mark.parametrize(
    ("fallback", "action"),
    [
        ("destroy", GroupAction.DESTROY),
        ("deferred_cooldown", GroupAction.DESTROY),
        ("keep_alive", GroupAction.KEEP),
    ],
)
def test_suspend_unsupported_uses_the_configured_fallback_and_says_so(
    fallback: str, action: GroupAction
) -> None:
    d = SuspendPolicy(SuspendPolicy.Config(fallback=fallback)).before_pause(snap(suspend_supported=False))  # type: ignore[arg-type]
    assert d.action == action
    assert "suspend unavailable" in d.reason


@pytest.mark.parametrize(
    "policy",
    [DestroyPolicy(DestroyPolicy.Config(rebuild="split_shared")),  # type: ignore[arg-type]
     DeferredCooldownPolicy(DeferredCooldownPolicy.Config(rebuild="split_shared")),  # type: ignore[arg-type]
     AutoPolicy(AutoPolicy.Config(max_resident_gib=0.25, rebuild="split_shared")),  # type: ignore[arg-type]
     SuspendPolicy(SuspendPolicy.Config(fallback="destroy", rebuild="split_shared"))],  # type: ignore[arg-type]
    ids=["destroy", "deferred_cooldown", "auto", "suspend-fallback"],
)
def test_split_shared_rebuild_is_opt_in_and_travels_with_every_destroy(policy: object) -> None:
    d = policy.before_pause(snap(resident_bytes=4 * GIB, suspend_supported=False))  # type: ignore[attr-defined]
    assert (d.action, d.rebuild) == (GroupAction.DESTROY, RebuildMode.SPLIT_SHARED)
    assert DestroyPolicy().before_pause(snap()).rebuild == RebuildMode.SEPARATE  # the default


def test_directives_round_trip_through_json() -> None:
    d = SuspendPolicy().before_pause(snap())
    assert GroupDirective.model_validate_json(d.model_dump_json()) == d


def test_policies_are_pure_same_snapshot_same_decision() -> None:
    s = snap(resident_bytes=2 * GIB)
    for policy in (
        DestroyPolicy(),
        DeferredCooldownPolicy(),
        KeepAlivePolicy(),
        SuspendPolicy(),
        AutoPolicy(AutoPolicy.Config(max_resident_gib=3)),
    ):
        assert policy.before_pause(s) == policy.before_pause(s)


def test_overlap_plans_two_4_gib_buckets_over_cuda_ipc_even_where_per_tensor_is_loaded() -> None:
    plan = OverlapPolicy().plan(
        PipelineSnapshot(available_transports=(Transport.SHM, Transport.CUDA_IPC, Transport.PER_TENSOR))
    )
    # The tuned preset of `python3 -m benchmarks.switch`: fresh buckets, so nothing stays exported through the rollout.
    assert (plan.depth, plan.bucket_bytes, plan.transport) == (2, 4096 * MIB, Transport.CUDA_IPC)


def test_auto_never_picks_a_transport_only_a_document_may_name() -> None:
    per_tensor_only = PipelineSnapshot(available_transports=(Transport.PER_TENSOR,))
    assert OverlapPolicy().plan(per_tensor_only).transport is Transport.DISK
    named = OverlapPolicy(OverlapPolicy.Config(transport=Transport.PER_TENSOR)).plan(per_tensor_only)
    assert named.transport is Transport.PER_TENSOR


def test_serial_is_depth_one() -> None:
    assert SerialPolicy().plan(PipelineSnapshot()).depth == 1


def test_an_unavailable_transport_falls_back_with_a_reason() -> None:
    policy = OverlapPolicy(OverlapPolicy.Config(transport=Transport.CUDA_IPC))
    plan = policy.plan(PipelineSnapshot(available_transports=(Transport.SHM,)))
    assert plan.transport == Transport.SHM
    assert "cuda_ipc not available" in plan.reason


def test_pipeline_never_stages_more_gpu_memory_than_is_free() -> None:
    policy = OverlapPolicy(OverlapPolicy.Config(depth=4, bucket_mb=1024))
    plan = policy.plan(PipelineSnapshot(available_transports=(Transport.CUDA_IPC,), free_bytes=1 * GIB))
    assert plan.depth * plan.bucket_bytes <= GIB


def test_the_memory_guard_keeps_the_overlap_and_shrinks_buckets_to_what_is_free() -> None:
    policy = OverlapPolicy(OverlapPolicy.Config(depth=3, bucket_mb=2048))
    plan = policy.plan(PipelineSnapshot(available_transports=(Transport.CUDA_IPC,), total_bytes=16 * GIB,
                                        free_bytes=3 * GIB))
    assert (plan.depth, plan.bucket_bytes) == (3, GIB)
    assert "bucket shrunk to fit 3 in 3072 MiB free GPU memory" in plan.reason


def test_the_memory_guard_gives_up_depth_before_going_below_1_mib_per_chunk() -> None:
    policy = OverlapPolicy(OverlapPolicy.Config(depth=4, bucket_mb=512))
    plan = policy.plan(PipelineSnapshot(available_transports=(Transport.CUDA_IPC,), free_bytes=2 * MIB))
    assert (plan.depth, plan.bucket_bytes) == (2, MIB)


def test_a_bucket_shrunk_by_the_guard_can_still_keep_several_chunks_in_flight() -> None:
    # A 24 MiB sync would be one 24 MiB chunk; with 6 MiB free it becomes 8 chunks, 2 in flight.
    plan = OverlapPolicy(OverlapPolicy.Config(depth=2)).plan(PipelineSnapshot(
        available_transports=(Transport.CUDA_IPC,), total_bytes=24 * MIB, free_bytes=6 * MIB))
    assert (plan.depth, plan.bucket_bytes) == (2, 3 * MIB)


def test_host_memory_transports_are_not_bounded_by_free_gpu_memory() -> None:
    policy = OverlapPolicy(OverlapPolicy.Config(depth=2, bucket_mb=512))
    plan = policy.plan(PipelineSnapshot(available_transports=(Transport.SHM,), free_bytes=MIB))
    assert (plan.depth, plan.bucket_bytes) == (2, 512 * MIB)


def test_a_gpu_staged_plan_without_a_free_memory_reading_says_it_is_unbounded() -> None:
    plan = OverlapPolicy().plan(PipelineSnapshot(available_transports=(Transport.CUDA_IPC,)))
    assert "free GPU memory unknown" in plan.reason


def test_small_syncs_get_small_buckets_and_no_useless_depth() -> None:
    plan = OverlapPolicy(OverlapPolicy.Config(depth=8)).plan(PipelineSnapshot(total_bytes=100 * MIB))
    assert (plan.bucket_bytes, plan.depth) == (100 * MIB, 1)


def test_cleanup_plans() -> None:
    assert EmptyCachePolicy().plan().steps == (CleanupAction.EMPTY_CACHE,)
    aggressive = AggressiveCleanupPolicy().plan()
    assert aggressive.steps == (CleanupAction.GC_COLLECT, CleanupAction.SYNCHRONIZE, CleanupAction.EMPTY_CACHE)
    assert (aggressive.max_retries, aggressive.min_freed_bytes) == (3, GIB)
    assert NoCleanupPolicy().plan().steps == ()


def test_timeouts_fall_back_to_the_default() -> None:
    t = Timeouts(default_s=10, release_s=None, chunk_s=99)
    assert (t.budget(Budget.RELEASE), t.budget(Budget.CHUNK)) == (10, 99)


def test_every_timeout_step_has_its_field_and_every_field_a_step() -> None:
    steps = {f"{s.value}_s" for s in Budget}
    assert set(Timeouts.model_fields) - {"default_s"} == steps


def test_a_document_overrides_only_the_timeouts_it_sets() -> None:
    node = Timeouts(default_s=20, chunk_s=7, health_interval_s=2)
    document = Timeouts(chunk_s=3, resume_s=None)
    merged = document.over(node)
    assert merged.budget(Budget.CHUNK) == 3  # the document's
    assert merged.budget(Budget.HEALTH_INTERVAL) == 2  # left out: the node's
    assert merged.budget(Budget.RELEASE) == 20  # unset in both: the node's default_s
    assert Timeouts().over(node) == node


def test_a_timeout_key_that_names_no_budget_is_refused() -> None:
    with pytest.raises(ValidationError, match="health_s"):
        Timeouts.model_validate({"health_s": 9})


def test_a_policy_refuses_a_config_of_another_policy() -> None:
    with pytest.raises(TypeError, match="needs a Config"):
        DestroyPolicy(KeepAlivePolicy.Config())
