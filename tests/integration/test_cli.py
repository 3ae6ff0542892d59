"""The ``colocd`` command as a newcomer meets it: expected failures are one line and a non-zero exit.

Each test runs the real CLI in a subprocess and checks stderr has exactly one line, no traceback,
and says what to do. Unreachable daemons are sockets this test binds and never listens on.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from colocd.daemon.config import load_node_config

REPO = Path(__file__).resolve().parents[2]


def _colocd(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "colocd.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO)


def _one_line_failure(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("colocd: ")
    return lines[0]


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A loopback port this test holds without listening: connecting to it is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _write_config(tmp_path: Path, **overrides: object) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, **overrides}))
    return path


def test_status_without_a_daemon_fails_in_one_line_without_importing_torch(dead_url: str) -> None:
    # In-process main() in a child, so the child can report whether torch was imported (seconds of start-up).
    code = ("import sys; from colocd.cli import main; rc = main(['status', '--url', sys.argv[1]]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, dead_url], capture_output=True, text=True, timeout=120)
    line = _one_line_failure(proc, 1)
    assert f"no daemon answers at {dead_url}" in line and "colocd serve --config" in line
    assert proc.stdout.strip() == "False"


def test_status_on_a_missing_unix_socket_names_the_socket(tmp_path: Path) -> None:
    line = _one_line_failure(_colocd("status", "--url", f"unix:{tmp_path}/colocd.sock"), 1)
    assert f"unix:{tmp_path}/colocd.sock" in line


def test_status_with_a_url_that_is_not_one_is_a_usage_error() -> None:
    line = _one_line_failure(_colocd("status", "--url", "127.0.0.1:7000"), 2)
    assert "http://host:port" in line


def test_policy_apply_without_a_daemon_fails_in_one_line(dead_url: str) -> None:
    line = _one_line_failure(_colocd("policy", "apply", str(REPO / "deploy/policies/default.yaml"),
                                     "--url", dead_url), 1)
    assert "no daemon answers" in line


@pytest.mark.parametrize("command", [["top", "--once"], ["trace", "1", "-o", "step1.png"]], ids=["top", "trace"])
def test_every_daemon_reading_command_without_a_daemon_fails_in_one_line(
        dead_url: str, command: list[str], tmp_path: Path) -> None:
    if command[0] == "trace":
        command = [*command[:-1], str(tmp_path / command[-1])]
    line = _one_line_failure(_colocd(*command, "--url", dead_url), 1)
    assert dead_url in line


READERS = {"status": ["status"], "top": ["top", "--once"], "trace": ["trace", "1", "-o", "step1.png"]}


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A loopback port that accepts connections (the kernel's backlog) and never answers: a stuck daemon."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _read(command: str, url: str, tmp_path: Path, *extra: str) -> str:
    args = [a if a != "step1.png" else str(tmp_path / a) for a in READERS[command]]
    proc = _colocd(*args, "--url", url, *extra)
    return _one_line_failure(proc, 2 if "://" not in url and not url.startswith("unix:") else 1)


@pytest.mark.parametrize("command", sorted(READERS))
def test_status_top_and_trace_say_the_same_when_no_daemon_answers(command: str, dead_url: str,
                                                                   tmp_path: Path) -> None:
    line = _read(command, dead_url, tmp_path)
    assert line == (f"colocd: no daemon answers at {dead_url} (Connection refused); start one with "
                    "`colocd serve --config FILE`, or point --url at it")


@pytest.mark.parametrize("command", sorted(READERS))
def test_status_top_and_trace_refuse_a_url_that_is_not_one_alike(command: str, tmp_path: Path) -> None:
    line = _read(command, "127.0.0.1:7000", tmp_path)
    assert line == "colocd: --url '127.0.0.1:7000' is neither http://host:port nor unix:/path/to.sock"


@pytest.mark.parametrize("command", sorted(READERS))
def test_status_top_and_trace_name_what_timed_out(command: str, silent_url: str, tmp_path: Path) -> None:
    line = _read(command, silent_url, tmp_path, "--timeout", "0.5")
    path = {"status": "/v1/status", "top": "/v1/status", "trace": "/v1/traces/1"}[command]
    assert line == (f"colocd: the daemon at {silent_url} did not answer GET {path} within 0.5 s; "
                    "is it overloaded or stuck? (see its log)")


def test_policy_apply_of_a_missing_file_names_it(tmp_path: Path) -> None:
    line = _one_line_failure(_colocd("policy", "apply", str(tmp_path / "nope.yaml")), 2)
    assert "nope.yaml" in line and "No such file" in line


def test_serve_with_a_missing_config_file_names_it(tmp_path: Path) -> None:
    line = _one_line_failure(_colocd("serve", "--config", str(tmp_path / "missing.yaml")), 2)
    assert "missing.yaml" in line


def test_serve_with_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("listen: {host: 127.0.0.1\nengines: []\n")
    line = _one_line_failure(_colocd("serve", "--config", str(path)), 2)
    assert "invalid YAML at line" in line


def test_serve_with_an_unknown_key_names_the_key(tmp_path: Path) -> None:
    line = _one_line_failure(_colocd("serve", "--config", str(_write_config(tmp_path, listne={}))), 2)
    assert "listne" in line


def test_serve_with_a_typo_in_its_config_fails_before_importing_the_daemon(tmp_path: Path) -> None:
    # In-process main() in a child, so it can report what it imported before the one-line error: a typo costs
    # the config's check (well under 2 s), not the daemon's import. The child's CPU time (its whole life,
    # interpreter start included), not wall time: other processes on a shared CI machine do not count.
    code = ("import resource, sys; from colocd.cli import main; rc = main(['serve', '--config', sys.argv[1]]); "
            "u = resource.getrusage(resource.RUSAGE_SELF); "
            "print(u.ru_utime + u.ru_stime, 'torch' in sys.modules, 'colocd.daemon.node' in sys.modules); "
            "sys.exit(rc)")
    config = _write_config(tmp_path, engins=[])
    proc = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=120)
    line = _one_line_failure(proc, 2)
    assert "engins" in line and str(config) in line
    took_s, torch_imported, daemon_imported = proc.stdout.split()
    assert (torch_imported, daemon_imported) == ("False", "False")
    assert float(took_s) < 2.0


def test_the_daemons_modules_import_without_torch() -> None:
    # torch is imported where a tensor is touched (the separated-GPU weight-group path, an engine's worker),
    # never by the daemon's start-up: the server, every engine adapter, the weight and chunk paths.
    modules = ["colocd.api.server", "colocd.daemon.node", "colocd.daemon.weights", "colocd.daemon.distributed",
               "colocd.engines.chunks", "colocd.engines.registry", "colocd.engines.sglang.adapter",
               "colocd.engines.vllm.adapter", "colocd.engines.vllm.launcher", "colocd.cli"]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_serve_with_a_missing_policy_file_names_the_key_and_a_fix(tmp_path: Path) -> None:
    config = _write_config(tmp_path, policy_file=str(tmp_path / "policies.yaml"))
    line = _one_line_failure(_colocd("serve", "--config", str(config)), 2)
    assert "policy_file" in line and "deploy/policies/default.yaml" in line


def test_serve_with_a_policy_file_holding_a_control_character_fails_in_one_line(tmp_path: Path) -> None:
    policies = tmp_path / "policies.yaml"
    policies.write_bytes(b"apiVersion: colocd/v1\n\x1b[31m\n")  # a pasted terminal escape
    line = _one_line_failure(_colocd("serve", "--config", str(_write_config(tmp_path, policy_file=str(policies)))), 2)
    assert "policies.yaml" in line and "line 2" in line and "U+001B" in line


def test_serve_with_an_unwritable_journal_names_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the journal's directory would be: mkdir fails for root too
    config = _write_config(tmp_path, journal=str(blocker / "journal.jsonl"))
    line = _one_line_failure(_colocd("serve", "--config", str(config)), 2)
    assert "journal" in line and "writable" in line


def test_serve_on_a_port_in_use_says_how_to_fix_it(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        config = tmp_path / "node.yaml"
        config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": held.getsockname()[1]}}))
        line = _one_line_failure(_colocd("serve", "--config", str(config)), 2)
    assert "cannot listen on" in line and "port 0" in line


@pytest.mark.parametrize("example", sorted((REPO / "deploy/examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_is_valid_and_says_what_to_change_first(example: Path) -> None:
    load_node_config(example)
    first = example.read_text().splitlines()[0]
    assert first.startswith("#") and ("EDIT" in first or "runs as shipped" in first), first
