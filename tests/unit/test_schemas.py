"""The domain schemas on their own: decoding defaults, byte-exact JSON, scope validation, lease halves."""

from __future__ import annotations

import base64
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from intermission.schemas.base import STORED
from intermission.schemas.config import RunConfig
from intermission.schemas.digest import digest
from intermission.schemas.errors import InvalidScope
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import Continuation, Progress, Suspension
from tests.support.factories import continuation

# --- RunConfig.tools_restricted: absent decodes as FALSE, never true -------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        "{}",
        '{"tools": []}',
        '{"tools": ["lookup"]}',
        '{"all_tools_restricted": false, "tools": [], "max_steps": 3}',
    ],
)
def test_run_config_without_tools_restricted_decodes_as_false(raw: str) -> None:
    assert RunConfig.model_validate_json(raw).tools_restricted is False


def test_a_continuation_written_before_tools_restricted_existed_decodes_it_as_false() -> None:
    old_row = json.dumps({"messages": [], "system_prompt": "p", "config": {"tools": [], "model": "m"}})
    cont = Continuation.model_validate_json(old_row)
    assert cont.config.tools_restricted is False
    # An empty unrestricted list means every tool; the flag is what narrows it to none.
    assert cont.config.allows_tool("anything") is True
    assert cont.config.model_copy(update={"tools_restricted": True}).allows_tool("anything") is False


def test_tools_restricted_survives_a_json_round_trip_both_ways() -> None:
    for flag in (True, False):
        cfg = RunConfig(tools=[], tools_restricted=flag)
        assert RunConfig.model_validate_json(cfg.model_dump_json()).tools_restricted is flag


def test_a_temperature_json_cannot_carry_is_refused() -> None:
    # It would be written as null and come back as None.
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValidationError):
            RunConfig(temperature=bad)


# --- RunConfig.approvers: named by the host, stored exactly, absent when empty --------------------------


def test_approvers_survive_the_strict_stored_round_trip() -> None:
    named = {"send_email": ["alice", "é" * 127 + "x"], "wire_money": ["bob"]}  # 255 bytes is a user name
    cfg = RunConfig(approvers=named)
    back = RunConfig.model_validate_json(cfg.model_dump_json(), strict=True, context=STORED)
    assert back.approvers == named
    assert (back.approvers_for("send_email"), back.approvers_for("lookup")) == (named["send_email"], None)


def test_a_config_naming_no_approvers_is_written_and_digested_as_before_the_field_existed() -> None:
    # What a start or a stored row wrote before approvers existed: the digest of a re-sent start (its inbox
    # record, its start digest) must not change across the upgrade.
    cfg = RunConfig(max_steps=3)
    assert "approvers" not in cfg.model_dump()
    assert "approvers" not in json.loads(cfg.model_dump_json())
    before = {k: v for k, v in RunConfig(max_steps=3, approvers={"x": ["y"]}).model_dump().items() if k != "approvers"}
    assert digest(cfg) == digest(before)
    assert RunConfig.model_validate_json(cfg.model_dump_json()).approvers == {}


# --- Continuation: prepared bytes byte for byte ------------------------------------------------------


def test_continuation_json_round_trip_keeps_every_byte_of_prepared() -> None:
    every_byte = bytes(range(256)) * 3
    cont = continuation(prepared=every_byte)
    back = Continuation.model_validate_json(cont.model_dump_json())
    assert back.prepared == every_byte
    assert back == cont


@given(st.binary(max_size=2048))
def test_any_prepared_bytes_round_trip(prepared: bytes) -> None:
    cont = Continuation(prepared=prepared)
    assert Continuation.model_validate_json(cont.model_dump_json()).prepared == prepared


def test_prepared_is_written_url_safe_and_read_in_either_base64_alphabet() -> None:
    raw = b"\xfb\xff\xbf"  # "+/+/" in the standard alphabet, "-_-_" in the URL-safe one
    written = json.loads(Continuation(prepared=raw).model_dump_json())["prepared"]
    assert written == base64.urlsafe_b64encode(raw).decode()
    for encoded in (base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()):
        assert Continuation.model_validate_json(json.dumps({"prepared": encoded})).prepared == raw


def test_malformed_prepared_is_refused_rather_than_guessed() -> None:
    with pytest.raises(ValidationError):
        Continuation.model_validate_json('{"prepared": "not base64!"}')


def test_continuation_keeps_the_seeds_json_field_names() -> None:
    fields = set(json.loads(continuation().model_dump_json()))
    assert {
        "tool_results",
        "schema_version",
        "prepared",
        "provenance",
        "usage",
        "messages",
        "system_prompt",
        "step_index",
        "tokens_used",
        "new_messages_from",
        "session_id",
        "config",
    } <= fields


def test_the_claimed_run_is_never_part_of_a_suspensions_content() -> None:
    s = Suspension.model_validate_json('{"run_id": "r1", "scope": {"app": "a", "tenant": "t"}, "reason": "approval"}')
    assert "claimed_run" not in json.loads(s.model_dump_json())


def test_progress_round_trips_through_json() -> None:
    p = Progress(run_id="r1", owner="w", continuation=continuation(prepared=b"\x00\xff"))
    assert Progress.model_validate_json(p.model_dump_json()) == p


# --- Scope ----------------------------------------------------------------------------------------------

GOOD_PARTS = ["a", "acme", "ACME_app-2", "0", "_", "-", "a" * 64]
BAD_PARTS = ["", " ", "a b", "a.b", "a/b", "acmé", "a" * 65, "acme\n", "\nacme", "ac\tme", "a\x00"]


@pytest.mark.parametrize("part", GOOD_PARTS)
def test_scope_accepts_the_documented_alphabet(part: str) -> None:
    for scope in (Scope(app=part, tenant="t"), Scope(app="a", tenant=part)):
        assert require_scope(scope) is scope


@pytest.mark.parametrize("part", BAD_PARTS)
def test_scope_refuses_anything_else_when_built_and_when_smuggled_past_validation(part: str) -> None:
    with pytest.raises(ValidationError):
        Scope(app=part, tenant="t")
    with pytest.raises(ValidationError):
        Scope(app="a", tenant=part)
    # model_construct skips validation; the store's check must still refuse it.
    with pytest.raises(InvalidScope):
        require_scope(Scope.model_construct(app=part, tenant="t"))
    with pytest.raises(InvalidScope):
        require_scope(Scope.model_construct(app="a", tenant=part))


@pytest.mark.parametrize("value", [None, "acme/t1", {"app": "acme", "tenant": "t1"}, Scope.model_construct(**{})])
def test_require_scope_refuses_what_is_not_a_whole_scope(value: object) -> None:
    with pytest.raises(InvalidScope):
        require_scope(value)


def test_scope_is_exact_frozen_and_refuses_unknown_fields() -> None:
    s = Scope(app="acme", tenant="t1")
    assert s != Scope(app="acme", tenant="t2")
    assert s == Scope.model_validate_json('{"app": "acme", "tenant": "t1"}')
    with pytest.raises(ValidationError):
        s.app = "other"
    with pytest.raises(ValidationError):
        Scope.model_validate_json('{"app": "acme", "tenant": "t1", "prefix": "acme"}')
    assert s.routing_suffix() == "acme.t1"


# --- Lease: whole and half ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lease", "is_set", "is_half"),
    [
        (Lease(owner="w", ttl_seconds=30), True, False),
        (Lease(owner="w", ttl_seconds=0.001), True, False),
        (Lease(owner="w"), False, True),
        (Lease(owner="w", ttl_seconds=-1), False, True),
        (Lease(ttl_seconds=30), False, True),
        (Lease(), False, False),
    ],
)
def test_lease_is_whole_only_with_an_owner_and_a_positive_ttl(lease: Lease, is_set: bool, is_half: bool) -> None:
    assert lease.is_set is is_set
    assert lease.is_half is is_half


def test_a_lease_ttl_must_be_a_finite_number() -> None:
    for bad in (math.nan, math.inf):
        with pytest.raises(ValidationError):
            Lease(owner="w", ttl_seconds=bad)
