"""The README's ``colocd demo --engine sglang``: the daemon launches SGLang, and the RL loop learns through it."""

from __future__ import annotations

import pytest
from demo_live import run_demo
from sglang_live import install

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]


def test_the_demo_on_sglang_learns_and_every_push_is_verified_by_sglangs_own_checksums() -> None:
    install()  # skips, naming why, where the tier's SGLang is not installed
    steps, first, last = run_demo("sglang", 8)
    assert len(steps) == 8
    assert all(line.endswith("verified: SGLang's own checksums") for line in steps), steps
    assert last > first + 0.2
