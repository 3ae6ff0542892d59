"""One log line per event through the ``colocd.events`` logger: ``key=value`` text, and the same fields in
``record.colocd`` for the JSON formatter (api/logs.py). Every event carries ``engine`` and ``session`` (null where
it is not about one), so a log query can follow one engine or one weight session across events.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["emit", "logfmt"]

log = logging.getLogger("colocd.events")


def logfmt(fields: Mapping[str, Any]) -> str:
    """``k=v`` pairs, None left out; lists as ``a,b``; values with spaces quoted."""
    def value(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}"
        if isinstance(v, list | tuple):
            v = ",".join(map(str, v))
        text = str(v)
        return f'"{text}"' if (" " in text or "=" in text or not text) else text

    return " ".join(f"{k}={value(v)}" for k, v in fields.items() if v is not None)


def emit(event: str, level: int = logging.INFO, *, engine: str | None = None, session: str | None = None,
         **fields: Any) -> None:
    """Log ``event`` once; fields that are None are left out, except ``engine``, ``session`` and a given
    ``error`` (null: no error), so an event's JSON keeps one shape whether or not it failed."""
    out: dict[str, Any] = {"event": event, "engine": engine, "session": session,
                           **{k: v for k, v in fields.items() if v is not None or k == "error"}}
    log.log(level, logfmt(out), extra={"colocd": out})
