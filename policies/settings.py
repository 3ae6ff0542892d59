"""Plain settings carried in the policy document: engine release behaviour and per-step timeouts.

These are values, not pluggable policies; the daemon reads them at each transition.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["EngineSettings", "Timeouts"]

ReleaseTag = Literal["weights", "kv_cache", "cuda_graph"]
PauseModeName = Literal["abort", "retract", "in_place"]
TimeoutStep = Literal["release", "resume", "sync", "chunk", "health", "memory_confirm"]
_STEPS: tuple[str, ...] = get_args(TimeoutStep)


class EngineSettings(BaseModel):
    """How engines give memory back when the trainer trains."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    release_tags: tuple[ReleaseTag, ...] = Field(
        ("weights", "kv_cache", "cuda_graph"),
        min_length=1,
        description="memory tags every engine releases for training (only those it owns)",
    )
    # retract: requests go back to the waiting queue and are recomputed after continue, and a flush
    # after it works on SGLang 0.5.23 (sglang#31962); in_place keeps KV so the post-update flush fails
    # (research/engine-apis.md, pause_generation).
    pause_mode: PauseModeName = Field("retract", description="abort | retract | in_place (SGLang's names)")

    @field_validator("release_tags")
    @classmethod
    def _unique(cls, tags: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(tags)) != len(tags):
            raise ValueError(f"tags listed twice: {sorted({t for t in tags if tags.count(t) > 1})}")
        return tags


class Timeouts(BaseModel):
    """One default budget plus per-step overrides (httpx's ``Timeout`` shape); ``None`` uses ``default_s``.

    ``timeouts.for_step("sync")`` is what the daemon passes to ``asyncio.timeout``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_s: float = Field(60.0, gt=0, description="budget of any step without its own value")
    release_s: float | None = Field(None, gt=0, description="engines pause and release memory")
    resume_s: float | None = Field(None, gt=0, description="engines take memory back")
    sync_s: float | None = Field(600.0, gt=0, description="a whole weight sync, all chunks")
    chunk_s: float | None = Field(30.0, gt=0, description="one chunk, from send to the engine's ack")
    health_s: float | None = Field(5.0, gt=0, description="one health probe")
    memory_confirm_s: float | None = Field(30.0, gt=0, description="NVML shows the released bytes free")

    def for_step(self, step: TimeoutStep) -> float:
        """Seconds allowed for ``step``."""
        if step not in _STEPS:
            raise ValueError(f"unknown timeout step {step!r}; known: {', '.join(_STEPS)}")
        value: float | None = getattr(self, f"{step}_s")
        return self.default_s if value is None else value
