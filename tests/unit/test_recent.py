"""``remember``: the one bounded insert behind every memory of recent things (ended sessions, manifests, rings)."""

from __future__ import annotations

from collections import OrderedDict

from colocd.recent import remember


def test_it_keeps_at_most_capacity_entries_dropping_the_oldest_and_naming_them() -> None:
    entries: OrderedDict[str, int] = OrderedDict()
    dropped = [remember(entries, key, value, 2) for value, key in enumerate("abcd")]
    assert list(entries.items()) == [("c", 2), ("d", 3)]
    assert dropped == [[], [], ["a"], ["b"]]


def test_remembering_a_key_again_makes_it_the_most_recent() -> None:
    entries: OrderedDict[str, int] = OrderedDict()
    remember(entries, "a", 1, 2)
    remember(entries, "b", 2, 2)
    remember(entries, "a", 3, 2)
    assert remember(entries, "c", 4, 2) == ["b"]
    assert entries == OrderedDict([("a", 3), ("c", 4)])
