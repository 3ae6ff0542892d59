"""Daemon calls from the command line, with every expected failure as one line.

    with daemon_call(args) as call:
        body = call("GET /v1/status", ColocdClient.status)   # raises CliFailure("colocd: no daemon answers at ...")

The calls go through the daemon's one client (``api.client``: no torch, no engines, so a CLI read of a daemon that
is down fails in a fraction of a second); this module only words its failures for a terminal.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp

from ..errors import CliFailure, ColocdHTTPError, DaemonUnreachable
from .client import ColocdClient

__all__ = ["DEFAULT_URL", "DaemonCall", "add_daemon_options", "daemon_call"]

DEFAULT_URL = "http://127.0.0.1:7000"

_T = TypeVar("_T")


class DaemonCall:
    """A short-lived client for one daemon URL (``http://host:port`` or ``unix:/path``)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        if not url.startswith(("http://", "https://", "unix:")):
            raise CliFailure(f"colocd: --url {url!r} is neither http://host:port nor unix:/path/to.sock", 2)
        self.url = url
        self.timeout_s = timeout_s
        self._client = ColocdClient(url, token=token, timeout_s=timeout_s)

    def __enter__(self) -> DaemonCall:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def __call__(self, route: str, call: Callable[[ColocdClient], _T]) -> _T:
        """``call``'s answer; a failure of ``route`` (``"GET /v1/status"``: what the line names) is ``CliFailure``."""
        try:
            return call(self._client)
        except DaemonUnreachable as exc:
            cause = exc.__cause__
            if isinstance(cause, TimeoutError):
                raise CliFailure(f"colocd: the daemon at {self.url} did not answer {route} within {self.timeout_s:g} "
                                 "s; is it overloaded or stuck? (see its log)") from None
            if isinstance(cause, aiohttp.ClientConnectorError):
                raise CliFailure(f"colocd: no daemon answers at {self.url} ({_reason(cause)}); start one with "
                                 "`colocd serve --config FILE`, or point --url at it") from None
            raise CliFailure(f"colocd: lost the connection to the daemon at {self.url}: {_reason(cause)}") from None
        except ColocdHTTPError as exc:
            if exc.status == 401:
                raise CliFailure(f"colocd: the daemon at {self.url} refused the request (401): pass its token "
                                 "with --token") from None
            message = exc.body.get("message") or exc.body.get("detail") or exc.body
            raise CliFailure(f"colocd: {route} failed with HTTP {exc.status}: {message}") from None
        except ValueError:
            raise CliFailure(f"colocd: {self.url} answered {route} with something that is not JSON; is --url a "
                             "colocd daemon?") from None


def add_daemon_options(p: Any, *, timeout_s: float = 30.0) -> None:
    """``--url``, ``--token`` and ``--timeout``: how every command that reads or changes a daemon reaches it."""
    p.add_argument("--url", default=DEFAULT_URL, help="the daemon: http://host:port or unix:/path/to.sock")
    p.add_argument("--token", default=None,
                   help="bearer token, when the daemon's config sets one (default: none sent)")
    p.add_argument("--timeout", type=float, default=timeout_s, metavar="SECONDS",
                   help="how long to wait for each answer before giving up")


def daemon_call(args: Any) -> DaemonCall:
    """The one client of ``status``, ``top``, ``trace`` and ``policy apply``: same URL check, same wording."""
    return DaemonCall(args.url, token=args.token, timeout_s=args.timeout)


def _reason(exc: BaseException | None) -> str:
    """The innermost OS reason ("Connection refused"), not the client library's wrapper text."""
    cause = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
        cause = getattr(cause, "os_error", None) or cause.__cause__ or cause.__context__
    return str(exc) or type(exc).__name__
