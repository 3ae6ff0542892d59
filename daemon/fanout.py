"""One call per engine, run concurrently: the daemon's only way to act on several engines at once.

Three ways to end, because engines fail in three kinds of step:

- ``SETTLE``: every call runs to its end, then the first failure (in engine order) is raised. For the
  handoff steps: a call cut short would leave that engine's recorded state unlike the engine, and a
  call still running after the node's lock is released would race the next transition.
- ``CANCEL``: the first failure cancels the calls still running and is raised. For collectives (joining
  a weight-update group, receiving a broadcast): the others wait on a peer that will never come.
- ``COLLECT``: nothing is raised; each engine's result or exception is returned. For best-effort
  cleanup after a failure, which must not hide the error that led to it.

An exception that is not an ``Exception`` (cancellation of the caller) propagates as such.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from enum import StrEnum
from typing import Protocol, TypeVar

from ..errors import ColocdError, EngineError, TransitionFailed
from .metrics import Metrics

__all__ = ["OnFailure", "each_engine", "fan_out"]


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)
R = TypeVar("R")


class OnFailure(StrEnum):
    SETTLE = "settle"  # wait for all, then raise the first failure
    CANCEL = "cancel"  # cancel the rest at the first failure and raise it
    COLLECT = "collect"  # wait for all, raise nothing: failures are returned


async def fan_out(targets: Iterable[T], call: Callable[[T], Awaitable[R]], *,
                  on_failure: OnFailure) -> dict[str, R | Exception]:
    """Run ``call(target)`` for every target concurrently; return each one's result by ``target.name``,
    in the targets' order. Only ``COLLECT`` returns exceptions; the others raise the first failure."""
    items = list(targets)
    outcomes: dict[str, R | Exception] = {}
    first: list[Exception] = []  # the first failure, in the order failures happened (CANCEL)

    async def one(target: T) -> None:
        try:
            outcomes[target.name] = await call(target)
        except Exception as exc:
            outcomes[target.name] = exc
            if on_failure is OnFailure.CANCEL:
                first.append(exc)
                raise

    failure: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as group:
            for target in items:
                group.create_task(one(target))
    except BaseExceptionGroup as grouped:
        # Only CANCEL lets an Exception out of one(); anything else in the group is not an Exception.
        fatal = [e for e in grouped.exceptions if not isinstance(e, Exception)]
        failure = fatal[0] if fatal else first[0]
    if failure is not None:
        raise failure  # outside the handler: the engine's error, not chained to the group
    if any(t.name not in outcomes for t in items):
        raise asyncio.CancelledError("an engine call was cancelled from outside the fan-out")
    ordered = {t.name: outcomes[t.name] for t in items}
    if on_failure is OnFailure.SETTLE:
        for outcome in ordered.values():
            if isinstance(outcome, Exception):
                raise outcome
    return ordered


async def each_engine(engines: Iterable[T], work: Callable[[T], Awaitable[R]], *, operation: str,
                      metrics: Metrics) -> dict[str, R]:
    """One operation's work on every engine (``SETTLE``: none is left running outside the node's lock), each
    engine's time recorded under ``operation`` (a phase, sleep, resume; the metric's label is ``phase``); a
    failure that is neither ours nor an engine's becomes ``TransitionFailed`` naming the operation."""
    async def timed(engine: T) -> R:
        t0 = time.perf_counter()
        try:
            return await work(engine)
        finally:
            if operation != "weights":  # a session's time is observed once, when it ends (daemon/trace.py)
                metrics.observe_phase(operation, engine.name, time.perf_counter() - t0)

    try:
        results = await fan_out(engines, timed, on_failure=OnFailure.SETTLE)
    except (ColocdError, EngineError):
        raise
    except Exception as exc:
        raise TransitionFailed(f"{operation}: {type(exc).__name__}: {exc}") from exc
    return results  # type: ignore[return-value]  # SETTLE raised every failure

