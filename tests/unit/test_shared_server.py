"""A shared server that dies mid-session fails each later test that needs it with its log tail, not a cascade
of setup errors (tests/shared_server.py, as tests/vllm/conftest.py uses it for the session's vLLM server).

An inner pytest session runs against a real server process (a tiny HTTP server under colocd's
ManagedProcess, as the vLLM server runs) and one of its tests SIGKILLs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = '''
import sys, time
import httpx, pytest
from colocd.engines.processes import ManagedProcess
from shared_server import SharedServerGuard, remember, pytest_report_teststatus, pytest_runtest_makereport

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a):
        print("served", self.path, flush=True)
s = http.server.HTTPServer(("127.0.0.1", 0), H)
open(sys.argv[1], "w").write(str(s.server_address[1]))
print("the tiny server is up", flush=True)
s.serve_forever()
"""

@pytest.fixture(scope="session")
def server(tmp_path_factory, request):
    d = tmp_path_factory.mktemp("srv")
    proc = ManagedProcess("tiny", [sys.executable, "-c", SERVER, str(d / "port")], {}, label="tiny server",
                          log_file=d / "server.log")
    proc.spawn()
    deadline = time.monotonic() + 30
    while not (d / "port").exists() or not (d / "port").read_text():
        assert time.monotonic() < deadline and proc.running, proc.log_tail()
        time.sleep(0.05)  # readiness poll, bounded by the deadline
    url = f"http://127.0.0.1:{(d / 'port').read_text()}"
    guard = SharedServerGuard("tiny server", proc, health_url=url + "/health")
    remember(request.config, guard)
    yield url, proc, guard
    proc.stop_sync(5)

@pytest.fixture(autouse=True)
def _serves(request):
    if "server" in request.fixturenames:
        request.getfixturevalue("server")[2].check()

@pytest.fixture
def answered(server):
    return httpx.get(server[0] + "/health", trust_env=False).status_code  # a fixture that talks to the server
'''

TESTS_FILE = '''
import os, signal, time
import httpx

def test_1_serves(answered):
    assert answered == 200

def test_2_the_server_dies_during_this_one(server):
    os.kill(server[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while server[1].returncode is None and time.monotonic() < deadline:
        time.sleep(0.02)  # reaping poll, bounded by the deadline
    httpx.get(server[0] + "/health", trust_env=False)

def test_3_needs_it(answered):
    assert answered == 200

def test_4_needs_it_too(answered):
    assert answered == 200

def test_5_does_not_need_it():
    assert True
'''


@pytest.fixture(scope="module")
def inner_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The inner session's report (run once for this module's specs)."""
    tmp_path = tmp_path_factory.mktemp("inner")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(TESTS_FILE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--rootdir", str(tmp_path), "-o", "addopts=", "-rfE", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env).stdout


def test_a_server_that_dies_fails_its_later_tests_with_its_log_tail_and_no_setup_errors(inner_output: str) -> None:
    out = inner_output
    summary = out.strip().splitlines()[-1]
    assert "3 failed, 2 passed" in summary and "error" not in summary, out
    assert "FAILED test_inner.py::test_3_needs_it" in out and "FAILED test_inner.py::test_4_needs_it_too" in out
    for name in ("test_3_needs_it", "test_4_needs_it_too"):
        section = out.split(f"_ {name} _", 1)[1]
        assert "shared server died: the tiny server" in section and "killed by SIGKILL (exit -9)" in section
        assert "the tiny server is up" in section and "served /health" in section  # the log's own lines


def test_the_test_during_which_the_server_died_carries_its_log_tail(inner_output: str) -> None:
    out = inner_output
    section = out.split("_ test_2_the_server_dies_during_this_one _", 1)[1].split("_ test_3_needs_it _", 1)[0]
    assert "tiny server died during this test" in section and "the tiny server is up" in section
