"""A manifest's reference (daemon/manifests.py): a digest of its content, and the few a daemon process keeps."""

from __future__ import annotations

import re

import pytest

from colocd.daemon.manifests import MANIFEST_REF_PATTERN, Manifest, ManifestBook, TensorMeta, reference_of
from colocd.errors import ManifestRefUnknown


def _manifest(*names: str, dtype: str = "bfloat16", shape: tuple[int, ...] = (4, 4)) -> Manifest:
    return {name: TensorMeta(dtype, shape) for name in names}


def test_equal_manifests_have_one_reference_of_the_documented_form() -> None:
    ref = reference_of(_manifest("a", "b"))
    assert ref == reference_of(_manifest("a", "b"))
    assert re.fullmatch(MANIFEST_REF_PATTERN, ref)


@pytest.mark.parametrize("other", [
    _manifest("b", "a"),  # another order
    _manifest("a", "c"),  # another name
    _manifest("a", "b", dtype="float32"),
    _manifest("a", "b", shape=(4, 5)),
    _manifest("a"),
], ids=["order", "name", "dtype", "shape", "fewer"])
def test_a_manifest_that_differs_in_anything_has_another_reference(other: Manifest) -> None:
    assert reference_of(other) != reference_of(_manifest("a", "b"))


def test_names_that_run_into_each_other_do_not_share_a_reference() -> None:
    assert reference_of(_manifest('a","b')) != reference_of(_manifest("a", "b"))


def test_the_book_resolves_a_remembered_reference_to_the_same_parsed_manifest() -> None:
    book, manifest = ManifestBook(), _manifest("a")
    book.remember(reference_of(manifest), manifest)
    assert book.resolve(reference_of(manifest)) is manifest


def test_an_unknown_reference_is_refused_naming_manifest_ref_and_saying_to_send_the_manifest() -> None:
    with pytest.raises(ManifestRefUnknown, match="send the manifest") as err:
        ManifestBook().resolve("0" * 32)
    assert err.value.field == "manifest_ref"


def test_the_refusal_of_an_unknown_reference_answers_409_naming_the_field() -> None:
    error = ManifestRefUnknown("manifest_ref '00' names no manifest: send the manifest")
    body = error.http_body()
    assert error.http_status == 409
    assert body["error"] == "ManifestRefUnknown" and body["field"] == "manifest_ref"


def test_the_book_keeps_only_its_most_recently_used_manifests() -> None:
    book = ManifestBook(capacity=2)
    a, b, c = _manifest("a"), _manifest("b"), _manifest("c")
    for m in (a, b):
        book.remember(reference_of(m), m)
    book.remember(reference_of(a), a)  # used again: b is now the least recent
    book.remember(reference_of(c), c)
    assert reference_of(a) in book and reference_of(c) in book
    assert reference_of(b) not in book and len(book) == 2
