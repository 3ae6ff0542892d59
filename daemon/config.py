"""The node's configuration file: where the daemon listens, which engines it drives, its timeouts."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..engines.config import EngineConfig
from .errors import ColocdError

__all__ = ["ConfigError", "ListenConfig", "NodeConfig", "Timeouts", "load_node_config"]


class ConfigError(ColocdError):
    """The node config file is missing or invalid; the message names the key."""


class ListenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="TCP host; loopback by default")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 lets the OS choose")
    uds: str | None = Field(None, description="listen on this Unix socket (mode 0600) instead of TCP")
    ready_file: str | None = Field(None, description="write {url, pid} here once listening")


class Timeouts(BaseModel):
    """One default plus per-step overrides, in seconds (the daemon wraps each engine call in one)."""

    model_config = ConfigDict(extra="forbid")

    default_s: float = Field(30.0, gt=0)
    pause_s: float | None = Field(None, gt=0)
    flush_s: float | None = Field(None, gt=0, description="total budget for flush retries")
    release_s: float | None = Field(None, gt=0)
    resume_s: float | None = Field(None, gt=0)
    chunk_s: float | None = Field(None, gt=0, description="one chunk: gather from all ranks + engine load")
    memory_confirm_s: float | None = Field(None, gt=0, description="NVML wait for released bytes")
    health_s: float | None = Field(5.0, gt=0, description="interval of the health loop's observations")
    observe_s: float | None = Field(None, gt=0, description="one observation of one engine (default: default_s)")

    def for_step(self, step: str) -> float:
        value = getattr(self, f"{step}_s", None)
        return float(value if value is not None else self.default_s)


class NodeConfig(BaseModel):
    """The whole file; each component receives only its slice."""

    model_config = ConfigDict(extra="forbid")

    listen: ListenConfig = Field(default_factory=ListenConfig)
    token: str | None = Field(None, description="bearer token required on mutating routes")
    engines: list[EngineConfig] = Field(default_factory=list)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    policy_file: str | None = Field(None, description="policy YAML; reloaded on SIGHUP or change")
    journal: str | None = Field(None, description="append-only JSON-lines journal of committed state")
    pause_mode: str = Field("abort", pattern="^(abort|retract|in_place)$")
    log_format: str = Field("text", pattern="^(text|json)$",
                            description="serve's log lines: text (human) or json (one object per line)")

    @model_validator(mode="after")
    def _unique_engine_names(self) -> NodeConfig:
        names = [e.name for e in self.engines]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"engines: duplicate names {dupes}")
        return self


def load_node_config(path: str | Path) -> NodeConfig:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path}: invalid YAML: {exc}") from exc
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"config {path}: " + "; ".join(lines)) from exc
