"""ipc_ring by reference (engines/ring_refs.py): what the daemon keeps of a ring's announcements and of what
each engine incarnation holds. Pure data; the daemon and the engine use these records, tested end to end in
tests/integration/test_ring_refs.py (CPU) and tests/gpu/test_ring_refs.py (CUDA IPC)."""

from __future__ import annotations

from typing import Any

import pytest

from colocd.engines.ring_refs import EngineRingRefs, RefMismatch, RefUnknown, RingDirectory, layout_digest

LAYOUT = [{"name": "w", "dtype": "float32", "shape": [4], "offset": 0, "slot": 2},
          {"name": "b", "dtype": "float32", "shape": [2], "offset": 0, "slot": 3}]
REF = layout_digest(LAYOUT)
HANDLES = {"2": {"handle": "aGFuZGxlMg==", "storage_offset": 0}, "3": {"handle": "aGFuZGxlMw==", "storage_offset": 0}}


def _announcing(**extra: Any) -> dict[str, Any]:
    return {"ring": "r1", "device_uuid": "u", "layout_ref": REF, "layout": LAYOUT, "open": HANDLES, **extra}


def _by_ref(**extra: Any) -> dict[str, Any]:
    return {"ring": "r1", "device_uuid": "u", "layout_ref": REF, **extra}


def test_a_layout_digest_ignores_key_order_but_not_content() -> None:
    reordered = [{k: e[k] for k in reversed(list(e))} for e in LAYOUT]
    assert layout_digest(reordered) == REF
    assert layout_digest([{**LAYOUT[0], "offset": 256}, LAYOUT[1]]) != REF


def test_a_chunk_by_ref_resolves_to_what_the_ring_announced() -> None:
    rings = RingDirectory()
    rings.resolve(_announcing())
    assert rings.resolve(_by_ref()) == _announcing()


def test_a_descriptor_without_a_layout_ref_is_left_as_it_is() -> None:
    legacy = {"ring": "r1", "slot": 0, "layout": LAYOUT}
    assert RingDirectory().resolve(legacy) is legacy


def test_a_ref_never_announced_is_unknown_and_named() -> None:
    with pytest.raises(RefUnknown) as err:
        RingDirectory().resolve(_by_ref())
    assert (err.value.ring, err.value.ref, err.value.field) == ("r1", REF, "layout_ref")


def test_a_layout_reading_a_slot_whose_handle_was_never_announced_is_unknown() -> None:
    rings = RingDirectory()
    with pytest.raises(RefUnknown) as err:
        rings.resolve(_announcing(open={"2": HANDLES["2"]}))  # slot 3's handle missing
    assert err.value.field == "open" and err.value.slots == [3]
    assert rings.resolve(_by_ref(open={"3": HANDLES["3"]})) == _announcing()  # announced now: resolved


def test_a_ref_that_is_not_its_layouts_digest_is_refused_and_not_recorded() -> None:
    rings = RingDirectory()
    with pytest.raises(RefMismatch):
        rings.resolve(_announcing(layout_ref="0" * 32))
    with pytest.raises(RefUnknown):
        rings.resolve(_by_ref(layout_ref="0" * 32))


def test_each_daemon_record_has_its_own_id() -> None:
    assert RingDirectory().id != RingDirectory().id


def test_an_engine_gets_everything_inline_until_it_loaded_it_then_refs_only() -> None:
    held = EngineRingRefs()
    full = _announcing()
    assert held.outgoing(0, full) == full
    held.learned(0, full)
    assert held.outgoing(0, full) == _by_ref()
    assert held.outgoing(1, full) == full  # another TP rank holds its own table


def test_a_slot_whose_handle_changed_is_inlined_again() -> None:
    held = EngineRingRefs()
    held.learned(0, _announcing())
    moved = {**HANDLES, "3": {"handle": "bmV3", "storage_offset": 0}}
    assert held.outgoing(0, _announcing(open=moved)) == _by_ref(open={"3": moved["3"]})


def test_an_engine_forgotten_gets_everything_inline_again() -> None:
    held = EngineRingRefs()
    held.learned(0, _announcing())
    held.forget()
    assert held.outgoing(0, _announcing()) == _announcing()


def test_what_a_reader_builds_from_a_layout_ref_is_built_once_and_a_failed_build_is_not_kept() -> None:
    directory = RingDirectory()
    calls: list[str] = []

    def build() -> list[str]:
        calls.append("built")
        return ["parsed"]

    first = directory.derived("ref-a", build)
    assert directory.derived("ref-a", build) is first and calls == ["built"]

    def broken() -> list[str]:
        raise ValueError("bad layout")

    with pytest.raises(ValueError, match="bad layout"):
        directory.derived("ref-b", broken)
    assert directory.derived("ref-b", build) == ["parsed"] and calls == ["built", "built"]
