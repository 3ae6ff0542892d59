"""A weight session's open and commit as both of the daemon's front ends make them (the HTTP routes in
``api/app.py`` and the chunk channel in ``api/chunk_channel.py``): the same daemon call, the same reply."""

from __future__ import annotations

from typing import Any

import pydantic_core

from ..daemon.node import Daemon
from .schemas import CommitRequest, OpenSessionRequest

__all__ = ["commit_session", "encode_reply", "open_session"]


async def open_session(d: Daemon, body: OpenSessionRequest, chunk_channel: str | None) -> dict[str, Any]:
    """Open the session; the reply is ``OpenSessionReply``'s fields, in its order (tests/integration/
    test_session_replies.py holds the two to one set)."""
    manifest = None if body.manifest is None else [m.model_dump() for m in body.manifest]
    s = await d.sessions.open(step=body.step, version=body.version, ranks=body.ranks, depth=body.depth,
                              manifest=manifest, manifest_ref=body.manifest_ref, partial=body.partial)
    return {"session_id": s.id, "ranks": s.ranks, "depth": s.depth, "step": s.step, "version": s.version,
            "partial": s.partial, "idle_s": s.idle_s,
            "manifest_tensors": None if s.manifest is None else len(s.manifest), "manifest_ref": s.manifest_ref,
            "chunk_channel": chunk_channel, "transports": [t.value for t in s.transports()]}


async def commit_session(d: Daemon, session_id: str, body: CommitRequest | None) -> dict[str, Any]:
    return await d.sessions.commit(session_id, (body or CommitRequest()).num_chunks)


def encode_reply(content: dict[str, Any]) -> bytes | None:
    """``content`` as JSON in one pass of pydantic-core (NaN as null, as FastAPI would), without validating
    every nested value first; None where pydantic-core cannot encode a value as it is."""
    try:
        return pydantic_core.to_json(content, inf_nan_mode="null")
    except pydantic_core.PydanticSerializationError:
        return None
