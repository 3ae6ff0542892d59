"""``ClusterClient``: one step across every node's daemon at once, with one node's failure failing the step.

Each call fans out concurrently and returns every node's reply; if any node failed, ``ClusterStepError`` is raised
once every node has answered, naming each failed node, the engine its daemon blamed and the daemon's reason. A
failed push aborts every session still open; ``rollout`` is refused before any node resumes unless every engine of
every node holds the step's version clean (docs/deploy.md, "What a step does across nodes"). Needs no ray or torch."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..api.client import AsyncColocdClient
from ..errors import ColocdError, ColocdHTTPError, DaemonUnreachable

__all__ = ["ClusterClient", "ClusterStepError", "NodeFailure", "NodeResult", "StepResult", "failure_of"]

@dataclass(frozen=True, slots=True)
class NodeFailure:
    """Why one node failed a call: the daemon's error class and message, and the engine it blamed."""

    node_id: str
    error: str  # the daemon's error class (TransitionRejected, EngineUnreachable, ...) or the exception's
    message: str
    status: int | None = None  # HTTP status when the daemon answered; None when it could not be reached
    engine: str | None = None

    def describe(self) -> str:
        where = f"node {self.node_id}" + (f" engine {self.engine}" if self.engine else "")
        code = f" ({self.status})" if self.status is not None else ""
        return f"{where}: {self.error}{code}: {self.message}"


@dataclass(frozen=True, slots=True)
class NodeResult:
    node_id: str
    seconds: float
    body: Any = None  # the daemon's reply (or the push's return value) when it succeeded
    failure: NodeFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass(frozen=True, slots=True)
class StepResult:
    """Every node's answer to one fan-out, and the wall time of the whole fan-out."""

    what: str  # e.g. "train@3", "sync@3", "rollout@3"
    nodes: dict[str, NodeResult]
    seconds: float
    notes: list[str] = field(default_factory=list)  # what was done to the other nodes after a failure

    @property
    def failures(self) -> list[NodeFailure]:
        return [r.failure for r in self.nodes.values() if r.failure is not None]

    @property
    def ok(self) -> bool:
        return not self.failures


class ClusterStepError(ColocdError):
    """A fan-out failed on at least one node; ``result`` has every node's answer."""

    def __init__(self, result: StepResult) -> None:
        self.result = result
        failed = result.failures
        lines = [f"{result.what} failed on {len(failed)} of {len(result.nodes)} nodes:"]
        lines += [f"  {f.describe()}" for f in failed]
        lines += [f"  {note}" for note in result.notes]
        super().__init__("\n".join(lines))


def _unwrap(exc: BaseException) -> BaseException:
    # A Ray task error keeps the trainer's own exception as ``cause``; follow it to the daemon's answer.
    seen = 0
    while (cause := getattr(exc, "cause", None)) is not None and isinstance(cause, BaseException) and seen < 8:
        exc, seen = cause, seen + 1
    return exc


def failure_of(node_id: str, exc: BaseException) -> NodeFailure:
    """A ``NodeFailure`` from whatever a call to that node raised (the daemon's error body when it answered)."""
    exc = _unwrap(exc)
    if isinstance(exc, ColocdHTTPError):
        body = exc.body
        return NodeFailure(node_id, str(body.get("error") or exc.error), str(body.get("message") or exc),
                           exc.status, body.get("engine") or None)
    if isinstance(exc, DaemonUnreachable):
        return NodeFailure(node_id, "DaemonUnreachable", f"{type(exc).__name__}: {exc}".rstrip(": "))
    if isinstance(exc, TimeoutError):
        return NodeFailure(node_id, "Timeout", str(exc) or "no answer within the cluster client's deadline")
    return NodeFailure(node_id, type(exc).__name__, str(exc))


class ClusterClient:
    """Fans calls out to a set of daemons, ``{node_id: url}``; ``set_nodes`` changes the set between steps.
    ``max_concurrency`` bounds the requests in flight (and so the open connections); ``timeout_s`` one node's call."""

    def __init__(self, daemons: Mapping[str, str], *, token: str | None = None, timeout_s: float = 600.0,
                 max_concurrency: int = 256) -> None:
        self._token = token
        self._timeout_s = timeout_s
        self._window = asyncio.Semaphore(max_concurrency)
        self._clients = {n: AsyncColocdClient(url, token=token, timeout_s=timeout_s) for n, url in daemons.items()}
        self._urls = dict(daemons)
        # The version the last sync at each step set out to commit: rollout needs it on every engine.
        self._target: dict[int, str] = {}

    @property
    def nodes(self) -> dict[str, str]:
        return dict(self._urls)

    async def set_nodes(self, daemons: Mapping[str, str]) -> tuple[list[str], list[str]]:
        """Replace the set of daemons; returns (joined, left). Call it between steps, not during one."""
        joined = sorted(set(daemons) - set(self._urls))
        left = sorted(set(self._urls) - set(daemons))
        moved = sorted(n for n in set(daemons) & set(self._urls) if daemons[n] != self._urls[n])
        await asyncio.gather(*(self._clients.pop(n).aclose() for n in left + moved), return_exceptions=True)
        for node in joined + moved:
            self._clients[node] = AsyncColocdClient(daemons[node], token=self._token, timeout_s=self._timeout_s)
        self._urls = dict(daemons)
        return joined, left

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()), return_exceptions=True)
        self._clients.clear()

    async def __aenter__(self) -> ClusterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def fan_out(self, what: str, call: Callable[[str, AsyncColocdClient], Awaitable[Any]],
                      nodes: Iterable[str] | None = None) -> StepResult:
        """Run ``call(node_id, client)`` on every node (or ``nodes``) concurrently; never raises for a node."""
        targets = sorted(self._clients) if nodes is None else sorted(nodes)

        async def one(node: str) -> NodeResult:
            async with self._window:
                t0 = time.perf_counter()
                try:
                    async with asyncio.timeout(self._timeout_s):
                        body = await call(node, self._clients[node])
                except Exception as exc:  # every node answers; one node's failure is data, not a crash
                    return NodeResult(node, time.perf_counter() - t0, failure=failure_of(node, exc))
                return NodeResult(node, time.perf_counter() - t0, body=body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(n) for n in targets))
        return StepResult(what, {r.node_id: r for r in results}, time.perf_counter() - t0)

    async def phase(self, phase: str, step: int, *, trainer: dict[str, Any] | None = None) -> StepResult:
        """One phase transition on every node. ``rollout`` goes through ``rollout()`` (its cluster-wide check)."""
        if phase == "rollout":
            return await self.rollout(step)
        result = await self.fan_out(f"{phase}@{step}", lambda _, c: c.phase(phase, step, trainer=trainer))
        return _checked(result)

    async def status(self) -> StepResult:
        return await self.fan_out("status", lambda _, c: c.status())

    async def sync(self, step: int, version: str, push: Callable[[str], Awaitable[Any]]) -> StepResult:
        """Enter ``sync`` everywhere, then run ``push(node_id)`` (e.g. a Ray actor call on a trainer rank of that
        node; its value is the node's result body) for every node whose engines do not all hold ``version`` clean
        (a redo costs only the failed nodes), concurrently. On any failure, sessions still open are aborted and
        ``ClusterStepError`` says which nodes hold ``version`` (paused)."""
        self._target[step] = version
        await self.phase("sync", step)
        status = await self.status()
        skipped = sorted(n for n, r in status.nodes.items() if r.ok and not _version_gaps(r.body, version))
        targets = [n for n in self._clients if n not in skipped]

        async def one(node: str, _: AsyncColocdClient) -> Any:
            started = push(node)
            return await started if inspect.isawaitable(started) else started

        result = await self.fan_out(f"sync@{step}", one, targets)
        for node in skipped:
            result.nodes[node] = NodeResult(node, 0.0, body={"skipped": f"engines already hold {version}"})
        if result.ok:
            return result
        aborted = await self._abort_open_sessions()
        status = await self.status()
        holding = sorted(n for n, r in status.nodes.items() if r.ok and not _version_gaps(r.body, version))
        missing = sorted(n for n in status.nodes if n not in holding)
        result.notes.append(f"nodes holding {version} (paused in sync, not serving): {holding or 'none'}")
        result.notes.append(f"nodes without a complete {version}: {missing}")
        if aborted:
            result.notes.append(f"open weight sessions aborted on: {aborted}")
        result.notes.append(f"rollout@{step} is refused on every node until sync@{step} is redone and completes")
        raise ClusterStepError(result)

    async def rollout(self, step: int, *, version: str | None = None) -> StepResult:
        """Resume generation everywhere, only if every engine on every node holds one complete version (``version``;
        default: the last ``sync`` at this step through this client; with neither, any one they all agree on).
        Refused before any node is touched."""
        expected = version or self._target.get(step)
        status = await self.status()
        gaps = [r.failure for r in status.nodes.values() if r.failure is not None]
        versions = {e.get("weight_version") for r in status.nodes.values() if r.ok
                    for e in r.body.get("engines", {}).values()}
        if expected is None:
            expected = versions.pop() if len(versions) == 1 else None
        if expected is None:
            gaps.append(NodeFailure("*", "NoCompleteSync",
                                    f"no sync at step {step} through this client, and the engines hold "
                                    f"different versions {sorted(map(str, versions))}: redo sync@{step}"))
        else:
            for node, r in status.nodes.items():
                if r.ok:
                    gaps += [NodeFailure(node, "SyncIncomplete", reason, None, engine or None)
                             for engine, reason in _version_gaps(r.body, expected)]
        if gaps:
            refused = StepResult(f"rollout@{step}", {**{n: r for n, r in status.nodes.items() if r.ok},
                                                     **{f.node_id: NodeResult(f.node_id, 0.0, failure=f)
                                                        for f in gaps}}, status.seconds)
            refused.notes.append(f"refused before any node resumed: every node must hold {expected or 'one version'}"
                                 f"; redo sync@{step}")
            raise ClusterStepError(refused)
        return _checked(await self.fan_out(f"rollout@{step}", lambda _, c: c.phase("rollout", step)))

    async def _abort_open_sessions(self) -> list[str]:
        """Abort every weight session still open on any node; returns the nodes where one was."""
        async def abort(_: str, c: AsyncColocdClient) -> bool:
            session = (await c.status()).get("weight_session") or {}
            if session.get("state") != "open":
                return False
            try:
                await c.abort(str(session["id"]))
            except ColocdHTTPError as exc:
                if exc.status != 410:  # already gone: it ended on its own meanwhile
                    raise
            return True

        result = await self.fan_out("abort", abort)
        return sorted(n for n, r in result.nodes.items() if r.ok and r.body)


def _checked(result: StepResult) -> StepResult:
    if not result.ok:
        raise ClusterStepError(result)
    return result


def _version_gaps(status: dict[str, Any], version: str) -> list[tuple[str, str]]:
    """(engine, why) for each engine on a node that does not hold ``version`` completely."""
    gaps = []
    for name, engine in (status.get("engines") or {}).items():
        if engine.get("weight_version") != version or engine.get("weights") != "clean":
            gaps.append((name, f"holds {engine.get('weight_version')!r} ({engine.get('weights')}), "
                               f"not a complete {version!r}"))
    session = status.get("weight_session") or {}
    if session.get("state") == "open":
        gaps.append(("", f"weight session {session.get('id')} still open"))
    return gaps

