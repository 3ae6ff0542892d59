"""Telling a torch TCPStore from anything else listening on a port: one read-only query and its reply.

torch's own client handshake (``TCPStoreBackend.hpp``): ``VALIDATE`` with the magic number, then ``GETNUMKEYS``,
which every store answers with an int64; nothing is written. Anything else is not the trainer's store, and the
caller learns so at once instead of an engine waiting out its rendezvous timeout.
"""

from __future__ import annotations

import asyncio
import struct

__all__ = ["probe_tcpstore"]

_VALIDATE, _GETNUMKEYS = 0, 7  # torch's QueryType: VALIDATE came first, GETNUMKEYS is its eighth query
_MAGIC = 0x3C85F7CE  # validationMagicNumber
_PROBE = struct.pack("=BIB", _VALIDATE, _MAGIC, _GETNUMKEYS)
_MAX_KEYS = 1 << 40  # far beyond any store; an 8-byte text reply ("HTTP/1.1") reads as a much larger number


async def probe_tcpstore(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, within_s: float) -> str | None:
    """None if the peer answered as a TCPStore within ``within_s``; else what it did instead, in words."""
    try:
        writer.write(_PROBE)
        await writer.drain()
        async with asyncio.timeout(within_s):
            reply = await reader.readexactly(8)
    except TimeoutError:
        return f"no TCPStore reply within {within_s:.1f}s"
    except asyncio.IncompleteReadError as exc:
        return f"it closed the connection after {exc.partial[:40]!r}"
    except OSError as exc:
        return f"the connection failed: {exc.strerror or type(exc).__name__}"
    (keys,) = struct.unpack("=q", reply)
    if 0 <= keys < _MAX_KEYS:
        return None
    return f"it answered {reply!r}"
