"""A real SGLang 0.5.23 server on CPU per test module, and the dead-server rule.

The server comes from scripts/install-sglang-cpu.sh (COLOCD_SGLANG_PYTHON, COLOCD_SGLANG_MODEL); colocd's own
launcher starts it (``launch:`` with ``--device cpu``) and the tests attach to it by URL, as ``colocd serve``
does with an operator's server. Tests skip only when that install is absent; a server that is installed but
fails to start, or dies mid-module, fails each test that needs it with the server's log tail (never a
cascade of setup errors). Helpers: tests/sglang_live.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sglang_live import LiveServer, Recorder, ServerDied, install, launch

from colocd.engines.config import SGLangEngineConfig
from colocd.engines.sglang.adapter import SGLangAdapter


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(install()[1])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    try:
        server = asyncio.run(launch(str(model_dir), log))
    except Exception as exc:  # installed but not starting: every test of the module fails saying so
        tail = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
        yield LiveServer(None, log, error=f"SGLang did not start: {exc}\nlog tail:\n{tail}")
        return
    holder = LiveServer(server, log)
    try:
        yield holder
    finally:
        current = holder.server or server
        asyncio.run(current.process.stop(grace_s=15))
        assert current.process.pid is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(current.process.pid, 0)  # the whole process group (tokenizer, scheduler, detokenizer) is gone


@pytest.fixture
def sglang(live: LiveServer) -> LiveServer:
    """The module's server, checked up before the test (a dead one fails this test with its log tail)."""
    live.check()
    return live


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # A dead server found while setting a test up is that test's failure, not a setup error.
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup" and call.excinfo is not None and call.excinfo.errisinstance(ServerDied):
        report.outcome = "failed"
        report.when = "call"


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


@pytest.fixture
async def adapter(sglang: LiveServer, client: httpx.AsyncClient) -> AsyncIterator[SGLangAdapter]:
    config = SGLangEngineConfig(name="sg", url=sglang.url)
    a = SGLangAdapter(config, client)
    await a.attach()
    yield a
    # Back to serving whatever the test did (each call is a no-op when already so).
    if sglang.server is not None and sglang.server.process.running:
        await client.post(f"{sglang.server.url}/continue_generation", json={})


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.write("0.5.23")

