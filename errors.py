"""Every exception colocd raises on purpose, in one tree; each class carries the HTTP status the api answers.

This module imports nothing of ours, so every layer may import it. Anything else reaching the api is a bug (500).

    ColocdError                       the root                                                 → 500
    ├── RequestInvalid                the caller's request is wrong; .field names it; nothing changed → 422
    │   └── PayloadRejected           an engine refused the caller's payload (its words); .engine      → 422
    ├── ConfigError                   the node config file is missing or invalid                → 400
    ├── PolicyError (also ValueError) a policy document was rejected; .field, .line, .column    → 400
    │   ├── PluginNotFoundError       ``module:Class`` or entry point that resolves to nothing
    │   └── PluginImportError         the plugin's module raised while importing
    ├── TransitionRejected            illegal from the current state; nothing changed; .state   → 409
    │   ├── ManifestRefUnknown        an open names a manifest_ref this daemon does not hold (send it) → 409
    │   └── AdapterRefused            an adapter push refused before it changed anything (a reused name,
    │       │                         the adapter cap); .state names the cap or the engine    → 409
    │       └── AdapterUnsupported    an engine serves no LoRA adapters, in its words; .engine
    ├── SessionGone                   a weight session expired, aborted or committed            → 410
    ├── AdapterRetired                a LoRA adapter name the daemon has unloaded; .current     → 410
    ├── NotFound                      unknown engine / session / step / group                   → 404
    ├── TransitionFailed              an engine call failed mid-transition, left paused; .engine, .stage → 502
    │   └── StageTimeout              an engine call exceeded its budget; .budget_s             → 504
    ├── MemoryNotConfirmed            NVML never showed the released bytes back                 → 504
    ├── JournalFailed                 the state changed, its journal record is not on disk; .path → 507
    ├── WeightSyncError               a weight session failed or was aborted (old version kept) → 502
    │   ├── ChunkTimeout              a chunk not complete in time; .engine/.rank, .stage, .budget_s → 504
    │   └── WeightsMismatch           an engine holds other weights than pushed; .engine, .tensor → 502
    ├── EngineError                   something went wrong talking to one engine; .engine       → 502
    │   ├── EngineUnreachable         connection refused / reset: the engine is not there       → 503
    │   ├── EngineTimeout             no answer within the caller's deadline                    → 504
    │   ├── EngineRejected            the engine answered 4xx/5xx or success=false; .status     → 502
    │   ├── EngineProtocolError       an answer we cannot parse                                 → 502
    │   │   └── EngineMismatch        the engine is not what its config declares (tp_size)
    │   └── EngineLaunchError         a launched engine died, was not ready, or could not start
    ├── ReplyInvalid                  a SGLang reply without the shape colocd reads (adapters make it
    │                                 an EngineProtocolError naming the engine)
    └── raised on the caller's side (never inside the daemon):
        ├── ColocdHTTPError           the daemon answered an error; .status, .body, .error
        ├── DaemonUnreachable (also ConnectionError) no answer came back from the daemon
        ├── ClusterStepError          a cluster fan-out failed on at least one node; .result (defined in
        │                             cluster/client.py beside the StepResult it carries: no import circle)
        ├── CliFailure                an expected CLI failure: one line to print; .exit_code
        ├── EngineMissing             the live demo's engine venv or tiny model is not installed
        └── MatplotlibMissing (also RuntimeError) drawing a timeline needs the ``viz`` extra

Deliberately elsewhere: private signals (a leading underscore) that never leave their module, and the reference
engine's own errors (``engines/reference/`` imitates SGLang, which answers HTTP in its own shape).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

__all__ = [
    "AdapterRefused", "AdapterRetired", "AdapterUnsupported", "ChunkTimeout", "CliFailure", "ColocdError",
    "ColocdHTTPError", "ConfigError", "DaemonUnreachable", "EngineError", "EngineLaunchError", "EngineMismatch",
    "EngineMissing", "EngineProtocolError", "EngineRejected", "EngineTimeout", "EngineUnreachable", "JournalFailed",
    "ManifestRefUnknown", "MatplotlibMissing", "MemoryNotConfirmed", "NotFound", "PayloadRejected", "PluginImportError",
    "PluginNotFoundError", "PolicyError", "ReplyInvalid", "RequestInvalid", "SessionGone", "StageTimeout",
    "TransitionFailed", "TransitionRejected", "WeightSyncError", "WeightsMismatch",
]


class ColocdError(Exception):
    """The tree's root (drawn above): ``http_status`` is the status the api answers, ``http_body()`` its body."""

    http_status: ClassVar[int] = 500
    http_fields: ClassVar[tuple[str, ...]] = ()  # attributes the body carries under their own names, null too

    def http_body(self) -> dict[str, object]:
        return {"error": type(self).__name__, "message": str(self) or type(self).__name__,
                **{name: getattr(self, name) for name in self.http_fields}}


# --- the caller's request -------------------------------------------------------------------------------------

class RequestInvalid(ColocdError):
    http_status = 422

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def http_body(self) -> dict[str, object]:
        return {**super().http_body(), **({"field": self.field} if self.field else {})}


class PayloadRejected(RequestInvalid):
    http_fields = ("engine",)

    def __init__(self, message: str, *, engine: str, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.engine = engine


class ConfigError(ColocdError):
    http_status = 400


class PolicyError(ColocdError, ValueError):
    """``str(err)`` reads ``line 4, column 3: process_groups.policy: ...``; a ValueError, as plugins may raise."""

    http_status = 400

    def __init__(self, message: str, line: int | None = None, column: int | None = None, *,
                 field: str | None = None) -> None:
        self.message = message
        self.line = line
        self.column = column
        self.field = field
        where = f"line {line}" + (f", column {column}" if column is not None else "") + ": " if line is not None else ""
        super().__init__(f"{where}{field + ': ' if field else ''}{message}")

    def at(self, line: int | None, column: int | None, field: str | None = None) -> PolicyError:
        """Return a copy of this error placed at a YAML position (keeps the subclass)."""
        located = type(self).__new__(type(self))
        PolicyError.__init__(located, self.message, line, column, field=field or self.field)
        located.__cause__ = self.__cause__
        return located

    def http_body(self) -> dict[str, object]:
        extra = {"field": self.field, "line": self.line, "column": self.column}
        return {"error": "PolicyError", "message": str(self), **{k: v for k, v in extra.items() if v is not None}}


class PluginNotFoundError(PolicyError):
    """``module:Class`` or an entry point name that does not resolve to anything."""


class PluginImportError(PolicyError):
    """The plugin's module was found but its own import raised; ``__cause__`` holds that exception."""


# --- the node's state -----------------------------------------------------------------------------------------

class TransitionRejected(ColocdError):
    http_status = 409

    def __init__(self, message: str, *, state: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.state = state or {}

    def http_body(self) -> dict[str, object]:
        return {**super().http_body(), **({"state": self.state} if self.state else {})}


class ManifestRefUnknown(TransitionRejected):
    field = "manifest_ref"
    http_fields = ("field",)


class AdapterRefused(TransitionRejected):
    """A LoRA adapter push refused before any engine changed: a reused (immutable) name, or past an adapter cap."""


class AdapterUnsupported(AdapterRefused):
    def __init__(self, engine: str, message: str) -> None:
        super().__init__(f"engine {engine!r} serves no LoRA adapters: {message}", state={"engine": engine})
        self.engine = engine


class AdapterRetired(ColocdError):
    http_status = 410
    http_fields = ("current",)

    def __init__(self, message: str, *, current: str | None) -> None:
        super().__init__(message)
        self.current = current


class SessionGone(ColocdError):
    http_status = 410
    http_fields = ("session_id", "session_state")

    def __init__(self, message: str, *, session_id: str, state: str) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.session_state = state


class NotFound(ColocdError):
    http_status = 404


class TransitionFailed(ColocdError):
    http_status = 502
    http_fields: ClassVar[tuple[str, ...]] = ("engine", "stage")

    def __init__(self, message: str, *, engine: str | None = None, stage: str | None = None) -> None:
        super().__init__(message)
        self.engine = engine
        self.stage = stage


class StageTimeout(TransitionFailed):
    http_status = 504
    http_fields = ("engine", "stage", "budget_s")

    def __init__(self, message: str, *, engine: str, stage: str, budget_s: float) -> None:
        super().__init__(message, engine=engine, stage=stage)
        self.budget_s = budget_s


class MemoryNotConfirmed(ColocdError):
    http_status = 504


class JournalFailed(ColocdError):
    http_status = 507
    http_fields = ("journal",)

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.journal = path


# --- weight sessions ------------------------------------------------------------------------------------------

class WeightSyncError(ColocdError):
    http_status = 502


class WeightsMismatch(WeightSyncError):
    http_fields = ("engine", "tensor")

    def __init__(self, message: str, *, engine: str, tensor: str) -> None:
        super().__init__(message)
        self.engine = engine
        self.tensor = tensor


class ChunkTimeout(WeightSyncError):
    http_status = 504
    http_fields = ("engine", "stage", "budget_s", "rank")

    def __init__(self, message: str, *, stage: str, budget_s: float, engine: str | None = None,
                 rank: int | None = None) -> None:
        super().__init__(message)
        self.engine = engine
        self.stage = stage
        self.budget_s = budget_s
        self.rank = rank


# --- engines (adapters raise only these, or RequestInvalid; never an httpx type) ------------------------------

class EngineError(ColocdError):
    http_status = 502
    http_fields = ("engine",)

    def __init__(self, engine: str, message: str) -> None:
        super().__init__(f"engine {engine!r}: {message}")
        self.engine = engine
        self.detail = message


class EngineUnreachable(EngineError):
    http_status = 503


class EngineTimeout(EngineError):
    http_status = 504


class EngineRejected(EngineError):
    def __init__(self, engine: str, message: str, *, status: int, body: str = "") -> None:
        super().__init__(engine, message)
        self.status = status
        self.body = body


class EngineProtocolError(EngineError):
    """The engine's answer did not match the protocol we expected."""


class EngineMismatch(EngineProtocolError):
    """The engine runs with another layout than its config declares (e.g. tp_size); nothing is sent to it."""


class EngineLaunchError(EngineError):
    """``str()`` carries the log tail; ``summary`` is one line (what failed, where the log is) for a CLI."""

    def __init__(self, engine: str, message: str, *, log_path: Path | None = None, tail: str = "") -> None:
        where = f"; log {log_path}" if log_path is not None else ""
        super().__init__(engine, f"{message}{where}" + (f":\n{tail}" if tail else ""))
        self.summary = f"engine {engine!r}: {message}{where}"
        self.log_path = log_path
        self.tail = tail


class ReplyInvalid(ColocdError):
    """A reply without the shape colocd reads, where the engine's name is unknown (the adapter re-raises it)."""


# --- the caller's side: clients, the cluster fan-out, the CLI -------------------------------------------------

class ColocdHTTPError(ColocdError):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        self.error = str(body.get("error", "Error"))
        super().__init__(f"HTTP {status} {self.error}: {body.get('message', body)}")

    def __reduce__(self) -> tuple[type[ColocdHTTPError], tuple[int, dict[str, Any]]]:
        # Pickled with its constructor's arguments, so a Ray actor raising it keeps the daemon's error body.
        return (type(self), (self.status, self.body))


class DaemonUnreachable(ColocdError, ConnectionError):
    """No answer came back from the daemon: it refused the connection, dropped it, or did not reply in time."""


class CliFailure(ColocdError):
    def __init__(self, line: str, exit_code: int = 1) -> None:
        super().__init__(line)
        self.exit_code = exit_code


class EngineMissing(ColocdError):
    """The live demo's engine venv or tiny model is not installed; the message names the install script."""


class MatplotlibMissing(ColocdError, RuntimeError):
    """Drawing needs matplotlib, an optional extra."""
