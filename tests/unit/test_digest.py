"""The one canonical digest: its encoding is a contract (every stored digest depends on it), so it is pinned
here byte for byte, including one fixed vector that must never change."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta, timezone
from enum import StrEnum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intermission.schemas.digest import canonical_json, digest
from intermission.schemas.resume import ResumeAdmissionRequest
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion


class Colour(StrEnum):
    RED = "red"


def test_keys_are_sorted_and_there_is_no_insignificant_whitespace() -> None:
    assert canonical_json({"b": 1, "a": [1, 2, {"d": None, "c": True}]}) == b'{"a":[1,2,{"c":true,"d":null}],"b":1}'


def test_text_is_utf8_without_unicode_escapes() -> None:
    assert canonical_json({"k": "é\u2028😀"}) == '{"k":"é\u2028😀"}'.encode()
    # JSON's mandatory escapes stay escapes.
    assert canonical_json('"\\\n\x01') == b'"\\"\\\\\\n\\u0001"'


def test_bytes_are_standard_base64_with_padding() -> None:
    assert canonical_json(b"\x00\xff") == b'"AP8="'
    assert canonical_json(bytearray(b"\xfb\xff")) == b'"+/8="'


def test_times_are_rfc3339_utc_with_six_fraction_digits() -> None:
    two_hours_east = timezone(timedelta(hours=2))
    assert canonical_json(datetime(2026, 11, 30, 17, 33, 5, tzinfo=two_hours_east)) == b'"2026-11-30T15:33:05.000000Z"'
    assert canonical_json(datetime(2026, 1, 2, 3, 4, 5, 7, tzinfo=UTC)) == b'"2026-01-02T03:04:05.000007Z"'


def test_the_same_instant_in_any_zone_digests_the_same() -> None:
    moment = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert digest(moment) == digest(moment.astimezone(timezone(timedelta(hours=-7))))


def test_a_naive_time_is_refused_rather_than_guessed() -> None:
    with pytest.raises(ValueError, match="naive"):
        digest(datetime(2026, 1, 1))


def test_enums_are_their_values_and_unknown_types_are_refused() -> None:
    assert canonical_json([Colour.RED]) == b'["red"]'
    with pytest.raises(TypeError):
        digest(object())
    with pytest.raises(ValueError):  # noqa: PT011 - json's own message
        digest(float("nan"))


def test_digest_is_lowercase_hex_sha256_of_the_canonical_json() -> None:
    value = {"z": "é", "a": b"\x01"}
    assert digest(value) == hashlib.sha256(canonical_json(value)).hexdigest()
    assert len(digest(value)) == 64
    assert digest(value) == digest(value).lower()


def test_a_fixed_admission_request_has_a_fixed_digest() -> None:
    # If this vector changes, every stored request_digest changes with it: that is a new schema version,
    # never an edit.
    req = ResumeAdmissionRequest(
        scope=Scope(app="acme", tenant="t1"),
        version=ClaimVersion(run_id="run-1", suspension_id=7, run_revision=3),
        input=b'{"performative":"inform","content":"\xc3\xa9"}',
    )
    assert canonical_json(req) == (
        b'{"input":"eyJwZXJmb3JtYXRpdmUiOiJpbmZvcm0iLCJjb250ZW50Ijoiw6kifQ==",'
        b'"scope":{"app":"acme","tenant":"t1"},'
        b'"version":{"run_id":"run-1","run_revision":3,"suspension_id":7}}'
    )
    assert req.digest() == hashlib.sha256(canonical_json(req)).hexdigest()
    assert req.digest() == "7c5db2959112bcd6703348be22ebd3ea1bc0777d74be11deb9390ff6c08046da"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(), _json, max_size=8))
def test_key_order_never_changes_a_digest(value: dict[str, object]) -> None:
    assert digest(value) == digest(dict(reversed(list(value.items()))))
