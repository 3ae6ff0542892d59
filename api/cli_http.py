"""One HTTP call from the command line to a running daemon, with every expected failure as one line.

    with DaemonCall("http://127.0.0.1:7000", token=None) as call:
        body = call.json("GET", "/v1/status")        # raises CliFailure("colocd: no daemon answers at ...")

Imports httpx only (no torch, no engines), so a CLI read of a daemon that is down fails in a fraction
of a second instead of after torch's import.
"""

from __future__ import annotations

from typing import Any

import httpx

from ..errors import CliFailure

__all__ = ["DEFAULT_URL", "DaemonCall", "add_daemon_options", "daemon_call"]

DEFAULT_URL = "http://127.0.0.1:7000"

_CONNECT_S = 3.0  # loopback or a local socket: a refusal is immediate, a silent peer is the only slow case


class DaemonCall:
    """A short-lived client for one daemon URL (``http://host:port`` or ``unix:/path``)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        if url.startswith("unix:"):
            base, transport = "http://colocd", httpx.HTTPTransport(uds=url.removeprefix("unix:"))
        elif url.startswith(("http://", "https://")):
            base, transport = url.rstrip("/"), None
        else:
            raise CliFailure(f"colocd: --url {url!r} is neither http://host:port nor unix:/path/to.sock", 2)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base, transport=transport, headers=headers, trust_env=False,
                                  timeout=httpx.Timeout(timeout_s, connect=_CONNECT_S))

    def __enter__(self) -> DaemonCall:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """The daemon's answer to one request; a 4xx/5xx or a transport failure raises ``CliFailure``."""
        try:
            response = self._http.request(method, path, **kw)
        except httpx.ConnectError as exc:
            raise CliFailure(f"colocd: no daemon answers at {self.url} ({_reason(exc)}); start one with "
                             "`colocd serve --config FILE`, or point --url at it") from None
        except httpx.TimeoutException:
            raise CliFailure(f"colocd: the daemon at {self.url} did not answer {method} {path} within "
                             f"{self.timeout_s:g} s; is it overloaded or stuck? (see its log)") from None
        except httpx.TransportError as exc:
            raise CliFailure(f"colocd: lost the connection to the daemon at {self.url}: {_reason(exc)}") from None
        if response.status_code == 401:
            raise CliFailure(f"colocd: the daemon at {self.url} refused the request (401): pass its token "
                             "with --token")
        if response.status_code >= 400:
            raise CliFailure(f"colocd: {method} {path} failed with HTTP {response.status_code}: "
                             f"{_message(response)}")
        return response

    def json(self, method: str, path: str, **kw: Any) -> Any:
        response = self.request(method, path, **kw)
        try:
            return response.json()
        except ValueError:
            raise CliFailure(f"colocd: {self.url} answered {method} {path} with something that is not JSON; "
                             "is --url a colocd daemon?") from None


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


def _reason(exc: httpx.TransportError) -> str:
    """The innermost OS reason ("Connection refused"), not httpx's generic wrapper text."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    return str(exc) or type(exc).__name__


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:300] if response.text.strip() else "(empty body)"
    if isinstance(body, dict):
        return str(body.get("message") or body.get("detail") or body)
    return str(body)
