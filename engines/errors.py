"""Errors an engine adapter raises; the daemon and api see these, never an httpx type.

Adapters raise only these, or ``RequestInvalid`` (``colocd.errors``) for a caller's chunk they cannot
turn into their engine's wire format; both sit under ``ColocdError`` (the tree: ``daemon/errors.py``).

    EngineError(ColocdError)    .engine names the engine
    ├── EngineUnreachable       connection refused / reset / DNS: the engine is not there
    ├── EngineTimeout           the engine did not answer within the caller's deadline
    ├── EngineRejected          the engine answered 4xx/5xx or success=false; .status, .body
    └── EngineProtocolError     the engine answered something we cannot parse
        └── EngineMismatch      the engine is not what its config declares (e.g. another tp_size)
"""

from __future__ import annotations

from ..errors import ColocdError

__all__ = [
    "EngineError",
    "EngineMismatch",
    "EngineProtocolError",
    "EngineRejected",
    "EngineTimeout",
    "EngineUnreachable",
]


class EngineError(ColocdError):
    """Base class: something went wrong talking to one engine."""

    def __init__(self, engine: str, message: str) -> None:
        super().__init__(f"engine {engine!r}: {message}")
        self.engine = engine
        self.detail = message


class EngineUnreachable(EngineError):
    """The engine's HTTP endpoint could not be reached at all."""


class EngineTimeout(EngineError):
    """The engine did not answer in time."""


class EngineRejected(EngineError):
    """The engine answered with an error status or ``success: false``."""

    def __init__(self, engine: str, message: str, *, status: int, body: str = "") -> None:
        super().__init__(engine, message)
        self.status = status
        self.body = body


class EngineProtocolError(EngineError):
    """The engine's answer did not match the protocol we expected."""


class EngineMismatch(EngineProtocolError):
    """The engine runs with another layout than its config declares (e.g. tp_size); nothing is sent to it,
    since every chunk would carry the wrong number of payloads."""
