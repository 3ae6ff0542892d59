"""Every error the daemon raises, in one tree; the api maps each class to one HTTP status (api/errors.py).

The root and ``RequestInvalid`` live in ``colocd.errors`` and the engine errors in ``engines/errors.py``,
so adapters raise members of this same tree without importing the daemon.

    ColocdError (colocd.errors)                                                            → 500
    ├── RequestInvalid (colocd.errors) the caller's request is wrong (names the field); nothing changed → 422
    │   └── PayloadRejected     an engine refused the caller's payload (engine's words)          → 422
    ├── ConfigError (daemon/config.py) the node config file is missing or invalid          → 400
    ├── TransitionRejected      illegal from the current state; nothing changed        → 409
    │   └── ManifestRefUnknown  an open names a manifest_ref this daemon does not hold; .field → 409
    ├── SessionGone             a weight session that expired, was aborted or committed → 410
    ├── NotFound                unknown engine / session / step                          → 404
    ├── TransitionFailed        an engine call failed mid-transition; .engine, .step    → 502
    │   └── StepTimeout         an engine call exceeded its budget; .budget_s            → 504
    ├── MemoryNotConfirmed      NVML never showed the released bytes back               → 504
    ├── JournalFailed           the state changed but its journal record is not on disk; .path → 507
    ├── WeightSyncError         a weight session failed or was aborted                  → 502
    │   ├── ChunkTimeout        a chunk not complete in time; .engine/.rank, .step, .budget_s → 504
    │   └── WeightsMismatch     an engine holds other weights than the trainer pushed; .engine, .tensor → 502
    └── EngineError (engines/errors.py) .engine                                         → 502
        ├── EngineUnreachable                                                           → 503
        ├── EngineTimeout                                                               → 504
        ├── EngineRejected                                                              → 502
        └── EngineProtocolError                                                         → 502

    PolicyError (policies/errors.py; policies import nothing of ours, so outside the tree) → 400
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..engines.errors import (
    EngineError,
    EngineProtocolError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
)
from ..engines.httpmap import is_payload_refusal
from ..errors import ColocdError, RequestInvalid

__all__ = [
    "ChunkTimeout",
    "ColocdError",
    "EngineError",
    "EngineProtocolError",
    "EngineRejected",
    "EngineTimeout",
    "EngineUnreachable",
    "JournalFailed",
    "ManifestRefUnknown",
    "MemoryNotConfirmed",
    "NotFound",
    "PayloadRejected",
    "RequestInvalid",
    "SessionGone",
    "StepTimeout",
    "TransitionFailed",
    "TransitionRejected",
    "WeightSyncError",
    "WeightsMismatch",
    "caller_payload",
    "refused_payload",
]


class TransitionRejected(ColocdError):
    """The request is illegal in the current state; the state is unchanged."""

    def __init__(self, message: str, *, state: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.state = state or {}


class ManifestRefUnknown(TransitionRejected):
    """An open names a ``manifest_ref`` this daemon process holds no manifest for (it restarted, or the manifest
    fell out of the few it keeps): the request was well formed, the daemon's memory is what lacks it. Nothing
    changed; the trainer sends the manifest itself (``field`` names the field at fault)."""

    field = "manifest_ref"


class PayloadRejected(RequestInvalid):
    """An engine answered 400 to data the caller supplied (a handle, a layout): the caller's mistake,
    carrying the engine's own words. The engine is left as the daemon's state says."""

    def __init__(self, message: str, *, engine: str, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.engine = engine


class SessionGone(ColocdError):
    """A weight session that no longer accepts work: expired, aborted, failed or committed."""

    def __init__(self, message: str, *, session_id: str, state: str) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.state = state


class NotFound(ColocdError):
    """An engine, session or step that does not exist."""


class TransitionFailed(ColocdError):
    """An engine call failed during a transition; the engine was left in a safe (paused) state."""

    def __init__(self, message: str, *, engine: str | None = None, step: str | None = None) -> None:
        super().__init__(message)
        self.engine = engine
        self.step = step


class StepTimeout(TransitionFailed):
    """An engine call did not finish within its step's budget; the message names the step and budget."""

    def __init__(self, message: str, *, engine: str, step: str, budget_s: float) -> None:
        super().__init__(message, engine=engine, step=step)
        self.budget_s = budget_s


class MemoryNotConfirmed(ColocdError):
    """The released memory never showed up as free within the deadline."""


class JournalFailed(ColocdError):
    """The node's state changed but its journal record could not be written (``path``: the journal's file): a
    daemon restarted now would resume from an older state."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class WeightSyncError(ColocdError):
    """A weight session failed or was aborted; engines stay paused at the old version."""


class WeightsMismatch(WeightSyncError):
    """A verified commit found an engine's digest of ``tensor`` other than the trainer's (daemon/verify.py)."""

    def __init__(self, message: str, *, engine: str, tensor: str) -> None:
        super().__init__(message)
        self.engine = engine
        self.tensor = tensor


class ChunkTimeout(WeightSyncError):
    """A chunk did not complete in time: a rank never sent its part (``engine`` None, ``rank`` set) or an
    engine never consumed it (``engine`` set). ``step`` is ``gather`` or ``load_chunk``; ``budget_s`` the
    chunk budget."""

    def __init__(self, message: str, *, step: str, budget_s: float, engine: str | None = None,
                 rank: int | None = None) -> None:
        super().__init__(message)
        self.engine = engine
        self.step = step
        self.budget_s = budget_s
        self.rank = rank


def refused_payload(exc: BaseException, *, field: str | None = None,
                    describe: Callable[[EngineRejected], str] | None = None) -> PayloadRejected | None:
    """The caller's 422 if ``exc`` is an engine's refusal of data the caller wrote, else None.

    Only a refusal (``engines.httpmap.is_payload_refusal``: 400/413/422) is the caller's, keeping the engine's
    words (``describe`` words the message; by default it names ``field``); an engine that fails (5xx,
    unreachable, timeout) stays an engine error (502/503/504).
    """
    if not isinstance(exc, EngineRejected) or not is_payload_refusal(exc):
        return None
    message = describe(exc) if describe is not None else f"{exc} (the request's {field or 'payload'} was refused)"
    return PayloadRejected(message, engine=exc.engine, field=field)


@contextmanager
def caller_payload(field: str | None = None) -> Iterator[None]:
    """Engine calls in this block carry data the caller wrote: an engine's refusal of it is the caller's 422
    (``refused_payload``).

        with caller_payload("handle"):
            await ops.load_chunk(engine, load)
    """
    try:
        yield
    except EngineRejected as exc:
        if (refusal := refused_payload(exc, field=field)) is None:
            raise
        raise refusal from exc
