"""The root of colocd's exception tree, where every layer that raises can import it.

Engines (``engines/errors.py``) and the daemon (``daemon/errors.py``) both subclass ``ColocdError``;
``daemon/errors.py`` draws the whole tree and ``api/errors.py`` maps each class to one HTTP status.
Policies import nothing of ours, so ``policies.PolicyError`` stands apart (mapped in ``api/errors.py``).
"""

from __future__ import annotations

__all__ = ["ColocdError", "RequestInvalid"]


class ColocdError(Exception):
    """Base class of every error colocd raises on purpose; anything else reaching the api is a bug (500)."""


class RequestInvalid(ColocdError):
    """The caller's request is wrong (a field out of range, a handle that cannot be read); nothing changed.

    Raised before the first engine call wherever colocd can tell (the daemon, or an adapter turning a
    chunk into its engine's wire format); ``field`` names the offending field.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
