"""Plain settings carried in the policy document: engine release behaviour (timeouts: ``timeouts.py``).

These are values, not pluggable policies; the daemon reads them at each transition.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DEFAULT_PAUSE_MODE", "EngineSettings", "PauseModeName", "ReleaseTag"]

ReleaseTag = Literal["weights", "kv_cache", "cuda_graph"]
PauseModeName = Literal["abort", "retract", "in_place"]
# retract: requests go back to the waiting queue and are recomputed after continue, and a flush
# after it works on SGLang 0.5.23 (sglang#31962); in_place keeps KV so the post-update flush fails;
# abort loses the requests (research/engine-apis.md, pause_generation). The one default: the node
# config's pause_mode defaults to it too, and a document's wins over the node's only where it sets one.
DEFAULT_PAUSE_MODE: PauseModeName = "retract"


class EngineSettings(BaseModel):
    """How engines give memory back when the trainer trains."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    release_tags: tuple[ReleaseTag, ...] = Field(
        ("weights", "kv_cache", "cuda_graph"),
        min_length=1,
        description="memory tags every engine releases for training (only those it owns)",
    )
    pause_mode: PauseModeName = Field(
        DEFAULT_PAUSE_MODE, description="abort | retract | in_place (SGLang's names); left out: the node config's")

    @field_validator("release_tags")
    @classmethod
    def _unique(cls, tags: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(tags)) != len(tags):
            raise ValueError(f"tags listed twice: {sorted({t for t in tags if tags.count(t) > 1})}")
        return tags
