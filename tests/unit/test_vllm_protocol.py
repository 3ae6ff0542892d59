"""What colocd negotiates with a vLLM server from the routes it publishes (engines/vllm/protocol.py)."""

from __future__ import annotations

import pytest

from colocd.engines.vllm.protocol import (
    OPTIONAL_ROUTES,
    REQUIRED_ROUTES,
    TESTED,
    VLLMRoutes,
    lacking,
    untested_warning,
)

# The dev/RL routes vLLM 0.29.0 registers (research/engine-versions.md §A.1): 0.32's less the optional ones.
V0_29 = VLLMRoutes(frozenset(REQUIRED_ROUTES) | {"/health", "/version", "/v1/completions"})


def test_a_server_publishing_every_required_route_misses_none() -> None:
    assert V0_29.missing_required() == []


@pytest.mark.parametrize("route", sorted(OPTIONAL_ROUTES))
def test_a_route_0_29_lacks_is_named_with_what_it_costs(route: str) -> None:
    assert not V0_29.has(route)
    message = lacking(route, "0.29.0")
    assert message.startswith(f"vLLM 0.29.0 has no {route}: ")
    assert OPTIONAL_ROUTES[route] in message


def test_a_missing_dev_route_points_at_dev_mode() -> None:
    routes = VLLMRoutes(frozenset({"/health", "/version"}))
    assert routes.missing_required() == list(REQUIRED_ROUTES)
    assert not routes.has("/pause")
    assert "VLLM_SERVER_DEV_MODE=1" in lacking("/pause", "0.32.0")


def test_a_server_without_a_route_table_is_assumed_to_have_every_route() -> None:
    routes = VLLMRoutes(None)
    assert routes.missing_required() == []
    assert all(routes.has(r) for r in OPTIONAL_ROUTES)


@pytest.mark.parametrize("version", [*TESTED, "0.30.1", "0.31.0+cpu"])
def test_versions_inside_the_tested_range_attach_without_a_warning(version: str) -> None:
    assert untested_warning(version) is None


@pytest.mark.parametrize("version", ["0.28.2", "0.33.0", "0.32.1rc1", "1.0.0", "dev"])
def test_versions_outside_the_tested_range_warn_in_one_line_naming_it(version: str) -> None:
    line = untested_warning(version)
    assert line is not None and "\n" not in line
    assert f"{TESTED[0]}..{TESTED[-1]}" in line
