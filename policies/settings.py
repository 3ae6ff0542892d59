"""Plain settings of the policy document (values, not pluggable policies): engine release, weight sync, adapters."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DEFAULT_PAUSE_MODE", "AdapterSettings", "EngineSettings", "PauseModeName", "SyncSettings", "VerifyMode"]

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
    resume_headroom_mb: int | None = Field(
        0, ge=0, le=1 << 20,
        description="before an engine resumes memory, NVML must show the bytes its tags took (learned from the "
                    "engine's report or its last resume) plus this many MiB free on each of its GPUs, or the "
                    "transition is refused (409) before any engine call; null: no check")

    @field_validator("release_tags")
    @classmethod
    def _unique(cls, tags: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(tags)) != len(tags):
            raise ValueError(f"tags listed twice: {sorted({t for t in tags if tags.count(t) > 1})}")
        return tags


SyncMode = Literal["sync", "async"]
# Where the trainer snapshots its weights for a background push: auto picks the device when a copy plus
# the margin fits in its free memory, else pinned host memory, else it falls back to a synchronous push.
SecondBuffer = Literal["auto", "device", "pinned_cpu"]
# What a commit checks before the engines may serve the new weights (daemon/verify.py, docs/policies.md#verify):
# full: every tensor's digest the trainer sent against the engine's report; sample: a deterministic subset
# (a different one each version); off: nothing.
VerifyMode = Literal["full", "sample", "off"]


class SyncSettings(BaseModel):
    """How the trainer's weights reach the engines, and how far the served weights may lag behind.

    ``sync`` (the default): the push is awaited before anything else happens. ``async``: the trainer
    snapshots its weights into a second buffer and the push runs in the background while the trainer does
    its post-step work (``colocd.trainer.async_push.AsyncWeightSync``); it is joined before the rollout
    and before the next push. The engines never serve a partial update either way: they serve the old
    version until the push commits.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: SyncMode = Field("sync", description="sync | async (a background push from a snapshot)")
    max_staleness_versions: int | None = Field(
        None, ge=0, le=1024,
        description="how many versions the weights an engine serves may lag the trainer's latest started "
                    "version when a rollout begins; left out: 0 for sync, 1 for async")
    second_buffer: SecondBuffer = Field(
        "auto", description="async: where the snapshot goes (auto | device | pinned_cpu)")
    buffer_margin_mb: int = Field(
        1024, ge=0, le=1 << 20, description="async: memory that must stay free beside the snapshot, MiB")
    verify: VerifyMode = Field(
        "full", description="before a commit lets engines serve: compare the per-tensor digests the trainer sent "
                            "with what each engine reports holding (full | sample: a deterministic subset | off)")

    @field_validator("verify", mode="before")
    @classmethod
    def _bare_off(cls, value: object) -> object:
        # YAML 1.1 (PyYAML) reads a bare `verify: off` as the boolean false; that is what the writer meant.
        return "off" if value is False else value

    @property
    def staleness_bound(self) -> int:
        """The bound in force: the one set, else the mode's default."""
        if self.max_staleness_versions is not None:
            return self.max_staleness_versions
        return 1 if self.mode == "async" else 0


class AdapterSettings(BaseModel):
    """How many LoRA adapter versions stay loaded, and the most any engine may hold (docs/policies.md#adapters).

    Each pushed version is an immutable name (``<base>@<version>``). The newest ``keep`` stay loaded, so rollouts
    still in flight on the previous version finish on it; an older one is unloaded at the push that makes it so,
    and from then on the daemon answers 410 for its name. A push that would leave an engine holding more than its
    cap (the lower of ``max_loaded`` and what the engine's own flags allow) is refused with 409 naming the cap.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    keep: int = Field(2, ge=1, le=64, description="adapter versions kept loaded: the current and keep-1 before it")
    max_loaded: int | None = Field(
        None, ge=1, le=1024,
        description="the most adapters an engine may hold at once; null: only the engines' own caps")
