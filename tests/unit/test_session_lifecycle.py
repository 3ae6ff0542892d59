"""A weight session's lifecycle as a specification: it ends once, is closed once, and refuses every other move."""

from __future__ import annotations

import pytest

from colocd.daemon.metrics import Metrics
from colocd.daemon.states import NodePhase, NodeState, SessionState, check_session_abortable, require_session_open
from colocd.daemon.trace import Trace
from colocd.daemon.weights import WeightSession
from colocd.errors import SessionGone, TransitionRejected, WeightSyncError


def _session() -> WeightSession:
    return WeightSession(step=1, version="v1", ranks=1, engines=[], depth=1, chunk_timeout_s=1.0,
                         trace=Trace(1, "weights"), metrics=Metrics(), idle_s=30.0)


async def _ended(how: str) -> WeightSession:
    session = _session()
    if how == "commit":
        session.commit()
    elif how == "abort":
        await session.abort("trainer gave up")
    elif how == "expire":
        await session.expire()
    else:
        await session.fail(WeightSyncError("boom"))
    return session


@pytest.mark.parametrize(("how", "state"), [("commit", SessionState.COMMITTED), ("abort", SessionState.ABORTED),
                                            ("expire", SessionState.EXPIRED), ("fail", SessionState.FAILED)])
async def test_an_open_session_may_end_in_each_way_and_then_never_commits(how: str, state: SessionState) -> None:
    session = await _ended(how)
    assert session.state is state
    with pytest.raises(TransitionRejected, match=f"weight session {session.id} is {state.value}: it cannot become "
                                                 "committed"):
        session.commit()
    assert session.state is state


async def test_a_session_commits_once_and_is_then_closed() -> None:
    session = _session()
    assert (session.state, session.closed) == (SessionState.OPEN, False)
    session.commit()
    assert (session.state, session.closed) == (SessionState.COMMITTED, True)
    assert session.close() is False  # closed as it committed: nothing more to close
    with pytest.raises(TransitionRejected, match="is committed"):
        session.commit()
    await session.abort("too late")  # an ended session does not end again
    assert session.state is SessionState.COMMITTED


@pytest.mark.parametrize(("end", "state"), [
    ("abort", SessionState.ABORTED), ("expire", SessionState.EXPIRED), ("fail", SessionState.FAILED)])
async def test_an_ended_session_is_closed_exactly_once(end: str, state: SessionState) -> None:
    session = await _ended(end)
    assert (session.state, session.closed) == (state, False)
    assert session.error
    assert session.close() is True
    assert (session.state, session.closed) == (state, True)
    assert session.close() is False
    with pytest.raises(TransitionRejected):
        session.commit()


async def test_the_first_ending_is_the_one_that_counts() -> None:
    session = _session()
    await session.abort("trainer gave up")
    await session.fail(WeightSyncError("later"))
    assert session.state is SessionState.ABORTED and "trainer gave up" in str(session.error)


def test_an_open_session_cannot_be_closed_before_it_ends() -> None:
    session = _session()
    with pytest.raises(TransitionRejected, match="is open"):
        session.close()
    assert (session.state, session.closed) == (SessionState.OPEN, False)


def test_the_lifecycle_cannot_be_set_from_outside() -> None:
    session = _session()
    with pytest.raises(AttributeError):
        session.state = SessionState.COMMITTED  # type: ignore[misc]
    with pytest.raises(AttributeError):
        session.closed = True  # type: ignore[misc]


def test_work_for_an_ended_session_is_gone_and_says_how_it_ended() -> None:
    require_session_open("s1", SessionState.OPEN)
    with pytest.raises(SessionGone) as gone:
        require_session_open("s1", SessionState.FAILED, error="engine died", advise_new=True)
    assert str(gone.value) == "weight session s1 is failed: engine died; open a new session"
    assert (gone.value.session_id, gone.value.session_state) == ("s1", "failed")
    with pytest.raises(SessionGone, match=r"^weight session s1 is committed$"):
        require_session_open("s1", SessionState.COMMITTED, advise_new=True)


def test_a_committed_session_cannot_be_aborted() -> None:
    node = NodeState(NodePhase.SYNC, 3)
    for state in (SessionState.OPEN, SessionState.ABORTED, SessionState.FAILED, SessionState.EXPIRED):
        check_session_abortable("s1", state, "v3", node)
    with pytest.raises(TransitionRejected, match=r"committed \(version 'v3'\); it cannot be aborted") as caught:
        check_session_abortable("s1", SessionState.COMMITTED, "v3", node)
    assert caught.value.state == {"phase": "sync", "step": 3}
