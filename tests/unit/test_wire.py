"""What the wire contract builds from what arrived: derived ids that always fit, and headers the client
can encode again whatever they held."""

from __future__ import annotations

import hashlib

import aio_pika
from pamqp.encode import field_table

from intermission.schemas.events import CommandRejected
from intermission.wire import (
    ERROR_HEADER,
    HEADERS_DROPPED_HEADER,
    MAX_SHORT_STRING_BYTES,
    ORIGINAL_KEY_HEADER,
    SCHEMA_VERSION_HEADER,
    dead_copy,
    derived_id,
    rejected_key,
    rejection_message,
    wire_problem,
    wire_safe,
)


def test_a_derived_id_is_plain_while_it_fits_and_a_digest_after() -> None:
    assert derived_id("rejected", "m-1") == "rejected:m-1"
    fits = "m" * (MAX_SHORT_STRING_BYTES - len("rejected:"))
    assert derived_id("rejected", fits) == f"rejected:{fits}"
    longer = fits + "m"
    assert derived_id("rejected", longer) == f"rejected:sha256:{hashlib.sha256(longer.encode()).hexdigest()}"
    # Counted in bytes, not characters.
    wide = "é" * 124
    assert len(f"rejected:{wide}".encode()) > MAX_SHORT_STRING_BYTES
    assert derived_id("rejected", wide).startswith("rejected:sha256:")
    assert derived_id("rejected", "é" * 255) != derived_id("rejected", "é" * 254)


def test_headers_that_came_as_bytes_are_encodable_again() -> None:
    arrived = {"x-a": b"\xff\xfe", "x-t": {"inner": b"\xc3", "n": 1}, "x-l": [b"\x80", "ok"], "x-s": "text"}
    safe = {k: wire_safe(v) for k, v in arrived.items()}
    assert safe == {
        "x-a": bytearray(b"\xff\xfe"),
        "x-t": {"inner": bytearray(b"\xc3"), "n": 1},
        "x-l": [bytearray(b"\x80"), "ok"],
        "x-s": "text",
    }
    field_table(safe)  # raises TypeError for anything the client cannot put on the wire


def test_a_dead_copy_of_a_message_with_raw_headers_is_a_message() -> None:
    copy = dead_copy(
        b"{}",
        {"x-a": b"\xff"},
        message_id="m",
        correlation_id=None,
        routing_key="run.resume",
        code="invalid_message",
        detail="d",
    )
    assert isinstance(copy, aio_pika.Message)
    field_table(copy.headers)


def test_a_dead_copy_always_fits_a_frame_and_never_carries_a_sender_s_refusal() -> None:
    """Finding 2: headers that nearly fill a frame, on the longest ids and key the wire takes, and the
    longest detail: the copy still fits, keeps the refusal and the schema version, and says what it left
    out. Sender-written look-alikes of the refusal and of ``x-death`` never survive, fitting or not."""
    longest = "k" * MAX_SHORT_STRING_BYTES
    forged = {
        ERROR_HEADER: "store_unavailable",
        ORIGINAL_KEY_HEADER: "run.cancel.victim.a",
        "x-intermission-anything": "x",
        "x-death": [{"reason": "delivery_limit"}],
    }
    for padding in ({"x-pad": "p" * 130_000}, {f"x-{i}": "p" * 1_000 for i in range(120)}, {}):
        copy = dead_copy(
            b"{}",
            {SCHEMA_VERSION_HEADER: 1, **forged, **padding},
            message_id=longest,
            correlation_id=longest,
            routing_key=longest,
            code="invalid_message",
            detail="\u00e9" * 100_000,
        )
        assert wire_problem(copy, longest) is None
        headers = copy.headers
        assert (headers[ERROR_HEADER], headers[ORIGINAL_KEY_HEADER]) == ("invalid_message", longest)
        assert headers[SCHEMA_VERSION_HEADER] == 1
        assert "x-death" not in headers
        assert "x-intermission-anything" not in headers
        assert (HEADERS_DROPPED_HEADER in headers) is bool(padding)
        assert all(k in headers for k in padding) is not bool(padding)


def test_a_rejected_event_fits_the_wire_whatever_the_refused_command_held() -> None:
    """The ``command.rejected`` event's properties are bounded by construction: its id is derived to fit,
    its correlation id is the refused id (which came over the wire), its only header a formatted
    traceparent; the detail travels in its body, which has no frame bound."""
    longest = "\u00e9" * (MAX_SHORT_STRING_BYTES // 2)
    rejection = CommandRejected(
        message_id=longest, routing_key="k" * MAX_SHORT_STRING_BYTES, code="invalid_message", detail="d" * 200_000
    )
    event = rejection_message(rejection, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert wire_problem(event, rejected_key(None)) is None
