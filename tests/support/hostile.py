"""Hostile message parts for the tests and the soak: what a foreign or broken client can put on the wire
that this project's own clients never would."""

from __future__ import annotations

import struct
from typing import Any

import pamqp.encode


class RawText(str):
    """A header value that goes on the wire as a string header holding ``raw``, which need not be UTF-8:
    the AMQP client encodes a string by calling its ``encode``. It is how a foreign client's bytes are sent
    from here."""

    raw: bytes

    def __new__(cls, raw: bytes) -> RawText:
        made = super().__new__(cls, "raw")
        made.raw = raw
        return made

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


def nested(depth: int) -> bytes:
    """A JSON body whose scope nests ``depth`` arrays deep: small, and deeper than any parser should walk."""
    return b'{"scope": ' + b"[" * depth + b"]" * depth + b"}"


def padded_id(base: str, size: int = 250) -> str:
    """``base`` padded to ``size`` bytes: an id that fits AMQP's 255 bytes but not once prefixed."""
    return base + "-" + "m" * (size - len(base.encode()) - 1)


class RawField(bytes):
    """A header value that goes on the wire exactly as these bytes, type byte included: how a foreign
    client's header tables that this project's encoder would never write (nested hundreds deep) are sent
    from here. ``allow_raw_fields()`` teaches pamqp's encoder to write them."""


def allow_raw_fields() -> None:
    """Let pamqp's encoder write ``RawField`` values as they are (idempotent; every other value is encoded
    as before). Only the tests' publishers send such values."""
    if getattr(pamqp.encode.encode_table_value, "raw_fields", False):
        return
    original = pamqp.encode.encode_table_value

    def encode_table_value(value: Any) -> bytes:
        if isinstance(value, RawField):
            return bytes(value)
        return original(value)

    encode_table_value.raw_fields = True  # type: ignore[attr-defined]
    pamqp.encode.encode_table_value = encode_table_value


def nested_table(depth: int) -> RawField:
    """A field table (type byte ``F``) nesting ``depth`` tables, each holding the next under key ``k``: a
    few bytes a level, built without recursion."""
    table = b"F" + struct.pack(">I", 0)
    for _ in range(depth - 1):
        entry = b"\x01k" + table
        table = b"F" + struct.pack(">I", len(entry)) + entry
    return RawField(table)


def nested_array(depth: int) -> RawField:
    """A field array (type byte ``A``) nesting ``depth`` arrays."""
    array = b"A" + struct.pack(">I", 0)
    for _ in range(depth - 1):
        array = b"A" + struct.pack(">I", len(array)) + array
    return RawField(array)
