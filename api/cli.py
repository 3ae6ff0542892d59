"""The ``colocd`` command: serve, status, demo, bench, policy."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    from ..daemon.config import ConfigError, load_node_config
    from ..policies import PolicyError
    from .server import serve

    try:
        config = load_node_config(args.config)
    except ConfigError as exc:
        print(f"colocd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config, log_level=args.log_level))
    except KeyboardInterrupt:
        pass
    except PolicyError as exc:
        print(f"colocd: policy file {config.policy_file}: {exc}", file=sys.stderr)
        return 2
    return 0


def _status(args: argparse.Namespace) -> int:
    from .client import ColocdClient, ColocdHTTPError

    try:
        with ColocdClient(args.url, token=args.token) as client:
            print(json.dumps(client.status(), indent=2))
    except ColocdHTTPError as exc:
        print(f"colocd: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"colocd: cannot reach the daemon at {args.url}: {exc}", file=sys.stderr)
        return 1
    return 0


def _policy_apply(args: argparse.Namespace) -> int:
    import httpx

    try:
        text = open(args.file, "rb").read()
    except OSError as exc:
        print(f"colocd: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    base, transport = (("http://colocd", httpx.HTTPTransport(uds=args.url[5:])) if args.url.startswith("unix:")
                       else (args.url.rstrip("/"), None))
    headers = {"Content-Type": "application/yaml", **({"Authorization": f"Bearer {args.token}"} if args.token else {})}
    with httpx.Client(base_url=base, transport=transport, trust_env=False, timeout=30) as http:
        try:
            response = http.put("/v1/policies", content=text, headers=headers)
        except httpx.TransportError as exc:
            print(f"colocd: cannot reach the daemon at {args.url}: {exc}", file=sys.stderr)
            return 1
    body = response.json()
    if response.status_code >= 400:
        print(f"colocd: {args.file}: {body.get('message', body)}", file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoSettings, run_demo

    settings = DemoSettings(steps=args.steps, device=args.device, batch=args.batch, seed=args.seed,
                            json_out=args.json)
    return asyncio.run(run_demo(settings))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colocd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the daemon for this node")
    p.add_argument("--config", required=True, help="node config YAML (listen address, engines, timeouts)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_serve)

    p = sub.add_parser("status", help="print the daemon's /v1/status")
    p.add_argument("--url", default="http://127.0.0.1:7000", help="http://host:port or unix:/path")
    p.add_argument("--token", default=None)
    p.set_defaults(func=_status)

    p = sub.add_parser("policy", help="policy operations")
    psub = p.add_subparsers(dest="policy_command", required=True)
    pa = psub.add_parser("apply", help="stage a policy YAML on a running daemon (applies at the next transition)")
    pa.add_argument("file")
    pa.add_argument("--url", default="http://127.0.0.1:7000", help="http://host:port or unix:/path")
    pa.add_argument("--token", default=None)
    pa.set_defaults(func=_policy_apply)

    p = sub.add_parser("demo", help="a tiny real RL loop through the full handoff on the reference engine")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32, help="rollouts per step")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the per-step records here")
    p.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
