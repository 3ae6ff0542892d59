"""Pipeline policies: how many weight chunks are in flight, how big each is, and which ``Transport`` moves them
(the one vocabulary of every layer: policies choose, engines advertise, the chunk descriptor carries it)."""

from __future__ import annotations

from abc import abstractmethod
from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from .base import Decision, Family, Policy, PolicyConfig

__all__ = ["AUTO_ORDER", "OverlapPolicy", "PipelinePlan", "PipelinePolicy", "PipelineSnapshot", "SerialPolicy",
           "Transport", "TransportChoice"]


class Transport(StrEnum):
    """A way to move one chunk (DESIGN.md §4); each is one a real engine loads (SGLang, or vLLM through
    colocd's worker extension). ``per_tensor`` is a variant of ``cuda_ipc`` on the wire (``wire``)."""

    SHM = "shm"  # POSIX shared memory by name: the CPU path
    DISK = "disk"  # a safetensors file: the fallback
    INLINE = "inline"  # the tensors' bytes in the descriptor, plainly pickled (what SGLang loads from CPU)
    CUDA_IPC = "cuda_ipc"  # a fresh IPC-exported GPU bucket per chunk (SGLang's flattened_bucket)
    PER_TENSOR = "per_tensor"  # cuda_ipc with one IPC handle per tensor (SGLang's default list format)

    @property
    def wire(self) -> Transport:
        """What a chunk of this transport says it is on the wire: a variant travels as its base transport,
        with the difference carried in its handle (``load_format: direct``)."""
        return _WIRE.get(self, self)


_WIRE = {Transport.PER_TENSOR: Transport.CUDA_IPC}


# ``transport: auto``, first choice first, in the daemon's plan and in ``WeightPusher`` alike: only transports that
# keep nothing exported between pushes, so the trainer holds no staging memory through the rollout. Auto never picks
# ``per_tensor`` (one handle per tensor); ``inline`` before ``disk``: what a real SGLang loads from CPU.
AUTO_ORDER: tuple[Transport, ...] = (Transport.CUDA_IPC, Transport.SHM, Transport.INLINE, Transport.DISK)
# A pipeline policy may name a transport or leave the choice to the plan; "auto" is no transport.
TransportChoice = Transport | Literal["auto"]
# Transports whose buckets are staged in GPU memory, so depth x bucket must fit in free memory.
_GPU_STAGED = frozenset({Transport.CUDA_IPC})
_MIB = 1 << 20


class PipelineSnapshot(Decision):
    """What the daemon knows when a weight sync starts."""

    available_transports: tuple[Transport, ...] = Field(
        (Transport.SHM, Transport.DISK), description="transports both the trainer and the engines support")
    total_bytes: int | None = Field(None, ge=0, description="bytes the sync will move, if known")
    free_bytes: int | None = Field(None, ge=0, description="GPU memory free for staging buckets, if known")


class PipelinePlan(Decision):
    """The decision for one weight sync."""

    policy: str
    depth: int = Field(..., ge=1, description="chunks in flight; 1 is serial")
    bucket_bytes: int = Field(..., gt=0, description="target bytes per chunk")
    transport: Transport = Field(..., description="a concrete transport, never auto")
    reason: str = ""


class PipelinePolicy(Policy):
    """Decides the shape of one weight sync."""

    family: ClassVar[Family] = Family.PIPELINE

    @abstractmethod
    def plan(self, snapshot: PipelineSnapshot) -> PipelinePlan:
        """Return the plan for this sync. Pure."""


class _BucketConfig(PolicyConfig):
    bucket_mb: int = Field(512, gt=0, le=65536, description="target chunk size, MiB")
    transport: TransportChoice = Field(
        "auto", description="auto (the first that both sides support of " + ", ".join(AUTO_ORDER)
        + ": nothing stays exported between pushes) or a transport: " + " | ".join(Transport))

    @field_validator("transport", mode="before")
    @classmethod
    def _known_transport(cls, value: object) -> object:
        """One error naming every allowed value, not one per member of the union."""
        if value == "auto" or value in set(Transport):
            return value
        allowed = ", ".join(("auto", *Transport))
        raise ValueError(f"{value!r} is no transport an engine loads; allowed: {allowed}")


class SerialPolicy(PipelinePolicy):
    """One chunk at a time: the next is sent only after the engine acked the previous one."""

    name: ClassVar[str] = "serial"

    Config = _BucketConfig
    config: _BucketConfig

    def plan(self, snapshot: PipelineSnapshot) -> PipelinePlan:
        return _plan(self.spec, 1, self.config, snapshot)


class OverlapPolicy(PipelinePolicy):
    """Keep ``depth`` chunks in flight so packing chunk k+1 overlaps the engine loading chunk k."""

    name: ClassVar[str] = "overlap"

    # The defaults are the tuned preset of `benchmarks.switch` (overlap2@4096), the fastest measured on
    # one H200 that keeps no trainer memory through the rollout; the memory guard shrinks the buckets
    # where 2 x 4 GiB do not fit in free GPU memory.
    class Config(_BucketConfig):
        depth: int = Field(2, ge=2, le=64, description="chunks in flight")
        bucket_mb: int = Field(4096, gt=0, le=65536, description="target chunk size, MiB")

    config: Config

    def plan(self, snapshot: PipelineSnapshot) -> PipelinePlan:
        return _plan(self.spec, self.config.depth, self.config, snapshot)


def _plan(policy: str, depth: int, config: _BucketConfig, snapshot: PipelineSnapshot) -> PipelinePlan:
    notes: list[str] = []
    transport = _choose_transport(config.transport, snapshot.available_transports, notes)
    bucket = config.bucket_mb * _MIB
    total, free = snapshot.total_bytes, snapshot.free_bytes
    if total is not None and 0 < total < bucket:
        bucket = total
        notes.append("bucket shrunk to the whole sync")
    if transport in _GPU_STAGED:
        if free is None:
            notes.append("free GPU memory unknown: staging not bounded by it")
        elif depth * bucket > free:
            # Staging more than is free would OOM the trainer mid-sync; smaller buckets only cost
            # messages, so keep the depth (the overlap) and shrink the bucket; below 1 MiB per chunk
            # the messages would cost more than the bytes, so give up depth instead.
            depth = max(1, min(depth, free // _MIB))
            bucket = max(_MIB, free // depth)
            notes.append(f"bucket shrunk to fit {depth} in {free / _MIB:.0f} MiB free GPU memory"
                         + ("" if depth * bucket <= free else ": less than 1 MiB free, staging may fail"))
    if total is not None and total > 0:
        chunks = -(-total // bucket)
        if depth > chunks:
            depth = chunks
            notes.append(f"depth capped at {chunks} chunks")
    reason = f"{depth} x {bucket / _MIB:.0f} MiB over {transport}" + (f" ({'; '.join(notes)})" if notes else "")
    return PipelinePlan(policy=policy, depth=depth, bucket_bytes=bucket, transport=transport, reason=reason)


def _choose_transport(wanted: TransportChoice, available: tuple[Transport, ...], notes: list[str]) -> Transport:
    if isinstance(wanted, Transport):  # not "auto"
        if wanted in available:
            return wanted
        notes.append(f"{wanted} not available")
    # Every trainer can write a safetensors file; disk is the floor.
    return next((candidate for candidate in AUTO_ORDER if candidate in available), Transport.DISK)
