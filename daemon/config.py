"""The node's configuration file: where the daemon listens, which engines it drives, its timeouts."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..engines.config import EngineConfig
from ..errors import ConfigError
from ..policies import DEFAULT_PAUSE_MODE, PauseModeName, Timeouts

__all__ = ["Limits", "ListenConfig", "NodeConfig", "Timeouts", "load_node_config"]

class ListenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="TCP host; loopback by default")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 lets the OS choose")
    uds: str | None = Field(None, description="listen on this Unix socket (mode 0600) instead of TCP")
    ready_file: str | None = Field(None, description="write {url, pid} here once listening")


class Limits(BaseModel):
    """Bounds on what a caller may send; each refusal is a 4xx naming the limit's key."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024,
        description="largest request body; checked (after the token) before the body is read. The default is "
        "far above a one-shot /v1/update_weights chunk list (a few MiB for a 10k-tensor model)")
    max_policy_bytes: int = Field(256 * 1024, ge=1024, description="largest policy YAML document")
    max_yaml_aliases: int = Field(64, ge=0, description="YAML aliases (*name) allowed in one policy document")
    max_yaml_nodes: int = Field(5_000, ge=100,
                                description="YAML nodes in one policy document, counted with aliases expanded")


class NodeConfig(BaseModel):
    """The whole file; each component receives only its slice."""

    model_config = ConfigDict(extra="forbid")

    listen: ListenConfig = Field(default_factory=ListenConfig)
    token: str | None = Field(None, description="bearer token required on mutating routes")
    engines: list[EngineConfig] = Field(default_factory=list)
    timeouts: Timeouts = Field(
        default_factory=Timeouts, description="the node's step budgets; a policy document overrides the fields it sets")
    policy_file: str | None = Field(None, description="policy YAML; reloaded on SIGHUP or change")
    journal: str | None = Field(None, description="append-only JSON-lines journal of committed state")
    pause_mode: PauseModeName = Field(
        DEFAULT_PAUSE_MODE, description="how in-flight requests are treated when the node leaves rollout, unless "
        "the policy document sets engines.pause_mode")
    log_format: str = Field("text", pattern="^(text|json)$",
                            description="serve's log lines: text (human) or json (one object per line)")
    limits: Limits = Field(default_factory=Limits)
    policy_plugins: list[str] = Field(
        default_factory=list,
        description="'module:Class' policy plugins a policy document may name, exactly, or 'module:*' for any "
        "class of that module. Entry points in group colocd.policies need no listing: installing them is the "
        "operator's consent. Anything else is refused before it is imported")

    @model_validator(mode="after")
    def _check(self) -> NodeConfig:
        if bad := [p for p in self.policy_plugins if p.count(":") != 1 or not all(p.split(":"))]:
            raise ValueError(f"policy_plugins: {bad} must be written as 'module:Class' or 'module:*'")
        names = [e.name for e in self.engines]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
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
        # One line: the problem and where (PyYAML's own text spans several lines with a caret).
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config {path}: invalid YAML{where}: {problem}") from exc
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"config {path}: " + "; ".join(lines)) from exc
