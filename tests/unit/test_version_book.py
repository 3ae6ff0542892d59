"""What counts as a weight version, and for how long (daemon/versions.py), and the rollout refusal's words."""

from __future__ import annotations

import pytest

from colocd.daemon.states import NodeState, check_rollout_staleness
from colocd.daemon.versions import VersionBook
from colocd.errors import TransitionRejected


def _book(*committed: str) -> VersionBook:
    book = VersionBook()
    for i, version in enumerate(committed):
        book.opened(version, f"s{i}")
        book.committed(version)
    return book


def test_an_open_sessions_version_counts_until_the_session_ends_uncommitted() -> None:
    book = _book("1")
    book.opened("2", "abc")
    assert (book.latest, book.staleness("1")) == ("2", 1)
    book.withdrawn("2", "abc")
    assert (book.latest, book.staleness("1")) == ("1", 0)


def test_a_committed_version_stays_when_a_later_session_for_it_is_withdrawn() -> None:
    book = _book("1", "2")
    book.opened("2", "again")  # a re-push of version 2, aborted
    book.withdrawn("2", "again")
    assert (book.latest, book.staleness("2")) == ("2", 0)


def test_withdrawing_names_the_session_so_another_sessions_version_is_untouched() -> None:
    book = _book("1")
    book.opened("2", "new")
    book.withdrawn("2", "old")  # a session that ended earlier, for the same version string
    assert book.latest == "2"


def test_re_committing_a_committed_version_is_a_rollback_that_withdraws_the_versions_after_it() -> None:
    book = _book("1", "2", "3")
    book.opened("2", "rollback")
    book.committed("2")
    assert (book.latest, book.staleness("2")) == ("2", 0)
    assert [v for v, _ in book.newer("1")] == ["2"]


def test_a_first_commit_keeps_versions_the_trainer_already_reported_after_it() -> None:
    book = _book("1")
    book.opened("2", "s")
    book.started("3")  # async: the trainer runs a version ahead of the push
    book.committed("2")
    assert (book.latest, book.staleness("2")) == ("3", 1)


def test_newer_says_why_each_version_counts() -> None:
    book = _book("1")
    book.opened("2", "abc")
    book.started("3")
    assert book.newer("1") == [("2", "session abc open"), ("3", VersionBook.REPORTED)]
    assert [v for v, _ in book.newer(None)] == ["1", "2", "3"]


def test_the_rollout_refusal_names_the_open_session_and_says_aborting_withdraws_it() -> None:
    book = _book("1")
    book.opened("2", "abc")
    served = {"e0": "1"}
    with pytest.raises(TransitionRejected) as refused:
        check_rollout_staleness(served, book.lags(served), book.latest, 0, NodeState(),
                                newer={"e0": book.newer("1")})
    message = str(refused.value)
    assert "engine 'e0' serves version '1', 1 version(s) behind" in message
    assert "newer: '2' (session abc open)" in message and "abort it, which withdraws its version" in message
    assert "wait for the push to land" not in message


def test_the_rollout_refusal_for_a_reported_version_says_to_push_it_or_roll_back() -> None:
    book = _book("1")
    book.started("2")
    served = {"e0": "1"}
    with pytest.raises(TransitionRejected, match="push the version the trainer reported, or re-push a committed"):
        check_rollout_staleness(served, book.lags(served), book.latest, 0, NodeState(),
                                newer={"e0": book.newer("1")})
