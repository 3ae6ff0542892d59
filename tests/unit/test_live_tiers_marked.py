"""Every spec module of a live tier carries its tier's marker: scripts/test.sh selects a tier's specs by marker, so an
unmarked module would run in no live tier (the core tier only skips it for want of the engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tier", ["sglang", "vllm"])
def test_every_live_spec_module_is_marked_with_its_tier(tier: str) -> None:
    modules = sorted((TESTS / tier).glob("test_*.py"))
    assert modules
    unmarked = [m.name for m in modules
                if not any(line.startswith("pytestmark") and f"pytest.mark.{tier}" in line
                           for line in m.read_text().splitlines())]
    assert unmarked == []
