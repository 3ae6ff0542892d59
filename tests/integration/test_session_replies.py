"""The weight session's hot replies (open, commit) are encoded by the route itself (api/app.py ``_json_reply``): they
must still be what their documented models say."""

from __future__ import annotations

import json
import math
from typing import Any

from support import InMemoryEngine, serve_app

from colocd.api.app import _json_reply, create_app
from colocd.api.client import AsyncColocdClient
from colocd.api.schemas import OpenSessionReply
from colocd.daemon.config import NodeConfig
from colocd.daemon.node import Daemon


def _config() -> NodeConfig:
    return NodeConfig.model_validate({"engines": [{"kind": "sglang", "name": "e0", "url": "http://unused"}]})


async def _synced_node_replies() -> tuple[dict[str, Any], dict[str, Any]]:
    """The open and commit replies of one empty session over HTTP."""
    config = _config()
    async with (serve_app(create_app(config, daemon=Daemon(config, adapters={"e0": InMemoryEngine("e0")}))) as url,
                AsyncColocdClient(url) as client):
        await client.phase("train", 1)
        await client.phase("sync", 1)
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
