"""The README's ``colocd demo --engine vllm``: the daemon launches vLLM, and the RL loop learns through it."""

from __future__ import annotations

from pathlib import Path

import pytest
from demo_live import run_demo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_the_demo_on_vllm_learns_and_every_push_is_verified_by_the_engines_digests(model_dir: Path) -> None:
    # model_dir: the tier's vLLM install (the test skips, naming why, without one)
    steps, first, last = run_demo("vllm", 8)
    assert len(steps) == 8
    assert all(line.endswith("verified: 27 digests") for line in steps), steps
    assert last > first + 0.2
