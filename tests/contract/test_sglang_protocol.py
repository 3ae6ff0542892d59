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
    V0_5_23,
    parse_version,
    protocol_for_version,
)


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
    assert not LEGACY.supports_pause_mode(PauseMode.RETRACT)
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
