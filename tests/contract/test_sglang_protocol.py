"""Which protocol a reported SGLang version gets, from the cut-overs read in the released wheels."""

from __future__ import annotations

import dataclasses

import pytest

from colocd.engines.base import PauseMode
from colocd.engines.sglang import protocol as protocol_module
from colocd.engines.sglang.protocol import (
    LEGACY,
    PRE_SESSION,
    SESSION_MIN_VERSION,
    TESTED,
    V0_5_23,
    negotiated,
    parse_version,
    protocol_for_version,
    untested_warning,
)

# The control routes each tested release publishes in /openapi.json (research/engine-versions.md §B.1).
ROUTES_0_5_20 = frozenset({"/pause_generation", "/continue_generation", "/flush_cache", "/ready", "/model_info",
                           "/server_info", "/update_weights_from_tensor", "/weights_checker",
                           "/release_memory_occupation", "/resume_memory_occupation", "/update_weight_version"})
ROUTES_0_5_23 = ROUTES_0_5_20 | {"/begin_weight_update", "/end_weight_update"}


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.5.23", V0_5_23),
        ("0.5.21", V0_5_23),  # first wheel with /begin_weight_update (http_server.py:1400)
        ("v0.5.21", V0_5_23),
        ("0.5.21.post1", V0_5_23),
        ("0.5.30rc2", V0_5_23),
        ("0.6.0", V0_5_23),
        ("1.0", V0_5_23),  # newer than anything read: assumed to keep the newest protocol
        ("0.5.20", PRE_SESSION),  # no /begin_weight_update in the 0.5.20 wheel
        ("0.5.21rc0", PRE_SESSION),  # PEP 440: a pre-release orders before its release
        ("0.5.21.dev12+g1a2b3c", PRE_SESSION),
        ("0.5.10rc0", PRE_SESSION),
        ("0.5.9", PRE_SESSION),
        ("0.5.9.post2+cu129", PRE_SESSION),
        ("0.5.6", PRE_SESSION),  # first wheel whose /pause_generation parses a body
        ("0.5.5", LEGACY),
        ("0.5.4.post1", LEGACY),
        ("0.5.4", LEGACY),
        (" 0.5.4 ", LEGACY),
    ],
)
def test_version_picks_its_protocol(version: str, expected: protocol_module.SGLangProtocol) -> None:
    assert protocol_for_version(version) is expected


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("0.0.0.dev0", "source build"),  # sglang/version.py's fallback when no metadata exists
        ("0.5.3", "older than 0.5.4"),
        ("0.4.10.post2", "older than 0.5.4"),
        ("", "unrecognised"),
        ("main", "unrecognised"),
        ("0.5.x", "unrecognised"),
    ],
)
def test_versions_that_say_nothing_usable_are_refused_by_name(version: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        protocol_for_version(version)


def test_parse_version_orders_like_pep_440() -> None:
    order = ["0.5.21.dev3", "0.5.21a1", "0.5.21b2", "0.5.21rc0", "0.5.21", "0.5.21.post1", "0.5.22"]
    parsed = [parse_version(v) for v in order]
    assert parsed == sorted(parsed)
    assert parse_version("0.5.4.post1") == (0, 5, 4, 1, 1)
    assert parse_version(SESSION_MIN_VERSION) == (0, 5, 21, 0, 0)


def test_only_the_session_protocol_requires_begin_and_end() -> None:
    assert V0_5_23.weight_update_session
    assert not PRE_SESSION.weight_update_session and not LEGACY.weight_update_session
    assert not LEGACY.has_struct("BeginWeightUpdateReqInput")


def test_legacy_pauses_only_by_abort_and_reads_the_version_from_its_own_route() -> None:
    assert LEGACY.pause_modes == (PauseMode.ABORT,)
    assert LEGACY.weight_version_route == "/get_weight_version"
    assert V0_5_23.weight_version_route == PRE_SESSION.weight_version_route == "/model_info"


def test_protocols_are_immutable_data() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        V0_5_23.weight_update_session = False  # type: ignore[misc]
    assert hash(V0_5_23) != hash(LEGACY)


def test_protocol_exports_are_sorted_and_complete() -> None:
    # ruff RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical.
    assert protocol_module.__all__ == sorted(
        protocol_module.__all__, key=lambda n: (not n.isupper(), not n[0].isupper(), n)
    )
    assert all(hasattr(protocol_module, n) for n in protocol_module.__all__)


def test_routes_of_0_5_20_settle_its_band_without_a_session() -> None:
    settled = negotiated(protocol_for_version("0.5.20"), ROUTES_0_5_20)
    assert settled.weight_update_session is False
    assert not settled.has_struct("BeginWeightUpdateReqInput")


def test_routes_of_0_5_23_keep_its_protocol_as_is() -> None:
    assert negotiated(V0_5_23, ROUTES_0_5_23) is V0_5_23


def test_a_pre_release_publishing_the_session_routes_is_driven_with_the_session() -> None:
    settled = negotiated(protocol_for_version("0.5.21rc0"), ROUTES_0_5_23)
    assert settled.weight_update_session is True
    assert settled.has_struct("BeginWeightUpdateReqInput") and settled.has_struct("EndWeightUpdateReqInput")
    assert settled.name == "pre-session+routes"


def test_a_server_publishing_no_route_table_keeps_its_versions_band() -> None:
    assert negotiated(PRE_SESSION, None) is PRE_SESSION


@pytest.mark.parametrize("version", [*TESTED, "0.5.21", "0.5.22.post1"])
def test_tested_versions_attach_without_a_warning(version: str) -> None:
    assert untested_warning(version) is None


@pytest.mark.parametrize("version", ["0.5.9", "0.5.24", "0.6.0", "0.0.0.dev0", "main"])
def test_untested_versions_warn_in_one_line_naming_the_range(version: str) -> None:
    line = untested_warning(version)
    assert line is not None and "\n" not in line and f"{TESTED[0]}..{TESTED[-1]}" in line
