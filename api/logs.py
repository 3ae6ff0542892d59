"""Log output for ``colocd serve``: text lines, or JSON lines with each event's fields (``record.colocd``, from the
``colocd.events`` logger) at the top level, so ``jq 'select(.event=="transition")'`` works on the log."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["JsonFormatter", "configure_logging", "fatal"]

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, the event's fields, and any exception."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out: dict[str, Any] = {"ts": ts, "level": record.levelname.lower(), "logger": record.name,
                               "message": record.getMessage()}
        fields = getattr(record, "colocd", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, fmt: str) -> None:
    """Root handler on stderr in ``fmt`` (text or json); replaces handlers a previous call installed."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # httpx logs every request at INFO: the health loop's observations would drown the daemon's own lines.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


def fatal(message: str, fmt: str) -> None:
    """The one line ``colocd serve`` ends with when it cannot serve, on stderr in the log's format."""
    if fmt == "json":
        record = logging.LogRecord("colocd", logging.CRITICAL, __file__, 0, message, None, None)
        record.colocd = {"event": "fatal", "engine": None, "session": None}
        print(JsonFormatter().format(record), file=sys.stderr, flush=True)
    else:
        print(message, file=sys.stderr, flush=True)
