"""The envelope and body checks every command passes before any database access."""

from __future__ import annotations

import pytest

from intermission.amqp_headers import TOO_DEEP
from intermission.consumers.parsing import (
    MAX_COMMAND_HEADER_BYTES,
    MAX_HEADER_VALUES,
    MAX_HEADERS,
    MAX_JSON_DEPTH,
    Delivery,
    check_body_limits,
    check_envelope,
    json_depth,
    parse_body,
)
from intermission.schemas.commands import ResumeCommand
from intermission.schemas.errors import IntermissionError, InvalidMessage, InvalidScope, UnsupportedSchemaVersion

GOOD = b'{"scope":{"app":"a","tenant":"t"},"version":{"run_id":"r","suspension_id":1,"run_revision":1},"results":[]}'


def delivery(message_id: str | None = "m-1", headers: dict[str, object] | None = None) -> Delivery:
    return Delivery(
        message_id=message_id,
        routing_key="run.resume",
        body=GOOD,
        headers={"x-schema-version": 1} if headers is None else headers,
        user_id=None,
        correlation_id=None,
    )


@pytest.mark.parametrize(
    ("envelope", "error"),
    [
        (delivery(message_id=None), InvalidMessage),
        (delivery(message_id=""), InvalidMessage),
        (delivery(message_id="x" * 256), InvalidMessage),
        (delivery(message_id="é" * 128), InvalidMessage),  # 256 bytes of UTF-8
        (delivery(headers={}), UnsupportedSchemaVersion),
        (delivery(headers={"x-schema-version": 2}), UnsupportedSchemaVersion),
        (delivery(headers={"x-schema-version": True}), UnsupportedSchemaVersion),
    ],
)
def test_bad_envelopes_are_refused(envelope: Delivery, error: type[IntermissionError]) -> None:
    with pytest.raises(error):
        check_envelope(envelope)


def test_a_good_envelope_passes() -> None:
    assert check_envelope(delivery()) == "m-1"
    assert check_envelope(delivery(headers={"x-schema-version": "1"})) == "m-1"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{not json", InvalidMessage),
        (b"[]", InvalidMessage),
        (GOOD.replace(b'"results":[]', b'"results":[],"extra":1'), InvalidMessage),  # unknown fields refused
        (GOOD.replace(b'"app":"a"', b'"app":"a.b"'), InvalidScope),
        (GOOD.replace(b'{"app":"a","tenant":"t"}', b"null"), InvalidScope),
    ],
)
def test_bad_bodies_are_refused(body: bytes, error: type[IntermissionError]) -> None:
    with pytest.raises(error):
        parse_body(ResumeCommand, body)


@pytest.mark.parametrize(
    ("body", "depth"),
    [
        (b"{}", 1),
        (b'{"a": [1, {"b": []}]}', 4),
        (b'{"a": "[[[[[[ not brackets ]"}', 1),
        (b'{"a": "an \\" escaped quote [[["}', 1),
        (b"[" * 5000 + b"]" * 5000, 5000),
        (b"", 0),
        (b"{not json", 1),
    ],
)
def test_json_depth_counts_nesting_outside_strings(body: bytes, depth: int) -> None:
    assert json_depth(body) == depth


def test_body_limits_are_checked_before_parsing() -> None:
    check_body_limits(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, 1024)
    with pytest.raises(InvalidMessage, match="deeper"):
        check_body_limits(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), 1024)
    check_body_limits(b'"' + b"x" * 1022 + b'"', 1024)
    with pytest.raises(InvalidMessage, match="over this command's limit of 1024"):
        check_body_limits(b'"' + b"x" * 1023 + b'"', 1024)


def test_message_ids_with_control_characters_are_refused() -> None:
    with pytest.raises(InvalidMessage, match="control"):
        check_envelope(delivery(message_id="a\x00b"))


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({"x-schema-version": 1, "x-nest": {"k": TOO_DEEP}}, "nests deeper"),
        ({"x-schema-version": 1, **{f"h{i}": i for i in range(MAX_HEADERS)}}, "headers, over the limit"),
        ({"x-schema-version": 1, "x-many": list(range(MAX_HEADER_VALUES))}, "more than"),
        ({"x-schema-version": 1, "x-big": "x" * (MAX_COMMAND_HEADER_BYTES + 1)}, "larger than"),
        ({"x-schema-version": 1, "x-big": [b"y" * 9000, {"z": "z" * 9000}]}, "larger than"),
    ],
)
def test_headers_past_their_bounds_are_refused_before_anything_reads_them(headers: dict[str, object], why: str) -> None:
    with pytest.raises(InvalidMessage, match=why):
        check_envelope(delivery(headers=headers))


def test_headers_within_their_bounds_pass() -> None:
    headers: dict[str, object] = {
        "x-schema-version": 1,
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "x-host-note": {"nested": [1, 2, {"deeper": "yes"}]},
    }
    assert check_envelope(delivery(headers=headers)) == "m-1"
