"""Request and response bodies of colocd's HTTP API (pydantic); the daemon keeps its own dataclasses."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from ..daemon.distributed import BroadcastDescriptor
from ..daemon.manifests import MANIFEST_REF_PATTERN
from ..engines.base import MemoryTag
from ..engines.chunks import DTYPES, MAX_LAYOUT_ENTRIES
from ..engines.handles import Handle, HandleModel, parse_handle
from ..policies import GroupSnapshot, Transport

MAX_CHUNK_BYTES = 1 << 38  # 256 GiB: larger than any GPU's memory, so a larger nbytes is a mistake

__all__ = [
    "MAX_STEP", "BroadcastRequest", "ChunkAckReply", "ChunkDescriptor", "CommitRequest", "ErrorBody", "FieldProblem",
    "LeaseReportRequest", "ManifestEntry", "OpenSessionReply", "OpenSessionRequest", "OpenWeightGroupRequest",
    "PhaseRequest", "SleepRequest", "TrainerReport", "TrainerSpan", "TrainerWeights", "TransitionReply",
    "UpdateWeightsRequest",
]

# Steps are exact in every consumer: JSON numbers read as doubles (Prometheus, JavaScript) stay exact below 2**53.
MAX_STEP = 2**53 - 1
# Trainer ranks per node and group sizes: far above any real node, small enough that a per-rank table stays cheap.
MAX_RANKS = 4096

# Strict: a JSON bool or a float is not an int ("step": true is not step 1; 1e30 is not a step).
Step = Annotated[int, Field(strict=True, ge=0, le=MAX_STEP)]  # also a sequence number or a count of chunks
Count = Annotated[int, Field(strict=True, ge=0)]
Rank = Annotated[int, Field(strict=True, ge=0, lt=MAX_RANKS)]
Seconds = Annotated[float, Field(ge=0, le=7 * 86400.0, allow_inf_nan=False)]  # a week: no span is longer


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _WithAttrs(BaseModel):
    """Extra keys are attributes: at most 64, numbers finite."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _attrs_are_json(self) -> Self:
        extra = self.model_extra or {}
        if len(extra) > 64:
            raise ValueError(f"at most 64 extra attributes, got {len(extra)}")
        for key, value in extra.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key}: {value} is not a finite number")
        return self


class TrainerSpan(_WithAttrs):
    """One timed sub-step the trainer ran (a cleanup step, a group rebuild); extra keys become span attributes."""

    name: str = Field("step", min_length=1, max_length=128)
    duration_s: Seconds = 0.0
    start_s: float | None = Field(None, allow_inf_nan=False)


class GroupsReport(_WithAttrs):
    """What the trainer's process-group lifecycle did (``GroupReport.to_dict()``); ``seconds`` is its cost."""

    seconds: Seconds = 0.0


class TrainerGroups(GroupSnapshot):
    """The policy's ``GroupSnapshot``, read strictly from the wire: ``true`` is not a count, ``"5"`` is not 5."""

    model_config = ConfigDict(strict=True)


class TrainerWeights(_Strict):
    """How the trainer pushed its weights this step (``colocd.trainer.async_push.AsyncWeightSync.report()``)."""

    requested: Literal["sync", "async"] = Field("sync", description="the mode the policy asked for")
    mode: Literal["sync", "async"] = Field("sync", description="the mode that ran")
    buffer: Literal["device", "pinned_cpu", "none"] = Field("none", description="where the snapshot went")
    fallback_reason: str | None = Field(None, max_length=2000, description="why async fell back to sync")
    started_version: str | None = Field(None, max_length=256, description="the trainer's latest started version")
    version: str | None = Field(None, max_length=256, description="the version this report's push carried")
    buffer_bytes: int | None = Field(None, ge=0, description="bytes the snapshot holds")
    snapshot_s: float | None = Field(None, ge=0, description="copying into the second buffer")
    push_s: float | None = Field(None, ge=0, description="the push, open to commit")
    join_wait_s: float | None = Field(None, ge=0, description="how long the join waited for the push")
    overlap_s: float | None = Field(None, ge=0, description="push time hidden behind the trainer's work")


class TrainerReport(_Strict):
    """What the trainer agent knows or did (``colocd.trainer.TrainerAgent``), validated before any engine is touched."""

    groups: TrainerGroups | None = Field(None, description="train: the trainer's process groups, for the policy")
    groups_report: GroupsReport | None = Field(None, description="sync: what the group lifecycle did")
    spans: list[TrainerSpan] | None = Field(None, max_length=1024, description="sync: timed trainer sub-steps")
    cleanup: dict[str, JsonValue] | None = Field(None, description="sync: the cleanup report, minus its spans")
    weights: TrainerWeights | None = Field(None, description="how the weights were pushed, and the latest version "
                                                             "the trainer started")


class LeaseReportRequest(_Strict):
    """One trainer rank's IPC leases (``colocd.trainer.leases.LeaseBook.report()``): bytes now, reclaims so far."""

    rank: Count = Field(..., le=65535, description="the trainer rank")
    exported_bytes: Count = Field(..., description="bytes exported for engines now")
    retained_bytes: Count = Field(..., description="bytes released but kept by torch for a consumer's count")
    reclaimed: Count = Field(0, description="leases reclaimed in this rank's lifetime")
    reclaimed_bytes: Count = Field(0, description="bytes those leases held")


class PhaseRequest(_Strict):
    """The trainer's phase transition: rollout → train → sync → rollout, one step at a time."""

    step: Step = Field(..., description="training step; train needs a step beyond the current one")
    phase: Literal["train", "sync", "rollout"]
    trainer: TrainerReport | None = Field(None, description="what the trainer agent knows or did")
    adapter: str | None = Field(None, min_length=1, max_length=300,
                                description="the LoRA adapter this phase's requests will name; one the daemon "
                                            "retired is refused with 410 before anything moves")


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
    adapter: str | None = None  # the LoRA adapter name the engines serve as current (None: none pushed)


class ManifestEntry(_Strict):
    """One tensor the session will carry (HF name, torch short dtype name, full shape)."""

    name: str = Field(..., min_length=1, max_length=1024)
    dtype: str = Field(..., min_length=1, max_length=32)
    shape: list[Count] = Field(..., max_length=16)

    @model_validator(mode="after")
    def _valid(self) -> ManifestEntry:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        return self


class OpenSessionRequest(_Strict):
    version: str = Field(..., min_length=1, max_length=256, description="weight version the engines will report")
    step: Step | None = Field(None, description="the node's current step (the default); any other is a 422")
    ranks: Annotated[int, Field(strict=True, ge=1, le=MAX_RANKS)] | None = Field(
        None, description="trainer ranks that send parts of each chunk")
    depth: Annotated[int, Field(strict=True, ge=1, le=64)] | None = Field(
        None, description="chunks in flight per engine; default from policy")
    manifest: list[ManifestEntry] | None = Field(
        None, max_length=1_000_000,
        description="every tensor the session will send; each chunk's layout is checked against it. Unless "
                    "partial, it must cover the engines' full parameter set (422 naming what is missing)")
    manifest_ref: Annotated[str, StringConstraints(pattern=MANIFEST_REF_PATTERN)] | None = Field(
        None, description="instead of manifest: the manifest_ref an earlier open's reply gave for the same manifest. "
                          "A daemon that holds no manifest by it (it restarted) answers 409 ManifestRefUnknown "
                          "naming manifest_ref, changing nothing: send the manifest. Given with manifest, the two "
                          "must agree (else 422)")
    partial: Annotated[bool, Field(strict=True)] = Field(
        False, description="update only some tensors; allowed only on intact (clean) weights")


class OpenSessionReply(BaseModel):
    session_id: str
    ranks: int
    depth: int
    step: int
    version: str
    partial: bool = False
    idle_s: float | None = Field(None, description="the session expires after this long without a chunk")
    manifest_tensors: int | None = Field(None, description="tensors declared in the manifest (null: none)")
    manifest_ref: str | None = Field(
        None, description="the declared manifest's reference (null: none declared): the next open may send it as "
                          "manifest_ref instead of the manifest, while this daemon process holds it")
    transports: list[Transport] = Field(default_factory=list, description=(
        "the transports every engine of the session loads; a chunk by any other is refused (422)"))


# name -> 16 hex digits (engines/digest.py); at most as many entries as a chunk's layout may have.
WeightDigests = Annotated[
    dict[Annotated[str, StringConstraints(min_length=1, max_length=4096)],
         Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]],
    Field(max_length=MAX_LAYOUT_ENTRIES),
]


class ChunkDescriptor(_Strict):
    """One rank's part of one chunk. ``handle`` is parsed into the model of ``transport`` (engines/handles.py);
    the daemon reads only its route, the adapters forward it as sent."""

    seq: Step
    rank: Rank = Field(
        0, description="trainer rank; below the session's ranks (one-shot: below the engines' largest tp_size)")
    transport: Transport = Field(
        ..., description="as the chunk travels: per_tensor chunks say cuda_ipc")
    nbytes: Annotated[int, Field(strict=True, ge=0, le=MAX_CHUNK_BYTES)] = Field(
        ..., description="bytes of this rank's part (at most 256 GiB)")
    handle: HandleModel = Field(..., description=(
        "the model of the chunk's transport (engines/handles.py); every transport carries layout: [{name, dtype, "
        "shape, offset}]; shm: {shm_name, nbytes, layout}: shm_name a colocd trainer segment (colocd-<pid>-<hex>), "
        "nbytes equal to this descriptor's nbytes; disk: {path, layout}; inline: {payload_b64, load_format, "
        "layout}: these three take no other key; cuda_ipc: {payload_b64 (standard base64), load_format, "
        "device_uuid, layout}: other keys (not another transport's) travel to the engine as sent"))
    digests: WeightDigests | None = Field(
        None, description="each tensor's digest as the trainer computed it at export (colocd.engines.digest: "
                          "16 hex digits), by tensor name; what a verified commit compares with the engines'")

    @field_validator("handle", mode="wrap")
    @classmethod
    def _typed_by_transport(cls, value: object, _: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Handle:
        # The transport picks the one model to try (a union tried member by member would name every variant's
        # fields in its errors); a transport that did not parse is reported on its own, the handle as an object.
        transport = info.data.get("transport")
        if not isinstance(transport, Transport):
            return Handle.model_validate(value)
        return parse_handle(transport, value)

    @model_validator(mode="after")
    def _as_on_the_wire(self) -> ChunkDescriptor:
        if self.transport.wire != self.transport:
            raise ValueError(f"transport {self.transport.value!r} travels as {self.transport.wire.value!r}: "
                             "send that (the handle says the rest)")
        return self


class JoinRequest(_Strict):
    """A trainer rank joins a session, declaring its device: it then feeds the engine TP ranks on that device."""

    rank: Rank = Field(..., description="trainer rank")
    device_id: str = Field(..., min_length=1, max_length=256,
                           description="the rank's device: its GPU's UUID (CUDA), or a declared id such as cpu:0, "
                                       "matching the engine's device_ids (CPU)")
    pid: Annotated[int, Field(strict=True, ge=1, le=4_194_304)] | None = Field(
        None, description="the rank's process id: if the session ends uncommitted, the daemon unlinks the shm "
                          "segments colocd-<pid>-* its chunks named (the trainer library sends os.getpid())")


class FeedEntry(BaseModel):
    engine: str
    tp_rank: int


class JoinReply(BaseModel):
    session_id: str
    rank: int
    device_id: str
    streams: bool = Field(..., description="false: no engine rank loads this rank's bytes; it must not send chunks")
    feeds: list[FeedEntry] = Field(..., description="the engine TP ranks this rank's chunks go to")
    verify: Literal["full", "sample", "off"] = Field(
        "off", description="the policy's sync.verify for this session: unless off, send each chunk's digests")
    transports: list[Transport] = Field(default_factory=list, description=(
        "the transports every engine this rank feeds loads: a chunk by any other is refused (422) before any "
        "engine sees it; WeightPusher's transport='auto' picks from these"))
    depth: int = Field(1, description=(
        "the session's window: a rank sends chunk n only once its chunk n - depth was answered (more outstanding "
        "is refused, 422 naming seq); WeightPusher keeps within the smaller of its own depth and this"))


class ChunkAckReply(BaseModel):
    seq: int
    rank: int
    engines: list[str]
    load_s: float


class CommitRequest(_Strict):
    num_chunks: Step | None = Field(
        None, description="chunks the trainer sent; checked against the engines'")


class AbortRequest(_Strict):
    reason: str | None = Field(None, min_length=1, max_length=1024,
                               description="why the trainer abandons the session (e.g. the refusal one rank got): "
                                           "the session's error, and what every other rank's waiting chunk is told")


class UpdateWeightsRequest(_Strict):
    """One-shot update: open, send every chunk, commit."""

    version: str = Field(..., min_length=1, max_length=256)
    step: Step | None = None
    chunks: list[ChunkDescriptor] = Field(..., min_length=1, max_length=65536)


class OpenWeightGroupRequest(_Strict):
    """Have every engine join the trainer's weight-update group; the trainer joins as rank 0 meanwhile."""

    group_name: str = Field("weight_update_group", pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    master_address: str = Field(..., pattern=r"^[A-Za-z0-9._:%\[\]-]{1,255}$",
                                description="host name or IP of the trainer's TCPStore")
    master_port: int = Field(..., strict=True, ge=1, le=65535, description="port of the trainer's TCPStore")
    backend: Literal["nccl", "gloo"] = Field("nccl", description="nccl between GPUs; gloo on CPU engines")
    world_size: int | None = Field(None, strict=True, ge=2, le=65536,
                                   description="ranks in the group; default 1 + this node's engine ranks")
    first_rank: int = Field(1, strict=True, ge=1, lt=65536,
                            description="group rank of this node's first engine rank (several nodes)")


class BroadcastRequest(_Strict):
    """One broadcast: the daemon forwards it to every engine at once; send it, then broadcast, then await it."""

    seq: int = Field(..., strict=True, ge=0, le=MAX_STEP, description="0, 1, 2, ... within the session, per group")
    group_name: str = Field("weight_update_group", pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    names: list[str] = Field(..., min_length=1, description="tensors in broadcast order (HF names)")
    dtypes: list[str] = Field(..., description="torch short names, e.g. bfloat16")
    shapes: list[list[Count]]
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


class FieldProblem(BaseModel):
    field: str = Field(..., description="dotted path of the offending field, e.g. trainer.spans.0.duration_s")
    message: str


class ErrorBody(BaseModel):
    """Every 4xx and 5xx colocd answers, framework errors included, has this shape."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(..., min_length=1, description="error class, e.g. RequestInvalid, TransitionRejected")
    message: str = Field(..., min_length=1, description="what went wrong and, where it can, what to do")
    field: str | None = Field(None, description="the request field at fault (4xx)")
    fields: list[FieldProblem] | None = Field(None, description="every field at fault (422 validation)")
    engine: str | None = Field(None, description="the engine involved")
    state: dict[str, Any] | None = Field(None, description="the node's state when a request was rejected (409)")
    stage: str | None = Field(None, description="the stage of the call that failed or timed out (502/504), e.g. "
                              "load_chunk")
    budget_s: float | None = Field(None, description="the budget a timed-out stage had (504)")
    journal: str | None = Field(None, description="the journal file the daemon could not write (507)")
    rank: int | None = Field(None, description="the trainer rank that never sent its part (ChunkTimeout)")
    tensor: str | None = Field(None, description="the tensor an engine holds other bytes of (WeightsMismatch)")
    session_id: str | None = Field(None, description="the weight session that is gone (410)")
    session_state: str | None = Field(None, description="why it is gone: expired, aborted, failed, committed")
