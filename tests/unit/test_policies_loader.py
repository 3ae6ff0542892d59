"""YAML loading: valid documents become PolicySets; invalid ones raise PolicyError at their line/column."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from colocd.policies import (
    AutoPolicy,
    Budget,
    PolicyError,
    PolicySet,
    default_policies,
    load_policy_yaml,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "policies"


def load(text: str) -> PolicySet:
    return load_policy_yaml(textwrap.dedent(text))


def error(text: str) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        load(text)
    return info.value


def test_a_full_document_loads_into_typed_policies() -> None:
    p = load(
        """
        apiVersion: colocd/v1
        process_groups: {policy: auto, max_resident_gib: 6, post_destroy_wait_s: 0.5}
        pipeline: {policy: overlap, depth: 3, bucket_mb: 256, transport: per_tensor}
        cleanup: {policy: aggressive, max_retries: 2}
        engines: {release_tags: [kv_cache], pause_mode: abort}
        timeouts: {default_s: 20, chunk_s: 120}
        """
    )
    assert isinstance(p.process_groups, AutoPolicy)
    assert p.process_groups.config.max_resident_gib == 6
    assert (p.pipeline.spec, p.cleanup.spec) == ("overlap", "aggressive")
    assert p.engines.release_tags == ("kv_cache",)
    assert p.timeouts.budget(Budget.RESUME) == 20


def test_only_api_version_gives_the_defaults() -> None:
    assert load("apiVersion: colocd/v1\n") == default_policies()
    assert default_policies().process_groups.spec == "deferred_cooldown"


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_the_shipped_examples_load(path: Path) -> None:
    load_policy_yaml(path.read_text(), source=str(path))


def test_default_yaml_is_exactly_the_defaults() -> None:
    assert load_policy_yaml((DEPLOY / "default.yaml").read_text()) == default_policies()


def test_invalid_yaml_reports_line_and_column() -> None:
    err = error(
        """\
        apiVersion: colocd/v1
        pipeline:
          depth: [2
        cleanup: {}
        """
    )
    assert err.line is not None and err.line >= 3
    assert err.column is not None
    assert "invalid YAML" in err.message
    assert str(err).startswith(f"line {err.line}, column {err.column}:")


def test_unknown_field_names_the_field_and_points_at_it() -> None:
    err = error(
        """\
        apiVersion: colocd/v1
        process_groups:
          policy: destroy
          max_resident_gib: 4
        """
    )
    assert err.field == "process_groups.max_resident_gib"
    assert (err.line, err.column) == (4, 3)
    assert "unknown field 'max_resident_gib'" in err.message
    assert "belongs to policy auto" in err.message  # the usual cause: a leftover from another policy


def test_a_typo_suggests_the_field() -> None:
    err = error(
        """\
        apiVersion: colocd/v1
        timeouts:
          chunk_secs: 5
        """
    )
    assert err.field == "timeouts.chunk_secs"
    assert "did you mean 'chunk_s'" in err.message


def test_a_bad_value_names_the_field_and_its_line() -> None:
    err = error(
        """\
        apiVersion: colocd/v1
        pipeline:
          policy: overlap
          bucket_mb: -5
        """
    )
    assert (err.field, err.line, err.column) == ("pipeline.bucket_mb", 4, 14)


@pytest.mark.parametrize("retired", ["ipc_ring", "zero_copy"])
def test_a_transport_no_engine_loads_is_refused_naming_the_field_and_the_allowed_ones(retired: str) -> None:
    err = error(
        f"""\
        apiVersion: colocd/v1
        pipeline:
          policy: overlap
          transport: {retired}
        """
    )
    assert (err.field, err.line) == ("pipeline.transport", 4)
    assert all(allowed in err.message for allowed in ("auto", "shm", "disk", "inline", "cuda_ipc", "per_tensor"))


def test_a_bad_list_item_points_at_the_item() -> None:
    err = error(
        """\
        apiVersion: colocd/v1
        engines:
          release_tags: [weights, kv_cach]
        """
    )
    assert (err.field, err.line, err.column) == ("engines.release_tags[1]", 3, 27)


def test_a_missing_required_field_points_at_its_section() -> None:
    err = error(
        """\
        apiVersion: colocd/v1
        process_groups:
          policy: auto
        """
    )
    assert err.field == "process_groups.max_resident_gib"
    assert err.line == 3
    assert "required" in err.message


def test_unknown_section_and_unknown_policy_are_rejected_with_positions() -> None:
    err = error("apiVersion: colocd/v1\nproces_groups: {}\n")
    assert (err.field, err.line, err.column) == ("proces_groups", 2, 1)
    assert "did you mean 'process_groups'" in err.message
    err = error("apiVersion: colocd/v1\ncleanup:\n  policy: sweep\n")
    assert (err.field, err.line, err.column) == ("cleanup.policy", 3, 11)
    assert "not a built-in (empty_cache, aggressive, none)" in err.message


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty document"),
        ("apiVersion: colocd/v2\n", "unsupported apiVersion"),
        ("process_groups: {}\n", "missing apiVersion"),
        ("- a\n- b\n", "is a mapping"),
        ("apiVersion: colocd/v1\napiVersion: colocd/v1\n", "appears twice"),
        ("apiVersion: colocd/v1\npipeline: 3\n", "must be a mapping"),
        ("apiVersion: colocd/v1\n---\napiVersion: colocd/v1\n", "invalid YAML"),
        ("apiVersion: colocd/v1\ncleanup: {policy: 7}\n", "policy must be a name"),
        ("apiVersion: !!python/object:os.system colocd/v1\n", "invalid YAML"),
    ],
)
def test_malformed_documents_are_policy_errors(text: str, needle: str) -> None:
    with pytest.raises(PolicyError, match=needle):
        load_policy_yaml(text)


def test_policy_error_serialises_for_an_http_400() -> None:
    err = error("apiVersion: colocd/v1\ntimeouts: {default_s: 0}\n")
    assert err.http_status == 400
    assert err.http_body() == {"error": "PolicyError", "message": str(err), "field": "timeouts.default_s", "line": 2,
                               "column": 23}


def test_fingerprint_ignores_layout_comments_and_defaults_spelled_out() -> None:
    a = load("apiVersion: colocd/v1\npipeline: {policy: overlap}\n")
    b = load(
        """
        # a comment
        apiVersion: colocd/v1
        pipeline:
          policy: overlap
          depth: 2        # the default (the tuned preset's), spelled out
        """
    )
    c = load("apiVersion: colocd/v1\npipeline: {policy: overlap, depth: 3}\n")
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert len(a.fingerprint) == 16


def test_as_document_round_trips() -> None:
    import yaml

    p = load("apiVersion: colocd/v1\nprocess_groups: {policy: suspend, fallback: keep_alive}\n")
    again = load_policy_yaml(yaml.safe_dump(p.as_document()))
    assert again == p
    assert again.as_document() == p.as_document()


def test_info_labels_for_the_metric() -> None:
    info = default_policies().with_version(7).info()
    assert info == {
        "version": "7",
        "fingerprint": default_policies().fingerprint,
        "process_groups": "deferred_cooldown",
        "pipeline": "overlap",
        "cleanup": "empty_cache",
    }
