"""Cleanup policies: what the trainer frees before an engine resumes (verl #7864), enacted by ``trainer/cleanup.py``."""

from __future__ import annotations

from abc import abstractmethod
from enum import StrEnum
from typing import ClassVar

from pydantic import Field

from .base import Decision, Family, Policy, PolicyConfig

__all__ = ["AggressiveCleanupPolicy", "CleanupAction", "CleanupPlan", "CleanupPolicy", "EmptyCachePolicy",
           "NoCleanupPolicy"]

_GIB = 1 << 30


class CleanupAction(StrEnum):
    """One cleanup sub-step, in the order a plan lists them."""

    GC_COLLECT = "gc_collect"  # drop Python cycles that may pin tensors
    SYNCHRONIZE = "synchronize"  # let pending kernels finish so their blocks become free
    EMPTY_CACHE = "empty_cache"  # return the caching allocator's free blocks to the driver


class CleanupPlan(Decision):
    """Run ``steps`` once; repeat the round while it freed at least ``min_freed_bytes``, up to ``max_retries`` more."""

    policy: str
    steps: tuple[CleanupAction, ...] = ()
    max_retries: int = Field(0, ge=0, le=10)
    min_freed_bytes: int = Field(_GIB, ge=0)


class CleanupPolicy(Policy):
    """Decides the cleanup that runs before an engine resumes."""

    family: ClassVar[Family] = Family.CLEANUP

    @abstractmethod
    def plan(self) -> CleanupPlan:
        """Return the plan. Pure."""


class EmptyCachePolicy(CleanupPolicy):
    """``torch.cuda.empty_cache()`` once: ~1 ms per GiB returned on an H200."""

    name: ClassVar[str] = "empty_cache"

    def plan(self) -> CleanupPlan:
        return CleanupPlan(policy=self.spec, steps=(CleanupAction.EMPTY_CACHE,))


class AggressiveCleanupPolicy(CleanupPolicy):
    """gc.collect + synchronize + empty_cache, retried while a round frees at least ``min_freed_gib``."""

    name: ClassVar[str] = "aggressive"

    class Config(PolicyConfig):
        max_retries: int = Field(3, ge=0, le=10, description="extra rounds after the first")
        min_freed_gib: float = Field(1.0, ge=0, description="retry only while a round freed at least this")

    config: Config

    def plan(self) -> CleanupPlan:
        return CleanupPlan(policy=self.spec,
                           steps=(CleanupAction.GC_COLLECT, CleanupAction.SYNCHRONIZE, CleanupAction.EMPTY_CACHE),
                           max_retries=self.config.max_retries, min_freed_bytes=int(self.config.min_freed_gib * _GIB))


class NoCleanupPolicy(CleanupPolicy):
    """Nothing: the engine resumes into whatever the trainer left cached."""

    name: ClassVar[str] = "none"

    def plan(self) -> CleanupPlan:
        return CleanupPlan(policy=self.spec)
