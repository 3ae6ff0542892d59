"""Request and response bodies of colocd's HTTP API (pydantic); the daemon keeps its own dataclasses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..daemon.distributed import BroadcastDescriptor
from ..engines.base import MemoryTag
from ..engines.chunks import DTYPES

MAX_CHUNK_BYTES = 1 << 38  # 256 GiB: larger than any GPU's memory, so a larger nbytes is a mistake

__all__ = [
    "BroadcastRequest",
    "ChunkAckReply",
    "ChunkDescriptor",
    "CommitRequest",
    "ErrorReply",
    "ManifestEntry",
    "OpenSessionReply",
    "OpenSessionRequest",
    "OpenWeightGroupRequest",
    "PhaseRequest",
    "SleepRequest",
    "TransitionReply",
    "UpdateWeightsRequest",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PhaseRequest(_Strict):
    """The trainer's phase transition: rollout → train → sync → rollout, one step at a time."""

    step: int = Field(..., ge=0, description="training step; train needs a step beyond the current one")
    phase: Literal["train", "sync", "rollout"]
    trainer: dict[str, Any] | None = Field(
        None, description="what the trainer agent knows/did: {groups: GroupSnapshot, groups_report, spans}")


class SleepRequest(_Strict):
    tags: list[MemoryTag] | None = Field(None, description="tags to release/resume; default all owned")
    engines: list[str] | None = Field(None, description="engine names; default all")


class TransitionReply(BaseModel):
    step: int
    phase: str
    replayed: bool
    duration_s: float
    engines: dict[str, dict[str, Any]]
    freed_bytes: dict[str, dict[str, int]]
    directives: dict[str, Any]
    trace: dict[str, Any] | None


class ManifestEntry(_Strict):
    """One tensor the session will carry (HF name, torch short dtype name, full shape)."""

    name: str = Field(..., min_length=1, max_length=1024)
    dtype: str = Field(..., min_length=1, max_length=32)
    shape: list[int] = Field(..., max_length=16)

    @model_validator(mode="after")
    def _valid(self) -> ManifestEntry:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in {self.shape}")
        return self


class OpenSessionRequest(_Strict):
    version: str = Field(..., min_length=1, max_length=256, description="weight version the engines will report")
    step: int | None = Field(None, ge=0)
    ranks: int | None = Field(None, ge=1, le=4096, description="trainer ranks that send parts of each chunk")
    depth: int | None = Field(None, ge=1, le=64, description="chunks in flight per engine; default from policy")
    manifest: list[ManifestEntry] | None = Field(
        None, max_length=1_000_000,
        description="every tensor the session will send; each chunk's layout is checked against it. Unless "
                    "partial, it must cover the engines' full parameter set (422 naming what is missing)")
    partial: bool = Field(False, description="update only some tensors; allowed only on intact (clean) weights")


class OpenSessionReply(BaseModel):
    session_id: str
    ranks: int
    depth: int
    step: int
    version: str
    partial: bool = False
    idle_s: float | None = Field(None, description="the session expires after this long without a chunk")
    manifest_tensors: int | None = Field(None, description="tensors declared in the manifest (null: none)")


class TensorEntry(_Strict):
    name: str = Field(..., min_length=1)
    dtype: str
    shape: list[int]
    offset: int = Field(..., ge=0)


class ChunkDescriptor(_Strict):
    """One rank's part of one chunk. ``handle`` is transport-specific and opaque to the daemon."""

    seq: int = Field(..., ge=0)
    rank: int = Field(0, ge=0)
    transport: Literal["shm", "disk", "cuda_ipc", "ipc_ring"]
    nbytes: int = Field(..., ge=0, le=MAX_CHUNK_BYTES, description="bytes of this rank's part (at most 256 GiB)")
    handle: dict[str, Any] = Field(..., description="shm: {shm_name, layout}; disk: {path}; cuda_ipc: {payload_b64}")


class ChunkAckReply(BaseModel):
    seq: int
    rank: int
    engines: list[str]
    load_s: float


class CommitRequest(_Strict):
    num_chunks: int | None = Field(None, ge=0, description="chunks the trainer sent; checked against the engines'")


class UpdateWeightsRequest(_Strict):
    """One-shot update: open, send every chunk, commit."""

    version: str = Field(..., min_length=1, max_length=256)
    step: int | None = Field(None, ge=0)
    chunks: list[ChunkDescriptor] = Field(..., min_length=1)


class OpenWeightGroupRequest(_Strict):
    """Have every engine join the trainer's weight-update group; the trainer joins as rank 0 meanwhile."""

    group_name: str = Field("weight_update_group", pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    master_address: str = Field(..., min_length=1, max_length=255, description="host of the trainer's TCPStore")
    master_port: int = Field(..., ge=1, le=65535, description="port of the trainer's TCPStore")
    backend: Literal["nccl", "gloo"] = Field("nccl", description="nccl between GPUs; gloo on CPU engines")
    world_size: int | None = Field(None, ge=2, description="ranks in the group; default 1 + this node's engine ranks")
    first_rank: int = Field(1, ge=1, description="group rank of this node's first engine rank (several nodes)")


class BroadcastRequest(_Strict):
    """One broadcast: the daemon forwards it to every engine at once; send it, then broadcast, then await it."""

    seq: int = Field(..., ge=0, description="0, 1, 2, ... within the session, per group")
    group_name: str = "weight_update_group"
    names: list[str] = Field(..., min_length=1, description="tensors in broadcast order (HF names)")
    dtypes: list[str] = Field(..., description="torch short names, e.g. bfloat16")
    shapes: list[list[int]]
    load_format: Literal["flattened_bucket"] | None = Field(
        None, description="null: one broadcast per tensor; flattened_bucket: one uint8 broadcast, no padding")

    @model_validator(mode="after")
    def _valid_layout(self) -> BroadcastRequest:
        self.descriptor()  # ValueError (lengths, dtypes, flattened alignment) becomes a 422
        return self

    def descriptor(self) -> BroadcastDescriptor:
        return BroadcastDescriptor(seq=self.seq, group_name=self.group_name, names=tuple(self.names),
                                   dtypes=tuple(self.dtypes), shapes=tuple(tuple(s) for s in self.shapes),
                                   load_format=self.load_format)


class ErrorReply(BaseModel):
    error: str
    message: str
    state: dict[str, Any] | None = None
