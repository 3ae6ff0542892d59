"""``ipc_ring`` descriptors by reference: a layout named by its digest, a slot's handle announced once.

A trainer pushes the same buckets every step, so the layout list (hundreds of ``{name, dtype, shape,
offset, slot}``) and the CUDA IPC handles of the ring's slots (or zero-copy regions) are the same every
push; sending them every time is most of a push's control cost. With refs:

- trainer -> daemon: a chunk always carries ``layout_ref`` (``layout_digest`` of its layout). It carries
  the ``layout`` list and the ``open`` handles only until the daemon acknowledged them once: the
  producer tracks what this daemon instance (``RingDirectory.id``, in every join reply as
  ``ring_refs``) has acked, and starts over when the id changes (a daemon restart).
- the daemon (``RingDirectory``) keeps, per ring, every layout by digest and every slot's handle, and
  resolves each chunk to its full descriptor before any check. A ref it does not hold is refused (409
  ``RingRefUnknown`` naming the ring and ref; the trainer re-sends the chunk in full), never guessed.
- daemon -> engine: per engine incarnation and TP rank (``EngineRingRefs``, reset whenever the engine
  attaches: first contact or an observed restart), the daemon inlines the layout and handles that rank
  has not acknowledged yet, and sends only refs for the rest. An engine that lacks a ref anyway (it
  restarted unobserved, or evicted the ring) refuses the chunk naming ``UNKNOWN_REF_MARK``, applying
  nothing; the daemon then forgets what it believed of that engine and re-sends the chunk in full once.

A descriptor without ``layout_ref`` is the original format and travels unchanged. Pure data: no torch.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..recent import remember

__all__ = [
    "UNKNOWN_REF_MARK",
    "EngineRingRefs",
    "RefMismatch",
    "RefUnknown",
    "RingDirectory",
    "handle_key",
    "layout_digest",
    "slots_of",
]

# In an engine's refusal: the chunk named a layout or slot this engine does not hold (re-send it in full).
UNKNOWN_REF_MARK = "colocd_ring_unknown_ref"
_DIGEST_CHARS = 32  # 128 bits of sha256: no two layouts of one ring collide by accident


def layout_digest(layout: list[Any]) -> str:
    """The ref of a layout list: a short sha256 of its canonical JSON (key order does not count)."""
    canonical = json.dumps(layout, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:_DIGEST_CHARS]


def handle_key(handle: Any) -> str:
    """What identifies one exported buffer (the IPC handle and where in its storage the buffer starts)."""
    if not isinstance(handle, dict):
        return repr(handle)
    return f"{handle.get('handle')}@{handle.get('storage_offset')}"


def slots_of(slot: Any, layout: Iterable[Any]) -> frozenset[int]:
    """Every slot a chunk reads: the chunk's own ``slot`` (flattened chunks) and each entry's (zero copy)."""
    used = {e["slot"] for e in layout if isinstance(e, dict) and isinstance(e.get("slot"), int)}
    if isinstance(slot, int) and not isinstance(slot, bool):
        used.add(slot)
    return frozenset(used)


class RefUnknown(ValueError):
    """A descriptor names a layout ref or slot the receiver does not hold; ``field`` says which part."""

    def __init__(self, message: str, *, ring: str, field: str, ref: str | None = None,
                 slots: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.ring = ring
        self.field = field
        self.ref = ref
        self.slots = sorted(slots)


class RefMismatch(ValueError):
    """A descriptor's ``layout_ref`` is not the digest of the ``layout`` it carries: the sender's mistake."""


@dataclass
class _Ring:
    layouts: OrderedDict[str, tuple[list[Any], frozenset[int]]] = field(default_factory=OrderedDict)
    handles: dict[int, dict[str, Any]] = field(default_factory=dict)  # slot -> its exported handle


class RingDirectory:
    """The daemon's record of what each trainer ring announced, so chunks may carry refs only.

    ``id`` names this record (a fresh one per daemon process): a trainer whose producer announced to
    another id announces again. Bounded: the oldest ring, and a ring's oldest layout, are dropped first;
    a dropped one is simply unknown (409), and the trainer re-sends it.
    """

    def __init__(self, max_rings: int = 64, max_layouts: int = 8192) -> None:
        self.id = secrets.token_hex(8)
        self.max_rings = max_rings
        self.max_layouts = max_layouts
        self._rings: OrderedDict[str, _Ring] = OrderedDict()
        self._derived: OrderedDict[str, Any] = OrderedDict()  # layout_ref -> what a reader built from it

    def derived(self, ref: str, build: Callable[[], Any]) -> Any:
        """``build()``'s result, kept per ``ref`` (a digest of the layout, so the result cannot go stale): the
        daemon parses a 399-tensor layout once, not on every push. An exception is not kept."""
        if ref in self._derived:
            self._derived.move_to_end(ref)
            return self._derived[ref]
        value = build()
        remember(self._derived, ref, value, self.max_layouts)
        return value

    def resolve(self, handle: dict[str, Any]) -> dict[str, Any]:
        """The full descriptor of a chunk: ``layout`` and, under ``open``, the handle of every slot it reads.

        Records what it announces first. A descriptor without ``layout_ref`` is returned as it is.
        Raises ``RefUnknown`` for a ref or slot never announced here, ``RefMismatch`` for a ref that is not
        its layout's digest, ``ValueError`` for a malformed descriptor.
        """
        ref = handle.get("layout_ref")
        if ref is None:
            return handle
        ring_id = handle.get("ring")
        if not isinstance(ring_id, str) or not ring_id:
            raise ValueError("an ipc_ring descriptor with a layout_ref needs a 'ring' id")
        if not isinstance(ref, str) or not ref:
            raise ValueError("layout_ref must be a non-empty string")
        opening = handle.get("open")
        if opening is not None and not isinstance(opening, dict):
            raise ValueError("open must be an object of slot -> handle")
        layout = handle.get("layout")
        if layout is not None and not isinstance(layout, list):
            raise ValueError("layout must be a list")
        # Checked before anything is recorded: a wrong ref must not name a layout it is not.
        if layout is not None and layout_digest(layout) != ref:
            raise RefMismatch(f"layout_ref {ref!r} is not the digest of the layout it carries "
                              f"({layout_digest(layout)!r}): compute it with layout_digest")
        ring = self._ring(ring_id)
        for key, announced in (opening or {}).items():
            try:
                ring.handles[int(key)] = announced
            except (TypeError, ValueError):
                raise ValueError(f"open: slot {key!r} is not an integer") from None
        if layout is not None:
            remember(ring.layouts, ref, (layout, slots_of(None, layout)), self.max_layouts)
        known = ring.layouts.get(ref)
        if known is None:
            raise RefUnknown(f"ring {ring_id}: layout_ref {ref!r} is unknown to this daemon (restarted, or it "
                             "dropped the ring): send the chunk with its layout", ring=ring_id, field="layout_ref",
                             ref=ref)
        ring.layouts.move_to_end(ref)
        used = known[1] | slots_of(handle.get("slot"), ())
        missing = [s for s in used if s not in ring.handles]
        if missing:
            raise RefUnknown(f"ring {ring_id}: slot{'s' if len(missing) > 1 else ''} {sorted(missing)[:8]} never "
                             "announced to this daemon: send the chunk with their handles under 'open'",
                             ring=ring_id, field="open", ref=ref, slots=missing)
        full = {**handle, "layout": known[0], "open": {str(s): ring.handles[s] for s in sorted(used)}}
        return full

    def _ring(self, ring_id: str) -> _Ring:
        ring = self._rings.get(ring_id) or _Ring()
        remember(self._rings, ring_id, ring, self.max_rings)
        return ring


@dataclass
class _Held:
    layouts: set[str] = field(default_factory=set)
    handles: dict[int, str] = field(default_factory=dict)  # slot -> handle_key


class EngineRingRefs:
    """What one engine incarnation's TP ranks hold of each ring, as the daemon last saw them acknowledge.

    A cache of observations: entries are added only after the engine loaded a chunk that carried them,
    and the whole record is dropped when the engine attaches again (a new incarnation) or refuses a ref.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[int, str], _Held] = {}

    def outgoing(self, tp_rank: int, handle: dict[str, Any]) -> dict[str, Any]:
        """``handle`` (a resolved descriptor) without the layout and handles this TP rank already holds."""
        ref = handle.get("layout_ref")
        if ref is None:
            return handle
        held = self._held.get((tp_rank, str(handle.get("ring"))))
        if held is None:
            return handle
        out = {k: v for k, v in handle.items() if k not in ("layout", "open")}
        if ref not in held.layouts:
            out["layout"] = handle["layout"]
        opening = {k: h for k, h in (handle.get("open") or {}).items() if held.handles.get(int(k)) != handle_key(h)}
        if opening:
            out["open"] = opening
        return out

    def learned(self, tp_rank: int, handle: dict[str, Any]) -> None:
        """The TP rank loaded a chunk described by ``handle`` (resolved): it holds its layout and handles now."""
        ref = handle.get("layout_ref")
        if ref is None:
            return
        held = self._held.setdefault((tp_rank, str(handle.get("ring"))), _Held())
        held.layouts.add(str(ref))
        for key, h in (handle.get("open") or {}).items():
            held.handles[int(key)] = handle_key(h)

    def forget(self) -> None:
        """The engine may hold none of it (it restarted, or said it lacks a ref)."""
        self._held.clear()
