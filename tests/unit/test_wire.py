"""What the wire contract builds from what arrived: derived ids that always fit, and headers the client
can encode again whatever they held."""

from __future__ import annotations

import hashlib

import aio_pika
from pamqp.encode import field_table

from intermission.wire import MAX_SHORT_STRING_BYTES, dead_copy, derived_id, wire_safe


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
