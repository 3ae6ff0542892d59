"""A manifest: what a trainer declares it will send, every tensor's name, dtype and shape in order; its JSON, its
reference, and the book of recent ones a trainer's next open may name instead of sending it again (39 KB for 8B).

The reference is a digest of the canonical content, so equal manifests get equal references in any daemon
process. The book is in memory only: a restarted daemon answers a reference with ``ManifestRefUnknown`` (409),
after which the trainer sends the manifest again.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestRefUnknown
from ..recent import remember

__all__ = ["MANIFEST_REF_PATTERN", "Manifest", "ManifestBook", "TensorMeta", "manifest_from_json",
           "manifest_to_json", "misfits", "reference_of"]

# 128 bits of BLAKE2b as hex: two different manifests sharing a reference is not a case worth handling.
MANIFEST_REF_PATTERN = r"^[0-9a-f]{32}$"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a manifest says of one tensor: its dtype (torch short name) and shape."""

    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


Manifest = dict[str, TensorMeta]


def manifest_from_json(items: Iterable[Mapping[str, Any]]) -> Manifest:
    """``[{name, dtype, shape}, ...]`` → Manifest; a name listed twice is a ValueError."""
    manifest: Manifest = {}
    for item in items:
        name = str(item["name"])
        if name in manifest:
            raise ValueError(f"tensor {name!r} is listed twice")
        manifest[name] = TensorMeta(str(item["dtype"]), tuple(int(d) for d in item["shape"]))
    return manifest


def manifest_to_json(manifest: Mapping[str, TensorMeta]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": m.dtype, "shape": list(m.shape)} for n, m in sorted(manifest.items())]


def misfits(tensors: Iterable[tuple[str, TensorMeta]], against: Manifest, says: str) -> tuple[list[str], list[str]]:
    """The names ``against`` lacks, and each tensor whose dtype or shape differs (``'w' is f32[2], {says} …``)."""
    listed = list(tensors)
    unknown = [name for name, _ in listed if name not in against]
    wrong = [f"{name!r} is {meta.describe()}, {says} {against[name].describe()}"
             for name, meta in listed if name in against and meta != against[name]]
    return unknown, wrong


def reference_of(manifest: Manifest) -> str:
    """The reference of ``manifest``: a digest of [[name, dtype, shape], ...] in its order, as compact JSON (JSON
    escapes every name unambiguously, so no two manifests encode alike)."""
    canonical = json.dumps([[name, meta.dtype, meta.shape] for name, meta in manifest.items()],
                           separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(canonical.encode("ascii"), digest_size=16).hexdigest()


class ManifestBook(OrderedDict[str, Manifest]):
    """The parsed manifests of this process's last ``capacity`` opens by reference, least recently used first
    out; shared by every session that names them, so nothing may change one."""

    def __init__(self, capacity: int = 8) -> None:
        super().__init__()
        self.capacity = capacity

    def resolve(self, ref: str) -> Manifest:
        """The manifest ``ref`` names, else ``ManifestRefUnknown`` (409, naming ``manifest_ref``); changes nothing
        either way: only an open that succeeds is remembered."""
        manifest = self.get(ref)
        if manifest is None:
            raise ManifestRefUnknown(
                f"manifest_ref {ref!r} names no manifest this daemon holds (it keeps the last {self.capacity} "
                "declared to this process, and forgets them when it restarts): send the manifest")
        return manifest

    def remember(self, ref: str, manifest: Manifest) -> None:
        remember(self, ref, manifest, self.capacity)
