"""colocd on a real multi-node Ray cluster on one machine (issue 13): one daemon per node, steps fanned out.

Three Ray nodes (``ray.cluster_utils.Cluster``: separate raylets with distinct node ids, one CPU each)
each get a ``NodeDaemon`` actor pinned to them, which runs ``colocd serve``; the daemon launches a
reference engine from its ``launch:`` section. A trainer actor on every node pushes to its own node's
daemon. The driver steps the cluster through ``ClusterClient``. Every step ends on every engine's own
weight checksum equal to the trainer's weights. One node's engine is SIGKILLed mid-step: the step
fails naming that node and engine, the other nodes keep the new version paused, rollout is refused
everywhere, and after that node's daemon relaunched the engine and reconciled it, redoing the sync
and the next step pass. A node added between steps gets a daemon and is covered by the next step.
An actor killed outright leaves neither its daemon nor the engine the daemon launched.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback (see deploy/ray/local_cluster.py)
ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'colocd[ray]' (or the test extra)")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from colocd.cluster import ClusterClient, ClusterStepError  # noqa: E402
from colocd.cluster.registry import NodeDaemons, NodeSpec, daemon_urls, list_daemons  # noqa: E402
from colocd.engines.reference.model import QwenLikeConfig, build_model  # noqa: E402
from deploy.ray.local_cluster import NODE_ARGS, local_cluster  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]

SPEC = NodeSpec(  # the daemon launches ref0, and relaunches it soon after it dies
    engines=[{"kind": "reference", "name": "ref0",
              "launch": {"ready_timeout_s": 120, "backoff_initial_s": 0.2, "backoff_max_s": 1}}],
    daemon={"timeouts": {"health_interval_s": 0.5, "default_s": 20}},
    listen_host="127.0.0.1",
)


def model_for(step: int) -> Any:
    """The trainer's weights after ``step`` (the same on every node: data-parallel ranks agree)."""
    return build_model(QwenLikeConfig(), seed=step * 101)


@ray.remote(num_cpus=0)
class Trainer:
    """A trainer rank: holds the model of the step and pushes it to its own node's daemon."""

    async def push(self, step: int) -> dict[str, Any]:
        from colocd.cluster.registry import push_to_this_node

        return await push_to_this_node(model_for(step).named_parameters(), version=f"v{step}", step=step,
                                       bucket_mb=0.05)

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())


def trainer_on(node_id: str) -> Any:
    return Trainer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()


class World:
    """The cluster under test: Ray nodes, their daemons, a trainer per node, the step counter."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.daemons = NodeDaemons(SPEC)  # job-scoped: they go when the test's driver disconnects
        self.trainers: dict[str, Any] = {}
        self.step = 0

    def refresh(self) -> dict[str, dict[str, Any]]:
        infos = self.daemons.ensure()
        for node in infos:
            if node not in self.trainers:
                self.trainers[node] = trainer_on(node)
        return infos

    def push(self, node: str) -> Any:
        return self.trainers[node].push.remote(self.step)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with local_cluster(nodes=3) as cluster:
        w = World(cluster)
        w.refresh()
        try:
            yield w
        finally:
            w.daemons.stop()


async def launched_engines() -> dict[str, dict[str, Any]]:
    """Each node's ``ref0`` as its daemon launched it: ``/v1/status`` → ``engines.ref0.launched``."""
    async with ClusterClient(daemon_urls()) as cluster:
        status = await cluster.status()
    return {n: r.body["engines"]["ref0"]["launched"] for n, r in status.nodes.items()}


def trained_checksum(step: int) -> str:
    """What every engine TP rank's checksum is once it serves step ``step``'s weights."""
    from support import weights_checksum  # here: Ray's workers import this module without tests/ on their path

    return weights_checksum(model_for(step).named_parameters())


async def checksums_by_node() -> dict[str, str]:
    from support import served_checksums

    engines = await launched_engines()
    sums = await asyncio.gather(*(served_checksums(e["url"]) for e in engines.values()))
    return {node: rank for node, (rank,) in zip(engines, sums, strict=True)}  # each engine's one TP rank


async def full_step(world: World, cluster: ClusterClient) -> None:
    world.step += 1
    await cluster.phase("train", world.step)
    pushed = await cluster.sync(world.step, f"v{world.step}", world.push)
    assert all(r.body["node_id"] == n for n, r in pushed.nodes.items()), "a rank pushed to another node's daemon"
    await cluster.rollout(world.step)


async def until(what: str, check: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.1)  # poll cadence, bounded by the deadline


# --- the specification ---------------------------------------------------------------------------


async def test_every_node_runs_its_own_daemon_and_full_steps_reach_every_engine(world: World) -> None:
    infos = list_daemons()
    assert len(infos) == 3 and len({i["url"] for i in infos.values()}) == 3
    # Each trainer rank really runs on the node whose daemon it pushes to (checked per push below too).
    assert {n: ray.get(t.node_id.remote()) for n, t in world.trainers.items()} == {n: n for n in infos}
    async with ClusterClient(daemon_urls()) as cluster:
        for _ in range(2):
            await full_step(world, cluster)
            want = trained_checksum(world.step)
            assert await checksums_by_node() == {n: want for n in infos}
        status = await cluster.status()
        for node, r in status.nodes.items():
            assert r.body["node"] == {"phase": "rollout", "step": world.step}, node
            assert r.body["engines"]["ref0"]["weight_version"] == f"v{world.step}", node


async def test_an_engine_killed_mid_step_fails_the_step_naming_it_and_the_cluster_recovers(world: World) -> None:
    infos = list_daemons()
    victim = sorted(infos)[1]
    old_pid = (await launched_engines())[victim]["pid"]
    async with ClusterClient(daemon_urls()) as cluster:
        world.step += 1
        step = world.step
        await cluster.phase("train", step)

        def push_or_kill(node: str) -> Any:
            if node == victim:
                os.kill(old_pid, signal.SIGKILL)  # mid-step: after 'sync' resumed weights, before its push
            return world.push(node)

        with pytest.raises(ClusterStepError) as failed:
            await cluster.sync(step, f"v{step}", push_or_kill)
        [failure] = failed.value.result.failures
        assert (failure.node_id, failure.engine) == (victim, "ref0"), str(failed.value)
        assert victim in str(failed.value) and "ref0" in str(failed.value)
        print(f"the failed step, as the trainer sees it:\n{failed.value}")

        # The other nodes committed v<step> but serve nothing; rollout is refused everywhere.
        with pytest.raises(ClusterStepError) as refused:
            await cluster.rollout(step)
        assert victim in {f.node_id for f in refused.value.result.failures}
        for node, r in (await cluster.status()).nodes.items():
            assert r.body["node"]["phase"] == "sync", f"{node} left sync although the cluster's sync failed"
            # The killed engine's generation is unknown until its relaunch is reconciled (then paused, like the rest).
            allowed = {"paused", "unknown"} if node == victim else {"paused"}
            assert r.body["engines"]["ref0"]["generation"] in allowed, node

        # The victim's daemon relaunches the engine (same URL) and reconciles the new incarnation at once.
        async def reconciled() -> bool:
            status = (await cluster.status()).nodes[victim].body
            engine, last = status["engines"]["ref0"]["launched"], status["reconcile"]["last"].get("ref0") or {}
            return engine["pid"] != old_pid and engine["restarts"] == 1 and engine["state"] == "running" \
                and bool(last.get("restarted")) and bool(last.get("ok"))
        await until("engine relaunched and reconciled", reconciled)

        redo = await cluster.sync(step, f"v{step}", world.push)
        assert {n for n, r in redo.nodes.items() if "skipped" not in (r.body or {})} == {victim}
        await cluster.rollout(step)
        want = trained_checksum(step)
        assert await checksums_by_node() == {n: want for n in infos}

        await full_step(world, cluster)
        want = trained_checksum(world.step)
        assert await checksums_by_node() == {n: want for n in infos}


async def test_a_node_added_between_steps_gets_a_daemon_and_the_next_step_covers_it(world: World) -> None:
    async with ClusterClient(daemon_urls()) as cluster:
        before = set(cluster.nodes)
        world.cluster.add_node(**NODE_ARGS)
        world.refresh()
        joined, left = await cluster.set_nodes(daemon_urls())
        assert len(joined) == 1 and left == [] and set(cluster.nodes) == before | set(joined)
        await full_step(world, cluster)
        want = trained_checksum(world.step)
        sums = await checksums_by_node()
        assert set(sums) == before | set(joined) and set(sums.values()) == {want}


async def test_the_deploy_ray_example_runs_its_rl_loop_on_the_cluster(world: World) -> None:
    """deploy/ray/rl_loop.py's loop, two steps on this cluster (``python deploy/ray/rl_loop.py`` starts its own)."""
    spec = importlib.util.spec_from_file_location("rl_loop", REPO / "deploy/ray/rl_loop.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = await example.run(steps=2)
    assert [r["step"] for r in rows] == [world.step + 1, world.step + 2]
    world.step += 2
    assert all(r["nodes"] == len(world.trainers) for r in rows)
    # The second step's batch was generated on the weights the first step synced, on every node.
    assert rows[1]["versions_seen"] == [f"v{rows[0]['step']}"]
    sums = await checksums_by_node()
    assert len(set(sums.values())) == 1 and len(sums) == len(world.trainers)


async def test_an_actor_killed_outright_leaves_neither_its_daemon_nor_its_engine(world: World) -> None:
    """``ray.kill`` runs none of the actor's code: only the tethers (actor → daemon → engine) stop them.

    Last in the module: it takes one node's daemon away.
    """
    node = sorted(world.trainers)[0]
    daemon_pid = int(list_daemons()[node]["daemon_pid"])
    engine_pid = int((await launched_engines())[node]["pid"])
    assert pid_alive(daemon_pid) and pid_alive(engine_pid)
    ray.kill(world.daemons.handles.pop(node), no_restart=True)
    deadline = time.monotonic() + 60
    while pid_alive(daemon_pid) or pid_alive(engine_pid):
        assert time.monotonic() < deadline, f"daemon {daemon_pid} or engine {engine_pid} outlived the actor by 60s"
        await asyncio.sleep(0.1)  # polling for the kernel's kills, bounded by the deadline


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's zombie is reaped by init, not us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
