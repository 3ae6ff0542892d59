"""Plugins: a ``module:Class`` in the YAML, or an entry point in group ``colocd.policies`` found for real."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from colocd.policies import (
    GroupAction,
    GroupSnapshot,
    PluginImportError,
    PluginNotFoundError,
    PolicyError,
    load_policy_yaml,
)

PLUGIN_SOURCE = '''
from typing import ClassVar

from pydantic import Field

from colocd.policies import CleanupPlan, CleanupPolicy, CleanupAction, GroupDirective, PolicyConfig
from colocd.policies import ProcessGroupPolicy


class EveryOther(ProcessGroupPolicy):
    """Keeps groups when fewer than ``limit`` exist, else destroys them."""

    name: ClassVar[str] = "every_other"

    class Config(PolicyConfig):
        limit: int = Field(4, ge=0)

    def before_pause(self, snapshot):
        if snapshot.group_count < self.config.limit:
            return GroupDirective.keep(self.spec, "few groups")
        return GroupDirective.destroy(self.spec, "many groups")


class GcOnly(CleanupPolicy):
    name: ClassVar[str] = "gc_only"

    def plan(self):
        return CleanupPlan(policy=self.spec, steps=(CleanupAction.GC_COLLECT,))
'''


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A throwaway importable directory with a plugin module and a real dist-info declaring entry points."""
    mod = f"colocd_test_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{mod}.py").write_text(PLUGIN_SOURCE)
    (tmp_path / f"{mod}_broken.py").write_text("import colocd_definitely_missing_dependency\n")
    dist_info = tmp_path / f"{mod}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {mod}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            f"""\
            [colocd.policies]
            every_other_{mod} = {mod}:EveryOther
            gc_only_{mod} = {mod}:GcOnly
            broken_{mod} = {mod}_broken:Anything
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in (mod, f"{mod}_broken"):
        sys.modules.pop(name, None)


def _mod(plugin_dir: Path) -> str:
    return f"colocd_test_plugin_{plugin_dir.name.replace('-', '_')}"


def test_plugin_from_module_colon_class_with_its_own_config(plugin_dir: Path) -> None:
    mod = _mod(plugin_dir)
    p = load_policy_yaml(
        f"apiVersion: colocd/v1\nprocess_groups: {{policy: '{mod}:EveryOther', limit: 20}}\n"
    )
    assert p.process_groups.spec == f"{mod}:EveryOther"
    assert p.process_groups.before_pause(GroupSnapshot(group_count=14)).action == GroupAction.KEEP
    assert p.info()["process_groups"] == f"{mod}:EveryOther"


def test_plugin_from_an_entry_point(plugin_dir: Path) -> None:
    mod = _mod(plugin_dir)
    p = load_policy_yaml(
        f"apiVersion: colocd/v1\nprocess_groups:\n  policy: every_other_{mod}\n  limit: 2\n"
        f"cleanup: {{policy: gc_only_{mod}}}\n"
    )
    assert p.process_groups.before_pause(GroupSnapshot(group_count=14)).action == GroupAction.DESTROY
    assert [s.value for s in p.cleanup.plan().steps] == ["gc_collect"]  # type: ignore[attr-defined]


def test_a_plugins_config_rejects_unknown_fields_by_name(plugin_dir: Path) -> None:
    mod = _mod(plugin_dir)
    with pytest.raises(PolicyError) as info:
        load_policy_yaml(
            f"apiVersion: colocd/v1\nprocess_groups:\n  policy: every_other_{mod}\n  limmit: 2\n"
        )
    assert (info.value.field, info.value.line) == ("process_groups.limmit", 4)
    assert "did you mean 'limit'" in info.value.message


def test_a_missing_module_is_not_found_not_an_import_failure() -> None:
    with pytest.raises(PluginNotFoundError, match=r"could not find module 'colocd_nowhere\.sub'") as info:
        load_policy_yaml("apiVersion: colocd/v1\ncleanup:\n  policy: colocd_nowhere.sub:X\n")
    assert (info.value.line, info.value.column) == (3, 11)


def test_a_module_whose_own_import_fails_is_an_import_error_with_its_cause(plugin_dir: Path) -> None:
    mod = _mod(plugin_dir)
    for spec in (f"{mod}_broken:Anything", f"broken_{mod}"):
        with pytest.raises(PluginImportError, match="failed to import") as info:
            load_policy_yaml(f"apiVersion: colocd/v1\ncleanup: {{policy: '{spec}'}}\n")
        assert isinstance(info.value.__cause__, ModuleNotFoundError)
        assert info.value.__cause__.name == "colocd_definitely_missing_dependency"


def test_a_missing_attribute_is_not_found(plugin_dir: Path) -> None:
    with pytest.raises(PluginNotFoundError, match="attribute 'Nope' not found"):
        load_policy_yaml(f"apiVersion: colocd/v1\ncleanup: {{policy: '{_mod(plugin_dir)}:Nope'}}\n")


def test_a_policy_of_the_wrong_family_is_rejected(plugin_dir: Path) -> None:
    with pytest.raises(
        PolicyError, match="is a cleanup policy; section process_groups needs a ProcessGroupPolicy"
    ):
        load_policy_yaml(f"apiVersion: colocd/v1\nprocess_groups: {{policy: '{_mod(plugin_dir)}:GcOnly'}}\n")
    with pytest.raises(PolicyError, match="not a ProcessGroupPolicy subclass"):
        load_policy_yaml("apiVersion: colocd/v1\nprocess_groups: {policy: 'collections:OrderedDict'}\n")


def test_a_spec_without_a_class_is_rejected() -> None:
    with pytest.raises(PluginNotFoundError, match="must be written as '<module>:<Class>'"):
        load_policy_yaml("apiVersion: colocd/v1\ncleanup: {policy: 'colocd.policies:'}\n")
