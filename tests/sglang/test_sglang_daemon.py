"""A real SGLang 0.5.23 on CPU driven through a real ``colocd serve``: the README's trainer snippet at its
defaults, restarts of the engine and of the daemon, and refusals that keep SGLang alive.

One SGLang server for the module, attached by URL (as an operator's server is); a restart of it is a fresh
launch of the last pushed weights, which is what "the pushed weights equal a fresh launch" is checked
against. Steps are synchronous, as the README's TrainerClient is.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sglang_live import LiveServer, checksums_sync, differing, greedy_sync, launch, save_model, step_weights
from support import DaemonNode, daemon_node, entered_in_thread

from colocd.api.client import ColocdHTTPError
from colocd.trainer import TrainerClient

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]

DEADLINE_S = 120


@pytest.fixture(scope="module")
def daemon(live: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """The module's ``colocd serve`` over the SGLang server (tests/support.py's ``daemon_node``, on a loop of its
    own thread: the tests are synchronous) and ``run(coroutine)`` on that loop."""
    if live.error is not None:  # every test fails on the server's error (the sglang fixture)
        yield None, None
        return
    workdir = tmp_path_factory.mktemp("colocd")
    with entered_in_thread(daemon_node([{"kind": "sglang", "name": "sg", "url": live.url}], subprocess=True,
                                       workdir=workdir, journal=str(workdir / "journal.jsonl"),
                                       deadline_s=DEADLINE_S)) as entered:
        yield entered


@pytest.fixture
def node(daemon: tuple[DaemonNode, Any]) -> DaemonNode:
    return daemon[0]


def step(c: TrainerClient, model_dir: Path, k: int, weights_of: int | None = None) -> Any:
    """The README's snippet, once: train, sync, push (every default), rollout."""
    c.phase("train", k)
    named = step_weights(model_dir, weights_of or k)
    c.phase("sync", k)
    report = c.push_weights(named, version=str(k))
    c.phase("rollout", k)
    return report


def wait_for(what: str, probe: Any) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while (got := probe()) is None or got is False:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)  # polling a condition with a deadline
    return got


def test_the_readme_snippet_at_its_defaults_serves_each_steps_weights_as_sglang_loading_them_does(
        sglang: LiveServer, node: DaemonNode, model_dir: Path, tmp_path: Path) -> None:
    url = sglang.url
    original = checksums_sync(url)
    with TrainerClient(node.url) as c:
        c.wait_ready(DEADLINE_S)
        for k in (1, 2, 3):
            report = step(c, model_dir, k)
            assert report.chunks >= 1 and report.commit
            engine = c.status()["engines"]["sg"]
            assert (engine["weight_version"], engine["generation"], engine["weights"]) == (str(k), "serving", "clean")
            pushed, served = checksums_sync(url), greedy_sync(url)
            assert differing(original, pushed) == sorted(original)  # new weights, every parameter
            # SGLang loading the same checkpoint itself (what a fresh launch loads) serves the same bytes and tokens.
            path = save_model(model_dir, step_weights(model_dir, k), tmp_path / f"step-{k}")
            r = httpx.post(f"{url}/update_weights_from_disk", timeout=DEADLINE_S, trust_env=False,
                           json={"model_path": str(path), "weight_version": str(k)})
            assert r.status_code == 200, r.text
            assert differing(pushed, checksums_sync(url)) == []
            assert greedy_sync(url) == served
            original = pushed


def test_a_chunk_by_a_transport_sglang_cannot_load_is_refused_before_sglang_sees_it(
        sglang: LiveServer, node: DaemonNode, model_dir: Path) -> None:
    named = step_weights(model_dir, 7)
    with TrainerClient(node.url) as c:
        c.phase("train", 7)
        c.phase("sync", 7)
        for transport in ("shm", "disk"):
            with pytest.raises(ColocdHTTPError) as refused:
                c.push_weights(named, version="7", transport=transport)
            assert refused.value.status == 422 and refused.value.body.get("field") == "transport"
            assert transport in refused.value.body["message"] and "inline" in refused.value.body["message"]
        assert httpx.get(f"{sglang.url}/model_info", trust_env=False).status_code == 200  # SGLang lives
        c.push_weights(named, version="7")
        c.phase("rollout", 7)


def test_a_resume_of_a_resident_tag_is_refused_by_the_daemon_where_sglang_would_die(
        sglang: LiveServer, node: DaemonNode) -> None:
    # SGLang 0.5.23's scheduler dies on resume of a resident tag (KeyError in weight_updater.py:390,
    # then SIGQUIT); the daemon knows residency and refuses.
    with TrainerClient(node.url) as c:
        with pytest.raises(ColocdHTTPError) as refused:
            c.resume(["kv_cache"])
        assert refused.value.status == 409
    assert greedy_sync(sglang.url)  # still serving


def test_a_sigkilled_sglang_restarted_is_reconciled_and_served_again_after_a_push(
        sglang: LiveServer, node: DaemonNode, model_dir: Path, tmp_path: Path) -> None:
    with TrainerClient(node.url) as c:
        step(c, model_dir, 8, weights_of=3)
        pushed, served = checksums_sync(sglang.url), greedy_sync(sglang.url)
        before = c.status()["engines"]["sg"]["incarnation"]
        assert sglang.server is not None
        port = int(sglang.url.rsplit(":", 1)[1])
        os.killpg(sglang.server.process.pid, signal.SIGKILL)
        wait_for("SGLang to exit", lambda: not sglang.server.process.running)  # type: ignore[union-attr]
        # A fresh launch of the pushed weights, on the same port (the daemon attaches by URL).
        fresh_dir = save_model(model_dir, step_weights(model_dir, 3), tmp_path / "fresh")
        sglang.server = asyncio.run(launch(str(fresh_dir), sglang.log.with_name("restarted.log"), port=port))
        assert differing(pushed, checksums_sync(sglang.url)) == []  # a fresh launch serves the same bytes

        def reconciled() -> dict[str, Any] | None:
            engine = c.status()["engines"]["sg"]
            return engine if engine["incarnation"] not in (None, before) and engine["healthy"] else None

        engine = wait_for("the daemon to see the restart", reconciled)
        assert engine["weights"] == "stale" and engine["generation"] == "paused"  # launch weights are not v8
        step(c, model_dir, 9, weights_of=3)
        assert c.status()["engines"]["sg"]["generation"] == "serving"
        assert greedy_sync(sglang.url) == served


def test_a_restarted_daemon_adopts_sglang_as_it_is(sglang: LiveServer, daemon: tuple[DaemonNode, Any],
                                                   model_dir: Path) -> None:
    node, run = daemon
    with TrainerClient(node.url) as c:
        step(c, model_dir, 10, weights_of=2)
    served = greedy_sync(sglang.url)
    run(node.stop())
    run(node.restart())
    with TrainerClient(node.url) as c:
        c.wait_ready(DEADLINE_S)
        status = c.status()
        engine = status["engines"]["sg"]
        assert (status["node"]["phase"], status["node"]["step"]) == ("rollout", 10)
        assert (engine["weight_version"], engine["generation"]) == ("10", "serving")
        assert greedy_sync(sglang.url) == served
        step(c, model_dir, 11, weights_of=1)
        assert c.status()["engines"]["sg"]["weight_version"] == "11"
