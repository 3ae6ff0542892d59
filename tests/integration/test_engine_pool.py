"""The fixture factory's engine pool (tests/support.py): a borrowed engine comes back as a fresh one would be.

Tests that share a module's reference engine rely on this: whatever one test did through the engine's API
(paused it, released its memory, loaded other weights, renamed their version, left an update open), the next
one sees the engine a new process would show; a reset that cannot bring it back fails the test that left it.
"""

from __future__ import annotations

import httpx
import pytest
import support
from support import EnginePool

from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.producer import Producer


def _load(http: httpx.Client, seed: int) -> None:
    """Other weights than the engine's seed, through one inline update; the session is left open."""
    named = list(build_model(QwenLikeConfig(), seed=seed).named_parameters())
    entry = Producer("inline").export(named).handle["payload_b64"]
    assert http.post("/begin_weight_update", json={}).json()["success"]
    assert http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [entry], "load_format": "flattened_bucket"}).json()["success"]


def _disturb(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        _load(http, seed=9)
        assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
        assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert http.post("/update_weight_version", json={"new_version": "v9"}).status_code == 200


def test_an_engine_a_test_changed_is_given_back_as_a_fresh_one_and_lent_again() -> None:
    pool = EnginePool()
    try:
        engine = pool.borrow()
        fresh, pid = engine.fresh, engine.pid
        _disturb(str(engine.url))
        assert support._observe(engine) != fresh  # the test really changed what a client sees
        pool.give_back(engine)
        again = pool.borrow()
        assert again.pid == pid  # the same process, not a new one
        assert support._observe(again) == fresh
        pool.give_back(again)
    finally:
        pool.close()


def test_a_reset_that_leaves_a_difference_fails_the_give_back_and_the_engine_is_not_lent_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = EnginePool()
    try:
        engine = pool.borrow()
        pid = engine.pid
        with httpx.Client(base_url=str(engine.url), timeout=60, trust_env=False) as http:
            assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        monkeypatch.setattr(support, "_reset", lambda proc, fresh: None)  # a reset that forgets everything
        with pytest.raises(AssertionError, match="unlike a fresh one"):
            pool.give_back(engine)
        assert engine.returncode is not None  # stopped: no later test sees it
        monkeypatch.undo()
        replacement = pool.borrow()
        assert replacement.pid != pid
        pool.give_back(replacement)
    finally:
        pool.close()
