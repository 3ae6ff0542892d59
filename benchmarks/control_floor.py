"""The control path's floor, measured in the same run as ``benchmarks.weights``: a JSON line to a peer process and back.

The chunk channel's control figure is (round trip to the ack - the daemon's wait on the engine). Its floor is
the same round trip with nothing but the message: this process writes a chunk descriptor as one JSON line on a
Unix socket (asyncio streams, as the channel does), a peer process reads it, holds it, and answers with one
line naming how long it held it. The floor is (round trip - hold), the median over ``messages`` round trips.

Two holds, because on a VM the hold is not free: ``0`` (back to back, both processes stay hot: what
research/h200-limits.md measured, 0.12-0.15 ms on the H200 host) and the engine's own median wait per chunk
(the trainer and the daemon sleep that long on every chunk; waking a sleeping vCPU costs what a hot one does
not). The second is the floor the channel's figure should be read against.

    python3 -m benchmarks.control_floor --serve /path/to.sock --hold-s 0.004   # the peer (started for you)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import CHECKOUT

__all__ = ["measure_control_floor"]

READY = b"ready\n"


async def measure_control_floor(frame: bytes, hold_s: float, messages: int = 300,
                                warmup: int = 20) -> dict[str, Any]:
    """Round trips of ``frame`` (one JSON line) to a fresh peer process holding each for ``hold_s``; in ms."""
    if not frame.endswith(b"\n"):
        raise ValueError("frame must be one JSON line ending in a newline")
    directory = tempfile.mkdtemp(prefix="colocd-floor-")
    path = Path(directory) / "peer.sock"
    peer = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.control_floor", "--serve", str(path), "--hold-s", repr(hold_s),
        stdout=asyncio.subprocess.PIPE, cwd=CHECKOUT)
    try:
        assert peer.stdout is not None
        async with asyncio.timeout(60):
            if await peer.stdout.readline() != READY:  # it listens before it says so
                raise RuntimeError(f"control-floor peer exited ({await peer.wait()}) before listening")
            reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
        floors: list[float] = []
        try:
            for i in range(warmup + messages):
                t0 = time.perf_counter()
                writer.write(frame)
                reply = json.loads(await reader.readline())
                if i >= warmup:
                    floors.append(time.perf_counter() - t0 - float(reply["held_s"]))
        finally:
            writer.close()
    finally:
        if peer.returncode is None:
            peer.terminate()
        await peer.wait()
        path.unlink(missing_ok=True)
        os.rmdir(directory)
    floors.sort()
    return {"hold_ms": hold_s * 1e3, "messages": messages, "frame_bytes": len(frame),
            "p50_ms": 1e3 * statistics.median(floors), "p90_ms": 1e3 * floors[int(0.9 * (len(floors) - 1))]}


async def _serve(path: str, hold_s: float) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            t0 = time.perf_counter()
            json.loads(line)  # read it as the daemon would have to
            if hold_s > 0:
                await asyncio.sleep(hold_s)  # what the daemon does while the engine loads: nothing
            writer.write(json.dumps({"held_s": time.perf_counter() - t0}).encode() + b"\n")
        writer.close()

    server = await asyncio.start_unix_server(echo, path=path, limit=1 << 24)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", required=True, help="listen on this Unix socket path and echo")
    parser.add_argument("--hold-s", type=float, default=0.0, help="hold each message this long before answering")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.serve, args.hold_s))


if __name__ == "__main__":
    main()
