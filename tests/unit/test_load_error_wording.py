"""What a chunk's engine call reports when it did not finish: the cause, not the mechanism."""

from __future__ import annotations

import asyncio

from colocd.daemon.weights import _load_error


def test_a_load_cancelled_because_the_session_failed_names_the_chunk_timeout_not_the_cancellation() -> None:
    ended = "failed: ChunkTimeout: chunk 3 not consumed by engine 'e0' within its 5.0s budget"
    error = _load_error("e0", 3, asyncio.CancelledError(), ended=ended)
    assert "ChunkTimeout" in str(error) and "CancelledError" not in str(error)
    assert str(error).startswith("chunk 3 on engine 'e0': cancelled, the session failed")


def test_an_engine_error_is_reported_as_it_is() -> None:
    error = _load_error("e0", 3, RuntimeError("boom"), ended="failed: ChunkTimeout: ...")
    assert str(error) == "chunk 3 on engine 'e0': boom"
