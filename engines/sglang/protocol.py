"""Which SGLang HTTP protocol a server version speaks, as data; knows nothing of HTTP clients or state.

Three variants, read from released wheels' ``http_server.py`` and ``io_struct.py`` (``tests/contract/fixtures/``):

    LEGACY       0.5.4 .. 0.5.5    no pause body (abort only), /get_model_info, /get_weight_version,
                                   /get_server_info, no /ready, no session
    PRE_SESSION  0.5.6 .. 0.5.20   pause/continue bodies with modes, /model_info carries the weight
                                   version (/get_weight_version answers 404 by 0.5.9), no session
    V0_5_23      0.5.21 ..         /begin_weight_update … /end_weight_update required around tensor
                                   and distributed updates (sgl-project/sglang#28001), /ready,
                                   /flush_cache?timeout=

The version picks a band; the routes the server publishes (``/openapi.json``) then settle whether an update needs a
session (``negotiated``), so a pre-release or a backport is driven by what it answers. Outside ``TESTED`` the
adapter attaches with a one-line warning.
"""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass, replace

from ..base import PauseMode

__all__ = ["LEGACY", "PAUSE_BODY_MIN_VERSION", "PRE_SESSION", "PROTOCOLS", "SESSION_MIN_VERSION", "TESTED", "V0_5_23",
           "SGLangProtocol", "negotiated", "parse_version", "protocol_for_version", "untested_warning"]

TESTED = ("0.5.20", "0.5.23")
"""The SGLang releases the live tier runs (scripts/test.sh); docs/sglang.md, "Tested against", says what differs."""

# First release with /begin_weight_update (0.5.21 http_server.py:1400; absent from 0.5.20).
SESSION_MIN_VERSION = "0.5.21"
# First release whose /pause_generation parses PauseGenerationReqInput (0.5.6 http_server.py:1103).
PAUSE_BODY_MIN_VERSION = "0.5.6"
_LEGACY_MIN_VERSION = "0.5.4"  # the oldest release colocd speaks to


@dataclass(frozen=True, slots=True)
class SGLangProtocol:
    """What one band of SGLang versions expects on the wire: routes, bodies and rules."""

    name: str
    # /pause_generation parses a body (0.5.23 http_server.py:1831); False: it reads none and only aborts.
    pause_body: bool
    # /continue_generation parses a ContinueGenerationReqInput body (0.5.23 http_server.py:1844).
    continue_body: bool
    pause_modes: tuple[PauseMode, ...]
    # Tensor and distributed updates need an open session (0.5.23 scheduler_components/weight_updater.py:190-240).
    weight_update_session: bool
    # Where the current weight version is read (its JSON key is ``weight_version``).
    weight_version_route: str
    # Request fields this band lacks, per io_struct class (wire.body drops a default, refuses another value).
    absent_fields: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # io_struct request classes this band does not have at all (its route reads no body or is absent).
    absent_structs: tuple[str, ...] = ()

    def fields_absent(self, struct: str) -> frozenset[str]:
        """The fields of ``struct`` this protocol's SGLang lacks."""
        for name, fields in self.absent_fields:
            if name == struct:
                return frozenset(fields)
        return frozenset()

    def has_struct(self, struct: str) -> bool:
        return struct not in self.absent_structs


_ALL_MODES = (PauseMode.ABORT, PauseMode.RETRACT, PauseMode.IN_PLACE)

V0_5_23 = SGLangProtocol(
    name="0.5.23",
    pause_body=True,
    continue_body=True,
    pause_modes=_ALL_MODES,
    weight_update_session=True,
    weight_version_route="/model_info",  # http_server.py:812; /get_weight_version is gone
)

# Read from the 0.5.9 wheel (the base slime builds on); 0.5.6 and 0.5.14-0.5.20 were checked for
# the routes only. Absent fields are 0.5.9's.
PRE_SESSION = SGLangProtocol(
    name="pre-session",
    pause_body=True,  # 0.5.9 http_server.py:1318-1320
    continue_body=True,  # 0.5.9 http_server.py:1329-1331 (an empty struct)
    pause_modes=_ALL_MODES,  # 0.5.9 io_struct.py:1275
    weight_update_session=False,
    weight_version_route="/model_info",  # 0.5.9 http_server.py:553; /get_weight_version:573 raises 404
    absent_fields=(
        ("ContinueGenerationReqInput", ("torch_empty_cache",)),
        ("UpdateWeightsFromTensorReqInput", ("selector", "torch_empty_cache")),
        ("UpdateWeightsFromDistributedReqInput", ("selector", "torch_empty_cache")),
        ("CheckWeightsReqInput", ("allow_quant_error", "skip_tensor_list", "selector")),
    ),
    absent_structs=("BeginWeightUpdateReqInput", "EndWeightUpdateReqInput"),
)

# Read from the 0.5.4 wheel (research/engine-apis.md §1.9 read GitHub 0025436e, the same surface).
LEGACY = SGLangProtocol(
    name="legacy",
    pause_body=False,  # 0.5.4 http_server.py:1061-1063: pause_generation(request) reads no body
    continue_body=False,  # 0.5.4 http_server.py:1071
    pause_modes=(PauseMode.ABORT,),
    weight_update_session=False,
    weight_version_route="/get_weight_version",  # 0.5.4 http_server.py:488
    absent_fields=(
        ("UpdateWeightsFromTensorReqInput", ("selector", "torch_empty_cache")),
        ("UpdateWeightsFromDistributedReqInput", ("load_format", "selector", "torch_empty_cache")),
        ("UpdateWeightFromDiskReqInput", ("recapture_cuda_graph", "flush_cache", "manifest")),
    ),
    absent_structs=(
        "PauseGenerationReqInput",
        "ContinueGenerationReqInput",
        "BeginWeightUpdateReqInput",
        "EndWeightUpdateReqInput",
        "CheckWeightsReqInput",
    ),
)

PROTOCOLS: dict[str, SGLangProtocol] = {p.name: p for p in (V0_5_23, PRE_SESSION, LEGACY)}

# PEP 440 order of pre/post-release segments: dev < a < b < rc < (final) < post.
_STAGES = {"dev": -4, "a": -3, "alpha": -3, "b": -2, "beta": -2, "rc": -1, "c": -1, "": 0, "post": 1}
_VERSION = re.compile(
    r"""^\s*v?(?P<major>\d+)\.(?P<minor>\d+)(?:\.(?P<micro>\d+))?(?:\.(?P<extra>\d+))?
        [-_.]?(?P<stage>dev|alpha|beta|post|rc|a|b|c)?[-_.]?(?P<num>\d+)?
        (?:[-_.]?dev\d*)?
        (?:\+[\w.]+)?\s*$""",
    re.VERBOSE | re.IGNORECASE,
)


def parse_version(version: str) -> tuple[int, int, int, int, int]:
    """``"0.5.4.post1"`` → ``(0, 5, 4, 1, 1)``: (major, minor, micro, stage, n), ordered as PEP 440; a
    ``ValueError`` naming the string for anything that is not a version."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"unrecognised SGLang version {version!r}")
    stage = (match["stage"] or "").lower()
    num = int(match["num"] or 0)
    return (int(match["major"]), int(match["minor"]), int(match["micro"] or 0), _STAGES[stage], num)


def protocol_for_version(version: str) -> SGLangProtocol:
    """The protocol a server reporting ``version`` speaks. Pre-releases order before their release, as PEP 440
    says; ``0.0.0.dev0`` (a source checkout without version metadata) is refused, as is anything before LEGACY."""
    parsed = parse_version(version)
    if parsed[:2] == (0, 0):
        raise ValueError(
            f"SGLang reports version {version!r}, a source build without version metadata; "
            "its protocol cannot be told from it"
        )
    if parsed >= parse_version(SESSION_MIN_VERSION):
        return V0_5_23
    if parsed >= parse_version(PAUSE_BODY_MIN_VERSION):
        return PRE_SESSION
    if parsed[:3] >= parse_version(_LEGACY_MIN_VERSION)[:3]:
        return LEGACY
    raise ValueError(
        f"SGLang {version!r} is older than {_LEGACY_MIN_VERSION}, the oldest protocol colocd speaks"
    )


_SESSION_STRUCTS = ("BeginWeightUpdateReqInput", "EndWeightUpdateReqInput")


def negotiated(protocol: SGLangProtocol, routes: Set[str] | None) -> SGLangProtocol:
    """``protocol`` (the version's band) with the weight-update session as the published ``routes`` settle it.
    ``routes`` None (no route table) keeps the band as it is."""
    if routes is None:
        return protocol
    session = "/begin_weight_update" in routes and "/end_weight_update" in routes
    absent = tuple(s for s in protocol.absent_structs if s not in _SESSION_STRUCTS)
    if not session:  # the session's structs absent too, in the band's own order where it lists them
        absent = protocol.absent_structs if set(_SESSION_STRUCTS) <= set(protocol.absent_structs) else (
            *absent, *_SESSION_STRUCTS)
    settled = replace(protocol, weight_update_session=session, absent_structs=absent)
    return protocol if settled == protocol else replace(settled, name=f"{protocol.name}+routes")


def untested_warning(version: str) -> str | None:
    """One line when SGLang ``version`` lies outside the tested range (it is attached all the same), else None."""
    try:
        parsed = parse_version(version)
    except ValueError:
        parsed = None
    if parsed is not None and parse_version(TESTED[0]) <= parsed <= parse_version(TESTED[-1]):
        return None
    return (f"SGLang {version} is outside the tested range {TESTED[0]}..{TESTED[-1]}; attached all the same, "
            "routes negotiated from its /openapi.json")
