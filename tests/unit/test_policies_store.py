"""PolicyStore: a staged swap lands only at a transition boundary, versions only grow."""

from __future__ import annotations

import pytest

from colocd.policies import PolicyStore, default_policies, load_policy_yaml

KEEP = "apiVersion: colocd/v1\nprocess_groups: {policy: keep_alive}\n"
SERIAL = "apiVersion: colocd/v1\npipeline: {policy: serial}\n"


def test_a_new_store_runs_the_defaults_as_version_one() -> None:
    store = PolicyStore(default_policies())
    assert store.active == default_policies()
    assert store.active.version == 1
    assert store.pending is None


def test_a_swap_staged_mid_transition_takes_effect_only_at_the_next_boundary() -> None:
    store = PolicyStore(default_policies())
    with store.transition() as policies:
        staged = store.stage(load_policy_yaml(KEEP))
        # Mid-transition: the running transition and any new reader still see the old set.
        assert store.active is policies
        assert store.active.process_groups.spec == "deferred_cooldown"
        assert store.pending is staged
        with pytest.raises(RuntimeError, match="in progress"):
            store.at_boundary()
    assert store.active.process_groups.spec == "deferred_cooldown"  # the boundary has not run yet
    assert store.at_boundary() is staged
    assert store.active.process_groups.spec == "keep_alive"
    assert store.active.version == 2
    assert store.pending is None


def test_entering_a_transition_applies_the_pending_swap_first() -> None:
    store = PolicyStore(default_policies())
    store.stage(load_policy_yaml(KEEP))
    with store.transition() as policies:
        assert policies.process_groups.spec == "keep_alive"


def test_a_failed_load_leaves_the_store_untouched() -> None:
    store = PolicyStore(default_policies())
    before = store.active
    with pytest.raises(ValueError):
        store.stage(load_policy_yaml("apiVersion: colocd/v1\npipeline: {depth: 0}\n"))
    assert store.active is before and store.pending is None


def test_versions_only_grow_and_the_last_stage_wins() -> None:
    store = PolicyStore(default_policies())
    a = store.stage(load_policy_yaml(KEEP))
    b = store.stage(load_policy_yaml(SERIAL))
    assert (a.version, b.version) == (2, 3)
    assert store.at_boundary() is b
    assert store.stage(load_policy_yaml(KEEP)).version == 4


def test_restaging_what_is_active_is_a_no_op() -> None:
    store = PolicyStore(default_policies())
    store.stage(load_policy_yaml(KEEP))
    same = store.stage(load_policy_yaml("apiVersion: colocd/v1\n"))  # back to what is running
    assert same is store.active and store.pending is None
    pending = store.stage(load_policy_yaml(KEEP))
    assert store.stage(load_policy_yaml(KEEP)) is pending  # same document twice: one version


def test_transitions_do_not_nest() -> None:
    store = PolicyStore(default_policies())
    with store.transition(), pytest.raises(RuntimeError, match="do not nest"), store.transition():
        pass
    with store.transition():  # the failed nesting did not leave the store stuck
        pass
