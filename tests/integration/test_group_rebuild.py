"""GroupLifecycle in one gloo process: ``rebuild: split_shared`` where it cannot apply (separate groups come back,
and the report says why), and a pause that tears every group down at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from colocd.policies import GroupDirective, RebuildMode, WaitPoint
from colocd.trainer import groups as groups_module
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


def test_a_pause_destroys_every_group_at_once_and_the_rebuild_brings_working_groups_back(
    one_rank_world: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    specs = [GroupSpec(f"g#{i}", (0,)) for i in range(3)]
    # Each destroy goes on only once all three have begun: one after another, the first would wait out the
    # barrier's timeout and find it broken.
    together = threading.Barrier(len(specs), timeout=10)
    met: list[bool] = []
    destroy = groups_module._destroy

    def destroy_once_all_began(group: dist.ProcessGroup) -> None:
        try:
            together.wait()
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)
        destroy(group)

    monkeypatch.setattr(groups_module, "_destroy", destroy_once_all_began)
    with GroupLifecycle(specs, device=torch.device("cpu")) as life:
        life.build()
        pause = life.pause(GroupDirective.destroy("destroy", "test"))
        assert met == [True] * len(specs)
        assert "destroyed 3 groups" in pause.actions
        monkeypatch.setattr(groups_module, "_destroy", destroy)  # close() destroys the rebuilt ones
        assert life.resume().action == "rebuild"
        for _spec, group in life.groups():
            probe = torch.ones(1)
            dist.all_reduce(probe, group=group)
            assert probe.item() == 1.0
