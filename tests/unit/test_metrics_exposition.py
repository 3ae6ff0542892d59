"""A /metrics scrape renders the registry as of the call, off the event loop's thread."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from colocd.daemon import metrics as metrics_module
from colocd.daemon.metrics import Metrics


async def test_a_scrape_includes_every_update_made_before_it() -> None:
    m = Metrics()
    await m.current()
    m.node_step.set(42)
    assert b"colocd_node_step 42.0" in await m.current()


async def test_a_scrape_renders_in_a_worker_thread_so_the_loop_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    real = metrics_module.generate_latest

    def recording(registry: Any) -> bytes:
        threads.append(threading.get_ident())
        return real(registry)

    monkeypatch.setattr(metrics_module, "generate_latest", recording)
    assert b"colocd_build_info" in await Metrics().current()
    assert threads and threads[0] != threading.get_ident()
