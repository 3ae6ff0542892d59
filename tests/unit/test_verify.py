"""The verified commit's decisions (daemon/verify.py): which tensors are checked, and each engine's verdict."""

from __future__ import annotations

import pytest

from colocd.daemon.verify import ExpectedDigests, Verification, sample_names, verdict_of
from colocd.engines.base import EngineDigests
from colocd.engines.sglang.adapter import UNSUPPORTED_DIGESTS
from colocd.policies import PolicyError, load_policy_yaml

NAMES = [f"model.layers.{i}.w" for i in range(40)]


def _expected(**digests: str) -> ExpectedDigests:
    expected = ExpectedDigests()
    expected.record(digests)
    return expected


def test_sample_is_a_deterministic_eighth_that_changes_with_the_version() -> None:
    first = sample_names(NAMES, "v1")
    assert first == sample_names(list(reversed(NAMES)), "v1")
    assert len(first) == 5 and set(first) <= set(NAMES)
    assert any(sample_names(NAMES, f"v{i}") != first for i in range(2, 6))
    assert sample_names(["only"], "v1") == ["only"] and sample_names([], "v1") == []


def test_a_matching_report_on_every_tp_rank_verifies() -> None:
    expected = _expected(a="0" * 16, b="1" * 16)
    report = EngineDigests(({"a": "0" * 16, "b": "1" * 16}, {"a": "0" * 16, "b": "1" * 16}))
    assert verdict_of("e0", expected, ["a", "b"], report).to_json() == {"status": "verified", "checked": 2}


def test_a_wrong_digest_on_one_tp_rank_names_engine_tensor_and_rank() -> None:
    expected = _expected(a="0" * 16, b="1" * 16)
    report = EngineDigests(({"a": "0" * 16, "b": "1" * 16}, {"a": "0" * 16, "b": "2" * 16}))
    verdict = verdict_of("e0", expected, ["a", "b"], report)
    assert (verdict.status, verdict.tensor) == ("mismatch", "b")
    assert "TP rank 1" in str(verdict.reason) and "2" * 16 in str(verdict.reason)
    error = Verification("full", (verdict,)).error()
    assert error is not None and (error.engine, error.tensor) == ("e0", "b") and "'e0'" in str(error)


def test_a_tensor_the_engine_does_not_report_is_a_mismatch() -> None:
    verdict = verdict_of("e0", _expected(a="0" * 16), ["a"], EngineDigests(({},)))
    assert (verdict.status, verdict.tensor) == ("mismatch", "a") and "reports no digest" in str(verdict.reason)


def test_ranks_that_sent_different_digests_for_one_tensor_fail_before_any_engine_is_believed() -> None:
    expected = _expected(a="0" * 16)
    expected.record({"a": "f" * 16})
    verdict = verdict_of("e0", expected, ["a"], EngineDigests(({"a": "0" * 16},)))
    assert (verdict.status, verdict.tensor) == ("mismatch", "a") and "trainer ranks" in str(verdict.reason)


def test_an_engine_that_cannot_report_says_why_and_does_not_fail_the_commit() -> None:
    verdict = verdict_of("sg0", _expected(a="0" * 16), ["a"], EngineDigests(None, UNSUPPORTED_DIGESTS))
    assert verdict.to_json() == {"status": "unsupported", "checked": 0, "reason": UNSUPPORTED_DIGESTS}
    assert "fused" in UNSUPPORTED_DIGESTS and "not verified" in UNSUPPORTED_DIGESTS
    assert Verification("full", (verdict,)).error() is None


def test_the_policy_knob_defaults_to_full_and_a_bare_yaml_off_means_off() -> None:
    assert load_policy_yaml("apiVersion: colocd/v1\n").sync.verify == "full"
    assert load_policy_yaml("apiVersion: colocd/v1\nsync:\n  verify: off\n").sync.verify == "off"
    assert load_policy_yaml("apiVersion: colocd/v1\nsync:\n  verify: sample\n").sync.verify == "sample"
    with pytest.raises(PolicyError, match="verify"):
        load_policy_yaml("apiVersion: colocd/v1\nsync:\n  verify: on\n")
