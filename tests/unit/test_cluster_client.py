"""What the cluster client makes of one node's failure: the daemon's error body, across a process boundary."""

from __future__ import annotations

import pickle

from colocd.api.client import ColocdHTTPError, DaemonUnreachable
from colocd.cluster import ClusterStepError, NodeResult, StepResult
from colocd.cluster.client import failure_of

BODY = {"error": "EngineUnreachable", "message": "engine 'ref0': server_info: ConnectError", "engine": "ref0"}


class RemoteTaskError(Exception):
    """Stands in for Ray's task error: it keeps the remote exception as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def test_a_daemon_error_keeps_its_body_when_pickled_to_another_process() -> None:
    copy = pickle.loads(pickle.dumps(ColocdHTTPError(503, BODY)))
    assert (copy.status, copy.body, copy.error) == (503, BODY, "EngineUnreachable")


def test_a_failure_names_the_node_the_engine_and_the_daemons_reason_through_a_remote_wrapper() -> None:
    failure = failure_of("node-b", RemoteTaskError(ColocdHTTPError(503, BODY)))
    assert (failure.node_id, failure.engine, failure.error, failure.status) == ("node-b", "ref0",
                                                                              "EngineUnreachable", 503)
    assert failure.describe() == "node node-b engine ref0: EngineUnreachable (503): " + BODY["message"]


def test_an_unreachable_daemon_is_a_failure_of_its_node_not_a_crash_of_the_step() -> None:
    failure = failure_of("node-c", DaemonUnreachable("GET http://node-c/v1/status: ClientConnectorError"))
    assert (failure.error, failure.status, failure.engine) == ("DaemonUnreachable", None, None)


def test_the_step_error_lists_every_failed_node_and_what_the_others_were_left_doing() -> None:
    result = StepResult("sync@3", {
        "a": NodeResult("a", 0.1, body={"ok": True}),
        "b": NodeResult("b", 0.2, failure=failure_of("b", ColocdHTTPError(503, BODY))),
    }, 0.2, notes=["nodes holding v3 (paused in sync, not serving): ['a']"])
    text = str(ClusterStepError(result))
    assert text.splitlines()[0] == "sync@3 failed on 1 of 2 nodes:"
    assert "node b engine ref0: EngineUnreachable (503)" in text and "holding v3" in text
