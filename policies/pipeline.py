"""Pipeline policies: how many weight chunks are in flight, how big each is, and which transport moves them."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from .base import Decision, Family, Policy, PolicyConfig
from .transport import AUTO_ORDER, Transport

__all__ = ["OverlapPolicy", "PipelinePlan", "PipelinePolicy", "PipelineSnapshot", "SerialPolicy", "Transport",
           "TransportChoice"]

_MIB = 1 << 20

# A pipeline policy may name a transport or leave the choice to the plan; "auto" is no transport.
TransportChoice = Transport | Literal["auto"]


# Transports whose buckets are staged in GPU memory, so depth x bucket must fit in free memory.
_GPU_STAGED = frozenset({Transport.CUDA_IPC})


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
    for candidate in AUTO_ORDER:
        if candidate in available:
            return candidate
    # Every trainer can write a safetensors file; disk is the floor.
    return Transport.DISK
