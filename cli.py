"""The ``colocd`` command: serve, status, top, trace, demo, policy."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .api.cli_http import add_daemon_options, daemon_call
from .api.client import ColocdClient
from .api.top import add_top_command
from .errors import CliFailure, MatplotlibMissing
from .timeline import render_timeline

__all__ = ["build_parser", "main"]


class _ShowDefaults(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default (how an
    unset option behaves) or the option is a flag."""

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


def _serve(args: argparse.Namespace) -> int:
    # The config is read and checked before the daemon's modules are imported: a typo'd key costs a
    # fraction of a second, not the daemon's import (tests/integration/test_cli.py times it).
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
    with daemon_call(args) as call:
        print(json.dumps(call("GET /v1/status", ColocdClient.status), indent=2))
    return 0


def _policy_apply(args: argparse.Namespace) -> int:
    try:
        with open(args.file, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise CliFailure(f"colocd: cannot read {args.file}: {exc.strerror}", 2) from None
    with daemon_call(args) as call:
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
    with daemon_call(args) as call:
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
    add_daemon_options(p)
    p.set_defaults(func=_status)

    p = sub.add_parser("policy", help="policy operations")
    psub = p.add_subparsers(dest="policy_command", required=True)
    pa = psub.add_parser("apply", help="stage a policy YAML on a running daemon (applies at the next transition)")
    pa.add_argument("file", help="the policy YAML (deploy/policies/default.yaml is one)")
    add_daemon_options(pa)
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
    add_daemon_options(p)
    p.set_defaults(func=_trace)

    add_top_command(sub)  # colocd top [--once] (api/top.py)
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
