"""The weight session's hot calls: their replies (open, commit) are encoded by the route itself (api/app.py
``_json_reply``) and must still be what their documented models say; the trainer's lease report, which nobody waits
on, never travels beside the commit that follows the stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import torch
from support import InMemoryEngine, daemon_node

from colocd.api.app import _json_reply
from colocd.api.schemas import OpenSessionReply
from colocd.trainer.push import WeightPusher


async def _synced_node_replies() -> tuple[dict[str, Any], dict[str, Any]]:
    """The open and commit replies of one empty session over HTTP."""
    async with daemon_node(adapters={"e0": InMemoryEngine("e0")}, synced_at=1) as node:
        client = node.client
        opened = await client.open_session("v1", ranks=1)
        return opened, await client.commit(opened["session_id"], 0)


async def test_the_open_reply_has_exactly_the_fields_of_its_documented_model() -> None:
    opened, _ = await _synced_node_replies()
    assert list(opened) == list(OpenSessionReply.model_fields)
    assert OpenSessionReply.model_validate(opened).model_dump(mode="json") == opened
    assert opened["transports"] and all(isinstance(t, str) for t in opened["transports"])


async def test_the_commit_reply_carries_the_session_the_engines_the_verification_and_the_trace() -> None:
    opened, committed = await _synced_node_replies()
    assert committed["id"] == opened["session_id"] and committed["state"] == "committed"
    assert set(committed) >= {"broadcasts", "engines", "verification", "trace"}
    assert committed["engines"]["e0"]["weight_version"] == "v1"
    assert committed["trace"]["outcome"] == "committed"


def test_a_reply_encodes_nan_as_null_and_leaves_what_json_cannot_carry_to_the_framework() -> None:
    encoded = _json_reply({"seconds": math.nan, "tags": ("a", "b")})
    assert not isinstance(encoded, dict)
    assert json.loads(bytes(encoded.body)) == {"seconds": None, "tags": ["a", "b"]}
    odd = {"value": object()}
    assert _json_reply(odd) is odd


class ReportWaitingEngine(InMemoryEngine):
    """Ends its update session only once a lease report reached the daemon, or after a while: a commit that lasts
    long enough for a report sent beside it to arrive meanwhile (a real engine's end takes milliseconds)."""

    def __init__(self, reported: asyncio.Event) -> None:
        super().__init__("e0")
        self.reported = reported

    async def end_weight_update(self, version: str | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.reported.wait(), 0.3)
        self.reported.clear()
        await super().end_weight_update(version)


def _request_log(app: Any, log: list[tuple[str, str, float]], reported: asyncio.Event) -> Any:
    """``app`` noting when each POST arrives and when its reply went out; ``reported`` set as a lease report
    arrives."""
    async def logged(scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                     send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        log.append(("in", scope["path"], time.perf_counter()))
        if scope["path"] == "/v1/trainer/leases":
            reported.set()

        async def noted(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                log.append(("out", scope["path"], time.perf_counter()))
        await app(scope, receive, noted)
    return logged


async def test_the_lease_report_after_a_stream_waits_for_the_commit_reply_instead_of_riding_beside_it() -> None:
    log: list[tuple[str, str, float]] = []
    reported = asyncio.Event()
    engine = ReportWaitingEngine(reported)
    named = [(f"layers.{i}.weight", torch.zeros(64, 64)) for i in range(4)]
    async with daemon_node(adapters={"e0": engine}, wrap=lambda app: _request_log(app, log, reported),
                           synced_at=1) as node:
        client = node.client
        async with WeightPusher(client, transport="inline", bucket_mb=0.02) as pusher:
            commits: list[tuple[float, float]] = []  # each commit's call, as the trainer saw it
            commit = client.commit

            async def timed_commit(*args: Any) -> dict[str, Any]:
                t0 = time.perf_counter()
                try:
                    return await commit(*args)
                finally:
                    commits.append((t0, time.perf_counter()))

            client.commit = timed_commit  # type: ignore[method-assign]
            await pusher.push(named, version="v1")
            await client.phase("rollout", 1)
            await client.phase("train", 2)
            await client.phase("sync", 2)
            await pusher.push(named, version="v2", step=2)
        await client.idle()
    reports = [t for kind, path, t in log if kind == "in" and path == "/v1/trainer/leases"]
    assert reports, "the pusher reports its leases"
    assert len(commits) == 2
    assert not [t for t in reports for start, end in commits if start <= t <= end], (reports, commits)
