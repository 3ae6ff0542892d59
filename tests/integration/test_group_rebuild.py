"""``rebuild: split_shared`` where it cannot apply (CPU, gloo): separate groups come back, and the report says why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from colocd.policies import GroupDirective, RebuildMode, WaitPoint
from colocd.trainer.groups import GroupLifecycle, GroupSpec, SuspendCapability


@pytest.fixture
def one_rank_world() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is initialised already in this process")
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported by torch.distributed, not declared
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_split_shared_on_gloo_rebuilds_separate_groups_and_says_why_in_one_line(one_rank_world: None) -> None:
    with GroupLifecycle([GroupSpec("tp#0", (0,)), GroupSpec("dp#1", (0,))], device=torch.device("cpu")) as life:
        life.build()
        directive = GroupDirective.destroy("auto", "test", wait_point=WaitPoint.BEFORE_REBUILD,
                                           rebuild=RebuildMode.SPLIT_SHARED)
        life.pause(directive)
        report = life.resume()

        assert report.action == "rebuild"
        reason = report.fallback_reason
        assert reason is not None and "\n" not in reason
        assert "split_shared unavailable" in reason and "CPU" in reason
        assert reason in report.actions
        for _spec, group in life.groups():  # separate communicators that work
            probe = torch.ones(1)
            dist.all_reduce(probe, group=group)
            assert probe.item() == 1.0


def test_a_separate_rebuild_reports_no_fallback(one_rank_world: None) -> None:
    with GroupLifecycle([GroupSpec("tp#0", (0,))], device=torch.device("cpu")) as life:
        life.build()
        life.pause(GroupDirective.destroy("destroy", "test"))
        report = life.resume()
        assert (report.action, report.fallback_reason) == ("rebuild", None)


def test_a_split_that_fails_leaves_nothing_half_made_and_rebuilds_separate_groups(
    one_rank_world: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_parent(self: GroupLifecycle) -> str:
        raise RuntimeError("ncclCommSplit refused\nsecond line")

    monkeypatch.setattr(GroupLifecycle, "_make_parent", no_parent)
    with GroupLifecycle([GroupSpec("tp#0", (0,))], device=torch.device("cpu")) as life:
        life._split = SuspendCapability(True, "pretend this process can split")  # what a CUDA box would find
        life.build()
        life.pause(GroupDirective.destroy("destroy", "test", rebuild=RebuildMode.SPLIT_SHARED))
        report = life.resume()

        reason = report.fallback_reason
        assert reason is not None and "\n" not in reason
        assert "split_shared failed" in reason and "ncclCommSplit refused" in reason
        [(_spec, group)] = list(life.groups())
        probe = torch.ones(1)
        dist.all_reduce(probe, group=group)
        assert probe.item() == 1.0
