"""The /metrics exposition is rendered once per change and shared by concurrent scrapes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from colocd.daemon import metrics as metrics_module
from colocd.daemon.metrics import Metrics


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counted: list[int] = []
    real = metrics_module.generate_latest

    def counting(registry: Any) -> bytes:
        counted.append(1)
        return real(registry)

    monkeypatch.setattr(metrics_module, "generate_latest", counting)
    return counted


async def test_concurrent_scrapes_share_one_render(renders: list[int]) -> None:
    m = Metrics()
    bodies = await asyncio.gather(*(m.current() for _ in range(20)))
    assert len(renders) == 1 and len(set(bodies)) == 1


async def test_an_unchanged_registry_is_not_rendered_again(renders: list[int]) -> None:
    m = Metrics()
    first = await m.current()
    assert await m.current() is first and len(renders) == 1


async def test_a_scrape_after_changed_includes_the_update(renders: list[int]) -> None:
    m = Metrics()
    await m.current()
    m.node_step.set(42)
    m.changed()
    assert b"colocd_node_step 42.0" in await m.current() and len(renders) == 2
