"""Per-engine configuration: which engine, where it listens, what it owns. One model per kind.

Engine URLs come from here (the operator's file), never from request bodies.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .base import ALL_TAGS, MemoryTag

__all__ = ["AnyEngineConfig", "EngineConfig", "LaunchConfig", "ReferenceEngineConfig", "SGLangEngineConfig",
           "VLLMEngineConfig"]


class LaunchConfig(BaseModel):
    """How colocd starts the engine itself (and relaunches it on exit, with a doubling backoff; stops it on
    shutdown); absent means attach to one already running at ``url``. Its URL is ``url`` if set, else a free
    loopback port kept across relaunches."""

    model_config = ConfigDict(extra="forbid")

    args: list[str] = Field(default_factory=list, description="extra command-line flags for the engine")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    ready_timeout_s: float = Field(120.0, gt=0, description="deadline for the engine to answer /health")
    log_file: str | None = Field(None, description="where the engine's stdout/stderr go; default: a temp file")
    restart: bool = Field(True, description="relaunch the engine when it exits (false: leave it down, unhealthy)")
    backoff_initial_s: float = Field(1.0, gt=0, description="wait before the first relaunch after an exit")
    backoff_max_s: float = Field(30.0, gt=0, description="longest wait between relaunches (the doubling stops here)")
    backoff_reset_s: float = Field(
        60.0, gt=0, description="a run that stayed up this long resets the backoff to backoff_initial_s")
    stop_grace_s: float = Field(10.0, gt=0, description="on shutdown: SIGTERM, then SIGKILL after this long")

    @model_validator(mode="after")
    def _backoff_bounds(self) -> LaunchConfig:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s:g}) is below backoff_initial_s "
                             f"({self.backoff_initial_s:g})")
        return self


class _EngineBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="unique name on this node")
    url: str | None = Field(None, description="base URL of the engine's HTTP server, e.g. http://127.0.0.1:30000")
    gpus: list[int] = Field(default_factory=list, description="physical GPU indices the engine occupies")
    gpu_uuids: list[str] = Field(default_factory=list, description="GPU UUIDs (preferred over indices)")
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks; one chunk payload per rank")
    feed_ranks: list[int] | None = Field(
        None, description="the trainer rank that feeds each TP rank, in TP-rank order (one per TP rank); "
        "overrides the default, which feeds each TP rank from the trainer rank on the same device")
    api_key: str | None = Field(None, description="bearer token the engine expects on control routes")
    launch: LaunchConfig | None = None
    owned_tags: list[MemoryTag] = Field(
        default_factory=lambda: list(ALL_TAGS),
        description="memory tags this engine really owns and may release",
    )

    @model_validator(mode="after")
    def _needs_url_or_launch(self) -> _EngineBase:
        if self.url is None and self.launch is None:
            raise ValueError(f"engine {self.name!r}: set 'url' (attach) or 'launch' (colocd starts it)")
        return self

    @model_validator(mode="after")
    def _one_feed_rank_per_tp_rank(self) -> _EngineBase:
        if self.feed_ranks is None:
            return self
        if len(self.feed_ranks) != self.tp_size:
            raise ValueError(f"engine {self.name!r}: feed_ranks has {len(self.feed_ranks)} entries for tp_size "
                             f"{self.tp_size} (one trainer rank per TP rank)")
        if any(r < 0 for r in self.feed_ranks) or len(set(self.feed_ranks)) != len(self.feed_ranks):
            raise ValueError(f"engine {self.name!r}: feed_ranks must be distinct trainer ranks >= 0, "
                             f"got {self.feed_ranks}")
        return self


class ReferenceEngineConfig(_EngineBase):
    """The embedded reference engine: SGLang's HTTP protocol over a tiny torch causal LM."""

    kind: Literal["reference"] = "reference"
    device: str = Field("cpu", description="cpu or cuda[:N]")
    seed: int = Field(0, description="seed of the deterministic initial weights")
    protocol: Literal["0.5.23", "legacy"] = Field("0.5.23", description="which SGLang protocol to emulate")
    model: dict[str, int | float | bool] = Field(default_factory=dict, description="model config overrides")
    device_ids: list[str] = Field(
        default_factory=list,
        description="CPU only: the identity each TP rank declares (default cpu:0..tp_size-1); on CUDA a TP "
        "rank's identity is its GPU's UUID",
    )

    @property
    def on_cpu(self) -> bool:
        """Whether it runs on the host: ``device`` cpu and no GPU named (``gpus``, ``gpu_uuids``)."""
        return not (self.device.startswith("cuda") or self.gpus or self.gpu_uuids)

    @model_validator(mode="after")
    def _one_device_per_tp_rank(self) -> ReferenceEngineConfig:
        if self.device_ids and self.device.startswith("cuda"):
            raise ValueError(f"engine {self.name!r}: device_ids are for CPU engines; on CUDA list gpu_uuids")
        if self.device_ids and len(self.device_ids) != self.tp_size:
            raise ValueError(f"engine {self.name!r}: device_ids has {len(self.device_ids)} entries for "
                             f"tp_size {self.tp_size} (one per TP rank)")
        if len(set(self.device_ids)) != len(self.device_ids) or not all(i.strip() for i in self.device_ids):
            raise ValueError(f"engine {self.name!r}: device_ids must be distinct and non-empty")
        if any("," in i for i in self.device_ids):
            raise ValueError(f"engine {self.name!r}: a device id may not contain ','")
        return self


class SGLangEngineConfig(_EngineBase):
    """A real SGLang server (launched with --enable-memory-saver on a GPU; ``--device cpu`` in launch.args runs
    SGLang's CPU engine, where releases free nothing)."""

    kind: Literal["sglang"] = "sglang"
    model_path: str | None = Field(None, description="model to serve when colocd launches the server")
    memory_saver_cuda_graph: bool = Field(
        False,
        description="the server runs with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, so the cuda_graph tag owns memory",
    )

    @model_validator(mode="before")
    @classmethod
    def _cuda_graph_tag_needs_the_saver(cls, data: object) -> object:
        # Without SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 the cuda_graph tag owns no memory (environ.py:1645):
        # releasing it frees nothing, so by default the engine owns it only when launched that way.
        if isinstance(data, dict) and "owned_tags" not in data:
            tags = [MemoryTag.WEIGHTS, MemoryTag.KV_CACHE]
            if data.get("memory_saver_cuda_graph"):
                tags.append(MemoryTag.CUDA_GRAPH)
            return {**data, "owned_tags": tags}
        return data

    @model_validator(mode="after")
    def _cuda_graph_tag_consistent(self) -> SGLangEngineConfig:
        if MemoryTag.CUDA_GRAPH in self.owned_tags and not self.memory_saver_cuda_graph:
            raise ValueError(
                f"engine {self.name!r}: owned_tags lists cuda_graph but memory_saver_cuda_graph is false; "
                "SGLang frees CUDA-graph memory only when launched with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1")
        return self


class VLLMEngineConfig(_EngineBase):
    """A real vLLM server in dev mode (VLLM_SERVER_DEV_MODE=1)."""

    kind: Literal["vllm"] = "vllm"
    model_path: str | None = Field(None, description="model to serve when colocd launches the server")
    sleep_level: int = Field(2, ge=0, le=2, description="level for /sleep; 2 discards weights")
    python: str | None = Field(
        None, description="interpreter of the venv that holds vLLM, used to launch it; default $COLOCD_VLLM_PYTHON"
    )
    # vLLM's sleep tags are weights and kv_cache; CUDA-graph memory comes back with the first wake.
    owned_tags: list[MemoryTag] = Field(
        default_factory=lambda: [MemoryTag.WEIGHTS, MemoryTag.KV_CACHE],
        description="memory tags this engine really owns and may release",
    )


# One engine's slice of the node config, as the daemon and the adapters hold it (parsed: one of the kinds).
AnyEngineConfig = ReferenceEngineConfig | SGLangEngineConfig | VLLMEngineConfig
EngineConfig = Annotated[AnyEngineConfig, Field(discriminator="kind")]
