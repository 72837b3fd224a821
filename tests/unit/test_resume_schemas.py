"""Resume records without a database: the input size rule, request checks, digests that leave transient
authority out, closure freezing and receipt validation, and the admission cursor."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from intermission.schemas.digest import digest
from intermission.schemas.errors import InputTooLarge, InvalidArgument, InvalidScope, UnsupportedSchemaVersion
from intermission.schemas.resume import (
    LEGACY_SCHEMA_VERSION,
    RESUME_SCHEMA_VERSION,
    ResumeAdmission,
    ResumeAdmissionRequest,
    ResumeClosure,
    ResumeClosureRequest,
    ResumeStart,
    check_input_size,
    input_encoded_size,
)
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import MAX_RESUME_INPUT_BYTES, ClaimVersion, SuspendReason, Suspension
from intermission.store.resume import MAX_CURSOR_CHARS, decode_cursor, encode_cursor
from intermission.store.rows import load_model

SCOPE = Scope(app="acme", tenant="t1")
VERSION = ClaimVersion(run_id="run-1", suspension_id=7, run_revision=3)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


# --- the 8 MiB rule -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("", 0),
        ("abc", 3),
        ('"', 2),
        ("\\", 2),
        ("\n", 2),
        ("\t", 2),
        ("\x01", 6),
        ("\x7f", 1),
        ("é", 2),
        ("😀", 4),
        ("\u2028", 3),
        ('{"a": "b"}', 14),
    ],
)
def test_input_size_is_the_json_escaped_utf8_length_without_quotes(text: str, size: int) -> None:
    assert input_encoded_size(text.encode("utf-8")) == size


def test_exactly_the_limit_is_accepted_and_one_more_byte_is_not() -> None:
    check_input_size(b"a" * MAX_RESUME_INPUT_BYTES)
    check_input_size(b'"' * (MAX_RESUME_INPUT_BYTES // 2))
    with pytest.raises(InputTooLarge):
        check_input_size(b"a" * (MAX_RESUME_INPUT_BYTES + 1))
    with pytest.raises(InputTooLarge):
        check_input_size(b'"' * (MAX_RESUME_INPUT_BYTES // 2) + b"a")
    with pytest.raises(InputTooLarge):
        check_input_size(b"\x01" * (MAX_RESUME_INPUT_BYTES // 6 + 1))


def test_input_that_is_not_utf8_is_refused_not_measured() -> None:
    with pytest.raises(InvalidArgument):
        input_encoded_size(b"\xc3")
    with pytest.raises(InvalidArgument):
        check_input_size(b"ok \xff")


# --- admission requests -------------------------------------------------------------------------------


def _request(**changes: Any) -> ResumeAdmissionRequest:
    fields: dict[str, Any] = {"scope": SCOPE, "version": VERSION, "input": b'{"x":1}'}
    fields.update(changes)
    return ResumeAdmissionRequest(**fields)


def test_request_digest_covers_scope_version_and_input_bytes() -> None:
    base = _request().digest()
    assert _request().digest() == base
    assert _request(scope=Scope(app="acme", tenant="t2")).digest() != base
    assert _request(version=VERSION.model_copy(update={"run_revision": 4})).digest() != base
    assert _request(version=VERSION.model_copy(update={"suspension_id": 8})).digest() != base
    # Semantically the same JSON, different bytes: a different request. Storage never normalises.
    assert _request(input=b'{"x": 1}').digest() != base


def test_request_check_refuses_what_the_database_need_not_see() -> None:
    _request().check(SCOPE)
    with pytest.raises(InvalidArgument, match="scope"):
        _request().check(Scope(app="acme", tenant="t2"))
    with pytest.raises(InvalidScope):
        _request(scope=Scope.model_construct(app="", tenant="t1")).check(SCOPE)
    bad_versions = [
        ClaimVersion.model_construct(run_id="a b", suspension_id=1, run_revision=1),
        ClaimVersion.model_construct(run_id="r", suspension_id=0, run_revision=1),
        ClaimVersion.model_construct(run_id="r", suspension_id=True, run_revision=1),
        ClaimVersion.model_construct(run_id="r", suspension_id=1, run_revision=-1),
    ]
    for version in bad_versions:
        req = ResumeAdmissionRequest.model_construct(scope=SCOPE, version=version, input=b"x")
        with pytest.raises(InvalidArgument):
            req.check(SCOPE)
    with pytest.raises(InputTooLarge):
        _request(input=b"a" * (MAX_RESUME_INPUT_BYTES + 1)).check(SCOPE)


def test_admission_fresh_is_transient() -> None:
    admission = ResumeAdmission(
        schema_version=RESUME_SCHEMA_VERSION,
        request=_request(),
        request_digest=_request().digest(),
        suspension_digest="0" * 64,
        claimed_revision=4,
        admitted_at=T0,
        fresh=True,
    )
    assert "fresh" not in admission.model_dump()
    assert digest(admission) == digest(admission.model_copy(update={"fresh": False}))


# --- starts ---------------------------------------------------------------------------------------------


def _start(**changes: Any) -> ResumeStart:
    fields: dict[str, Any] = {
        "schema_version": RESUME_SCHEMA_VERSION,
        "version": VERSION,
        "scope": SCOPE,
        "request_digest": "a" * 64,
        "started_at": T0,
    }
    fields.update(changes)
    return ResumeStart(**fields)


def test_start_digest_leaves_out_its_transient_execution_authority() -> None:
    suspension = Suspension(run_id="run-1", scope=SCOPE, reason=SuspendReason.AGENT_REPLY)
    bare = _start()
    granted = _start(fresh=True, suspension=suspension)
    assert granted.digest() == bare.digest()
    assert "suspension" not in granted.model_dump()
    assert _start(started_at=T0 + timedelta(microseconds=1)).digest() != bare.digest()
    assert _start(schema_version=0).digest() != bare.digest()


# --- closure requests and receipts -----------------------------------------------------------------------


def _closure_request(**changes: Any) -> ResumeClosureRequest:
    fields: dict[str, Any] = {
        "scope": SCOPE,
        "version": VERSION,
        "admission_digest": "a" * 64,
        "start_digest": "b" * 64,
        "run_revision": 4,
        "actor": "operator",
        "issuer": "host-ca",
        "issuer_revision": "12",
        "proof_ref": "proof-1",
        "proof_digest": "c" * 64,
        "observed_at": T0,
        "expires_at": T0 + timedelta(minutes=5),
    }
    fields.update(changes)
    return ResumeClosureRequest(**fields)


def test_freeze_returns_a_detached_copy_and_its_digest() -> None:
    req = _closure_request()
    frozen, wanted = req.freeze()
    assert frozen == req
    assert frozen is not req
    assert frozen.scope is not req.scope
    assert frozen.version is not req.version
    assert wanted == digest(frozen) == digest(req)
    assert req.schema_version == RESUME_SCHEMA_VERSION


def test_freeze_digest_changes_with_every_field() -> None:
    _, base = _closure_request().freeze()
    changed = {
        "scope": Scope(app="acme", tenant="t2"),
        "version": VERSION.model_copy(update={"run_revision": 9}),
        "admission_digest": "d" * 64,
        "start_digest": "e" * 64,
        "run_revision": 5,
        "actor": "other",
        "issuer": "other-ca",
        "issuer_revision": "13",
        "proof_ref": "proof-2",
        "proof_digest": "f" * 64,
        "observed_at": T0 - timedelta(seconds=1),
        "expires_at": T0 + timedelta(minutes=6),
    }
    for name, value in changed.items():
        assert _closure_request(**{name: value}).freeze()[1] != base, name


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"schema_version": 0}, UnsupportedSchemaVersion),
        ({"schema_version": 2}, UnsupportedSchemaVersion),
        ({"scope": Scope.model_construct(app="a", tenant="bad tenant")}, InvalidScope),
        ({"admission_digest": ""}, InvalidArgument),
        ({"start_digest": "g" * 64}, InvalidArgument),
        ({"proof_digest": "a" * 63}, InvalidArgument),
        ({"run_revision": -1}, InvalidArgument),
        ({"actor": ""}, InvalidArgument),
        ({"issuer": "   "}, InvalidArgument),
        ({"issuer_revision": ""}, InvalidArgument),
        ({"proof_ref": "x" * 1025}, InvalidArgument),
        ({"observed_at": T0.replace(tzinfo=None)}, InvalidArgument),
        ({"expires_at": T0.replace(tzinfo=None)}, InvalidArgument),
        ({"expires_at": T0}, InvalidArgument),
        ({"expires_at": T0 - timedelta(seconds=1)}, InvalidArgument),
    ],
)
def test_freeze_refuses_a_malformed_request(changes: dict[str, Any], error: type[Exception]) -> None:
    # model_construct skips pydantic, so freeze's own checks are what is under test.
    fields = _closure_request().model_dump()
    fields["scope"] = SCOPE
    fields["version"] = VERSION
    fields.update(changes)
    with pytest.raises(error):
        ResumeClosureRequest.model_construct(**fields).freeze()


def test_closure_request_refuses_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        ResumeClosureRequest.model_validate({**_closure_request().model_dump(), "output": "accepted"})


def _receipt(**changes: Any) -> ResumeClosure:
    req = _closure_request()
    fields: dict[str, Any] = {
        "request": req,
        "request_digest": req.freeze()[1],
        "event_id": uuid.uuid4(),
        "run_revision": req.run_revision + 1,
        "closed_at": T0 + timedelta(seconds=1),
    }
    fields.update(changes)
    return ResumeClosure(**fields)


def test_a_consistent_receipt_validates_and_survives_a_json_round_trip() -> None:
    receipt = _receipt()
    receipt.validate()
    again = ResumeClosure.model_validate_json(receipt.model_dump_json())
    again.validate()
    assert again.request_digest == receipt.request_digest


@pytest.mark.parametrize(
    "changes",
    [
        {"request_digest": "0" * 64},
        {"run_revision": 4},
        {"run_revision": 6},
        {"event_id": uuid.UUID(int=0)},
        {"closed_at": T0.replace(tzinfo=None)},  # a naive time
        {"request": _closure_request().model_copy(update={"actor": "someone-else"})},
    ],
)
def test_an_inconsistent_receipt_fails_validation(changes: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        _receipt(**changes).validate()


# --- the admission cursor ------------------------------------------------------------------------------


def test_cursor_round_trips_and_the_empty_cursor_is_the_first_page() -> None:
    cursor = encode_cursor(SCOPE, "run-9", 42)
    assert decode_cursor(SCOPE, cursor) == ("run-9", 42)
    assert decode_cursor(SCOPE, "") is None
    assert len(encode_cursor(SCOPE, "r" * 128, 2**63 - 1)) < MAX_CURSOR_CHARS


@pytest.mark.parametrize(
    "bad",
    [
        "!!!",
        "e30",  # {}
        "x" * (MAX_CURSOR_CHARS + 1),
        encode_cursor(SCOPE, "run-9", 42) + "=",
        encode_cursor(SCOPE, "run-9", 42)[:-1],
        encode_cursor(Scope(app="acme", tenant="t2"), "run-9", 42),
    ],
)
def test_cursor_that_this_store_did_not_issue_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="cursor"):
        decode_cursor(SCOPE, bad)


def test_cursor_with_a_forged_position_is_refused() -> None:
    for payload in [
        {"a": "acme", "t": "t1", "r": "bad id", "s": 1, "v": 1},
        {"a": "acme", "t": "t1", "r": "r", "s": 0, "v": 1},
        {"a": "acme", "t": "t1", "r": "r", "s": 1, "v": 2},
        {"a": "acme", "t": "t1", "r": "r", "s": 1, "v": 1, "extra": 1},
        {"a": "acme", "t": "t1", "r": "r", "s": True, "v": 1},
    ]:
        raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        forged = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        with pytest.raises(InvalidArgument):
            decode_cursor(SCOPE, forged)


def test_a_stored_closure_request_without_a_schema_version_is_legacy_zero_and_closes_nothing() -> None:
    stored = json.loads(_closure_request().model_dump_json())
    del stored["schema_version"]
    legacy = load_model(ResumeClosureRequest, json.dumps(stored), "closure request")
    assert legacy.schema_version == LEGACY_SCHEMA_VERSION  # read as what it is, not as current
    with pytest.raises(UnsupportedSchemaVersion):
        legacy.freeze()
    # A request this code builds is current, with or without the field spelled out.
    assert ResumeClosureRequest.model_validate_json(json.dumps(stored)).schema_version == RESUME_SCHEMA_VERSION
