"""The fan-out helper as a specification: every engine's call runs at once; how it ends depends on the mode."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from colocd.daemon.fanout import OnFailure, each_engine, fan_out
from colocd.daemon.metrics import Metrics
from colocd.errors import TransitionFailed


@dataclass(frozen=True)
class Target:
    name: str


A, B, C = Target("a"), Target("b"), Target("c")


class Boom(Exception):
    pass


async def test_every_call_runs_concurrently_and_results_come_back_by_name_in_target_order() -> None:
    started: list[str] = []
    all_started = asyncio.Event()

    async def call(t: Target) -> str:
        started.append(t.name)
        if len(started) == 3:
            all_started.set()
        await asyncio.wait_for(all_started.wait(), 5)  # only returns if all three run at once
        return t.name.upper()

    for mode in OnFailure:
        started.clear()
        all_started.clear()
        results = await fan_out([C, A, B], call, on_failure=mode)
        assert list(results.items()) == [("c", "C"), ("a", "A"), ("b", "B")]


async def test_no_targets_is_no_calls() -> None:
    async def call(t: Target) -> None:
        raise AssertionError("called")

    assert await fan_out([], call, on_failure=OnFailure.CANCEL) == {}


async def test_cancel_mode_raises_the_first_failure_and_cancels_the_calls_still_running() -> None:
    cancelled: list[str] = []
    release_b = asyncio.Event()

    async def call(t: Target) -> None:
        if t is A:
            raise Boom("a failed first")
        if t is B:
            await release_b.wait()
            raise Boom("b failed later")  # never reached: cancelled first
        try:
            await asyncio.sleep(3600)  # a peer waiting on a collective that will never complete
        except asyncio.CancelledError:
            cancelled.append(t.name)
            raise

    with pytest.raises(Boom, match="a failed first") as caught:
        async with asyncio.timeout(5):
            await fan_out([B, A, C], call, on_failure=OnFailure.CANCEL)
    assert cancelled == ["c"]
    assert not isinstance(caught.value, BaseExceptionGroup)  # the engine's own error, not a group


async def test_cancel_mode_raises_the_failure_that_happened_first_not_the_first_target() -> None:
    b_failed = asyncio.Event()

    async def call(t: Target) -> None:
        if t is A:
            await b_failed.wait()
            raise Boom("a")
        b_failed.set()
        raise Boom("b")

    with pytest.raises(Boom, match=r"^b$"):
        await fan_out([A, B], call, on_failure=OnFailure.CANCEL)


async def test_settle_mode_lets_every_call_finish_then_raises_the_first_failure_in_target_order() -> None:
    finished: list[str] = []
    gate = asyncio.Event()

    async def call(t: Target) -> str:
        if t is C:
            raise Boom("c")  # fails first in time
        await gate.wait() if t is A else gate.set()
        finished.append(t.name)
        if t is A:
            raise Boom("a")
        return t.name

    with pytest.raises(Boom, match=r"^a$"):
        await fan_out([A, B, C], call, on_failure=OnFailure.SETTLE)
    assert sorted(finished) == ["a", "b"]  # none was cut short by c's failure


async def test_collect_mode_raises_nothing_and_returns_each_failure() -> None:
    async def call(t: Target) -> str:
        if t is B:
            raise Boom("b")
        return t.name

    results = await fan_out([A, B, C], call, on_failure=OnFailure.COLLECT)
    assert results["a"] == "a" and results["c"] == "c"
    assert isinstance(results["b"], Boom)


async def test_cancelling_the_caller_cancels_every_call_in_every_mode() -> None:
    for mode in OnFailure:
        cancelled: list[str] = []
        running = asyncio.Event()

        async def call(t: Target, cancelled: list[str] = cancelled, running: asyncio.Event = running) -> None:
            running.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(t.name)
                raise

        task = asyncio.create_task(fan_out([A, B], call, on_failure=mode))
        await running.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(cancelled) == ["a", "b"], mode


class Fatal(BaseException):
    """Not an Exception (as cancellation or interpreter exit are not)."""


async def test_an_error_that_is_not_an_exception_propagates_as_itself() -> None:
    async def call(t: Target) -> None:
        if t is A:
            raise Fatal
        await asyncio.sleep(0)

    for mode in OnFailure:
        with pytest.raises(Fatal):
            await fan_out([A, B], call, on_failure=mode)


async def test_each_engine_times_every_engine_and_names_the_phase_of_a_foreign_failure() -> None:
    metrics = Metrics()

    async def step(t: Target) -> int:
        if t is B:
            raise ZeroDivisionError("bad arithmetic")
        return 1

    with pytest.raises(TransitionFailed, match=r"^train: ZeroDivisionError: bad arithmetic$"):
        await each_engine([A, B], step, operation="train", metrics=metrics)  # type: ignore[arg-type]
    timed = {s.labels["engine"]: s.value for m in metrics.phase_duration.collect() for s in m.samples
             if s.name.endswith("_count") and s.labels.get("phase") == "train" and s.labels["engine"] != "all"}
    assert timed == {"a": 1, "b": 1}  # the failing engine's time is recorded too
    assert await each_engine([A], step, operation="sync", metrics=metrics) == {"a": 1}  # type: ignore[arg-type]
