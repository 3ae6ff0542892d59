"""Policy documents are parsed within bounds (size, aliases, depth, expanded nodes), and a plugin is imported
only when the node lists it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from colocd.policies import PolicyError, YamlLimits, load_policy_yaml


def _bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [6, 9])
def test_an_alias_bomb_is_refused_in_milliseconds(levels: int) -> None:
    t0 = time.perf_counter()
    with pytest.raises(PolicyError, match=r"nodes with aliases expanded|aliases"):
        load_policy_yaml(_bomb(levels))
    # Unbounded, six levels took 4.4 s and each level multiplies by ten; bounded it is milliseconds. The
    # margin is for a loaded CI machine.
    assert time.perf_counter() - t0 < 2.0


def test_too_many_aliases_are_refused_at_the_first_one_over() -> None:
    document = "apiVersion: colocd/v1\nx: &x 1\ny: [" + ",".join(["*x"] * 5) + "]\n"
    with pytest.raises(PolicyError, match="more than 4 YAML aliases") as caught:
        load_policy_yaml(document, limits=YamlLimits(max_aliases=4))
    assert caught.value.line == 3


def test_a_document_over_the_size_limit_is_refused_before_parsing() -> None:
    with pytest.raises(PolicyError, match="over the limit of 1024"):
        load_policy_yaml("apiVersion: colocd/v1\n" + "#" * 2000, limits=YamlLimits(max_bytes=1024))


def test_deep_nesting_is_a_policy_error_not_a_recursion_error() -> None:
    with pytest.raises(PolicyError, match="nested deeper"):
        load_policy_yaml("a: " + "[" * 5000 + "]" * 5000)


def test_bytes_that_are_not_utf8_are_a_policy_error_naming_the_offset() -> None:
    with pytest.raises(PolicyError, match="not UTF-8: byte 0xff at offset 3"):
        load_policy_yaml(b"a: \xff")


def test_a_plugin_not_listed_is_not_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "unlisted_mod.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PolicyError, match="allow-list"):
        load_policy_yaml("apiVersion: colocd/v1\ncleanup:\n  policy: unlisted_mod:C\n", plugins=frozenset())
    assert "unlisted_mod" not in sys.modules
