"""Shared fixtures: real servers on loopback ports chosen by the OS, readiness polled with a deadline.

Under ``pytest -n N --dist loadfile`` (scripts/test.sh runs two workers) each module is one unit of work, so a
module-scoped fixture is built once and a module's tests run in file order on one worker; tests/vllm/ is one unit,
so a single worker starts the session's vLLM server. A module marked ``exclusive`` runs while no other worker is
inside a module. ``engine_pool`` and ``pooled_engine`` hand out the module's reference engines
(tests/support.py's ``EnginePool``), reset through their API after each test.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# A shared server that died fails its later tests with its log tail (tests/shared_server.py); the xdist
# controller loads only this conftest, so the hooks are registered here.
from shared_server import pytest_report_teststatus, pytest_runtest_makereport  # noqa: F401
from support import EnginePool

VLLM_TESTS = Path(__file__).parent / "vllm"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none here)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and unused) without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, except that tests/vllm/ is one unit: its files share one session vLLM server whose
    weights and sleep state they change in turn, and a second server would cost a worker ~2 GiB and a start.

    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest-xdist 3.8 cannot rename
    pytest 9's node ids, so its groups are ignored.)
    """
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    vllm = VLLM_TESTS.relative_to(config.rootpath).as_posix() + "/"

    class LoadFileVLLMTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return vllm if nodeid.startswith(vllm) else str(super()._split_scope(nodeid))

    return LoadFileVLLMTogether(config, log)


class _ModuleLock:
    """Under xdist, a module marked ``exclusive`` holds the run's module lock alone; every other module holds it
    shared, from before its first test's setup (its module fixtures, their daemons' health loops) until after
    its last test's teardown.

    A writer-preference reader/writer lock over two flock files: everyone passes the gate to take the lock, and
    an exclusive module keeps the gate until it has the lock, so the other worker's next module cannot slip in.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._gate = open(directory / "gate", "a")  # both open for the worker's session (close())
        self._modules = open(directory / "modules", "a")
        self.held_for: Path | None = None

    def enter(self, module: Path, *, exclusive: bool) -> None:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._modules, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.held_for = module

    def leave(self) -> None:
        fcntl.flock(self._modules, fcntl.LOCK_UN)
        self.held_for = None

    def close(self) -> None:
        self._gate.close()
        self._modules.close()


_MODULE_LOCK = pytest.StashKey[_ModuleLock]()  # this worker's, in its config, made at its first test


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's: waiting here is not the test's time
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing runs beside it
        yield
        return
    lock = item.config.stash.get(_MODULE_LOCK, None)
    if lock is None:
        lock = item.config.stash[_MODULE_LOCK] = _ModuleLock(Path(tempfile.gettempdir()) / f"colocd-pytest-{run}")
        item.config.add_cleanup(lock.close)
    if lock.held_for != item.path:
        if lock.held_for is not None:
            lock.leave()
        lock.enter(item.path, exclusive=item.get_closest_marker("exclusive") is not None)
    try:
        yield
    finally:
        if nextitem is None or nextitem.path != item.path:  # this item's teardown ended the module's fixtures
            lock.leave()


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    # Proxies would route loopback test traffic away; tokens from the caller's shell would leak in.
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)




@pytest.fixture(scope="module")
def engine_pool() -> Iterator[EnginePool]:
    """The module's reference engines (tests/support.py): started at first use, reset after each test."""
    pool = EnginePool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def pooled_engine(engine_pool: EnginePool) -> Iterator[Any]:
    """A reference engine ``ref0`` at seed 0, as fresh as a new process (the module's, reset after the test)."""
    proc = engine_pool.borrow()
    yield proc
    engine_pool.give_back(proc)
