"""SGLang's ``/weights_checker`` checksums, read and compared; no HTTP here (the adapter calls the route).

A ``checksum`` reply (0.5.23 http_server.py:1599-1619) holds, per TP rank, one checksum per (fused)
parameter, e.g. ``model.layers.0.self_attn.qkv_proj.weight``, and one over the rank's weights. Two servers
serve the same weights exactly when every per-parameter checksum agrees.
"""

from __future__ import annotations

from collections.abc import Mapping

from . import wire

__all__ = ["differing", "parameter_checksums"]


def parameter_checksums(result: wire.CheckWeightsResult) -> dict[str, str]:
    """``{"tp<rank>/<parameter>": checksum}`` over every rank of a checksum reply (empty if it has none)."""
    return {f"tp{i}/{name}": value for i, rank in enumerate(result.ranks or ())
            for name, value in rank.checksums.items()}


def differing(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """The parameters whose checksum differs or that only one side has, sorted; empty when they agree."""
    return sorted(k for k in expected.keys() | actual.keys() if expected.get(k) != actual.get(k))
