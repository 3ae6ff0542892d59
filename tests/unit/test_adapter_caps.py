"""Where an adapter cap comes from: vLLM's flags (its HTTP API reports none) and the policy's adapters section."""

from __future__ import annotations

import pytest

from colocd.engines.vllm.adapter import max_adapters
from colocd.errors import PolicyError
from colocd.policies import load_policy_yaml


@pytest.mark.parametrize(("args", "cap"), [
    (["--enable-lora"], 1),
    (["--enable-lora", "--max-loras", "4"], 4),
    (["--enable-lora", "--max-loras=4", "--max-cpu-loras", "6"], 6),
    (["--max-loras", "4"], None),
])
def test_a_vllm_engine_holds_max_cpu_loras_which_defaults_to_max_loras_then_one(args: list[str],
                                                                                 cap: int | None) -> None:
    assert max_adapters(args) == cap


def test_the_policy_keeps_two_adapter_versions_by_default_and_names_a_keep_below_one() -> None:
    assert load_policy_yaml("apiVersion: colocd/v1\n").adapters.keep == 2
    with pytest.raises(PolicyError) as bad:
        load_policy_yaml("apiVersion: colocd/v1\nadapters:\n  keep: 0\n")
    assert bad.value.field == "adapters.keep" and bad.value.line == 3
