"""The shape every policy shares: a family, a registry name, a frozen pydantic ``Config``; a pure function from a
typed snapshot to a typed decision (no engine, no sleep, no clock, no torch): the daemon and the trainer enact it."""

from __future__ import annotations

from abc import ABC
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = ["Decision", "Family", "Policy", "PolicyConfig"]


class Family(StrEnum):
    """The policy families, named as their YAML sections."""

    PROCESS_GROUPS = "process_groups"
    PIPELINE = "pipeline"
    CLEANUP = "cleanup"


class PolicyConfig(BaseModel):
    """Base of every policy's ``Config``: frozen, and unknown keys are errors that name the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Decision(BaseModel):
    """Base of snapshots and decisions: frozen and JSON-serialisable (they travel in HTTP replies)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Policy(ABC):
    """One policy of one family: subclasses set ``name`` and ``Config`` and add the decision method; ``spec`` is how
    the YAML named it (the built-in name, an entry point name or ``module:Class``)."""

    family: ClassVar[Family]
    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]] = PolicyConfig

    def __init__(self, config: PolicyConfig | None = None, *, spec: str | None = None) -> None:
        if config is None:
            config = self.Config()
        elif not isinstance(config, self.Config):
            # A plugin handed the wrong model would otherwise fail later, far from the cause.
            raise TypeError(f"{type(self).__name__} needs a Config of its own ({self.Config.__name__}), got "
                            f"{type(config).__name__}")
        self.config = config
        self.spec = spec or self.name

    def settings(self) -> dict[str, Any]:
        """The YAML section this policy was built from, defaults filled in."""
        return {"policy": self.spec, **self.config.model_dump(mode="json")}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.config.model_dump().items())
        return f"{type(self).__name__}({self.spec!r}{', ' if fields else ''}{fields})"
