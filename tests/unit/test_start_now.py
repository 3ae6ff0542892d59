"""``daemon.fanout.start_now``: a task whose first step runs inside the call where Python has eager tasks (3.12+)."""

from __future__ import annotations

import asyncio

from colocd.daemon.fanout import EAGER, start_now


async def test_the_first_step_runs_at_once_on_eager_pythons_and_on_the_next_pass_otherwise() -> None:
    steps: list[str] = []
    release = asyncio.Event()

    async def work() -> str:
        steps.append("first step")
        await release.wait()
        steps.append("after the wait")
        return "done"

    task = start_now(work())
    assert steps == (["first step"] if EAGER else [])
    await asyncio.sleep(0)
    assert steps == ["first step"]  # either way it runs up to its first wait, and no further
    release.set()
    assert await task == "done" and steps == ["first step", "after the wait"]


async def test_a_coroutine_that_never_waits_is_a_finished_task_with_its_result() -> None:
    async def instant() -> int:
        return 7

    task = start_now(instant())
    assert await task == 7 and task.done()
