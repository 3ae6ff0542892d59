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
    # httpx logs every request at INFO: the health loop's observations would drown the daemon's own lines.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
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


def _bench_weights(args: argparse.Namespace) -> int:
    from .bench import BenchSettings, run_weights_bench

    settings = BenchSettings(model=args.model, device=args.device, variants=tuple(args.variants.split(",")),
                             bucket_mb=args.bucket_mb, repeats=args.repeats, warmup=args.warmup,
                             seed=args.seed, out=args.out)
    record = asyncio.run(run_weights_bench(settings))
    return 0 if all(v["verified"] is not False for v in record["variants"]) else 1


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
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32, help="rollouts per step")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the per-step records here")
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    pb = bsub.add_parser("weights", help="trainer → daemon → engine weight transfer against the copy floor")
    pb.add_argument("--model", default="tiny", help="tiny, qwen3-0.6b, qwen3-8b or qwen3-14b (HF shapes)")
    pb.add_argument("--device", default="cpu", help="cpu (shm transport) or cuda")
    pb.add_argument("--variants", default="per_tensor,serial,overlap2,overlap3,ipc_ring,zero_copy",
                    help="comma-separated; name@MB sets one variant's chunk size")
    pb.add_argument("--bucket-mb", type=float, default=512.0, help="chunk size in MiB")
    pb.add_argument("--repeats", type=int, default=3, help="timed pushes per variant (best is reported)")
    pb.add_argument("--warmup", type=int, default=1, help="untimed pushes per variant first")
    pb.add_argument("--seed", type=int, default=0)
    pb.add_argument("--out", default=None, help="write the JSON record here")
    pb.set_defaults(func=_bench_weights)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
