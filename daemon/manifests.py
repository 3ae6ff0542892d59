"""Manifests by reference: a trainer declares its manifest once, then names it by the reference the open replied.

A manifest (every tensor's name, dtype and shape, in order) is the same from one push to the next, yet it is
the bulk of an open's body (39 KB for an 8B model) and of its parsing. The reference is a digest of the
manifest's canonical content, so equal manifests get equal references in any daemon process; each process keeps
the parsed manifests of its last few opens by reference (``ManifestBook``), in memory only: a restarted daemon
knows none, and answers a reference with ``ManifestRefUnknown`` (409), after which the trainer sends the
manifest again.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from ..errors import ManifestRefUnknown
from ..recent import remember
from .weights import Manifest

__all__ = ["MANIFEST_REF_PATTERN", "ManifestBook", "reference_of"]

# 128 bits of BLAKE2b as hex: two different manifests sharing a reference is not a case worth handling.
MANIFEST_REF_PATTERN = r"^[0-9a-f]{32}$"
_DIGEST_BYTES = 16


def reference_of(manifest: Manifest) -> str:
    """The reference of ``manifest``: a digest of [[name, dtype, shape], ...] in its order, as compact JSON (JSON
    escapes every name unambiguously, so no two manifests encode alike)."""
    canonical = json.dumps([[name, meta.dtype, meta.shape] for name, meta in manifest.items()],
                           separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(canonical.encode("ascii"), digest_size=_DIGEST_BYTES).hexdigest()


class ManifestBook:
    """The parsed manifests of this daemon process's last ``capacity`` opens, by reference, least recently
    used first out. The manifests are shared by every session that names them, so nothing may change one."""

    def __init__(self, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._by_ref: OrderedDict[str, Manifest] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_ref)

    def __contains__(self, ref: object) -> bool:
        return ref in self._by_ref

    def resolve(self, ref: str) -> Manifest:
        """The manifest ``ref`` names; ``ManifestRefUnknown`` (409, naming ``manifest_ref``) if this process
        holds none by that reference. Changes nothing either way: only an open that succeeds is remembered."""
        manifest = self._by_ref.get(ref)
        if manifest is None:
            raise ManifestRefUnknown(
                f"manifest_ref {ref!r} names no manifest this daemon holds (it keeps the last {self._capacity} "
                "declared to this process, and forgets them when it restarts): send the manifest")
        return manifest

    def remember(self, ref: str, manifest: Manifest) -> None:
        """Keep ``manifest`` by ``ref`` (its ``manifest_ref``) as the most recently used one."""
        remember(self._by_ref, ref, manifest, self._capacity)
