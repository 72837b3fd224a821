"""Decoding AMQP header tables within bounds, so that no message's headers can take a connection down.

The AMQP client (aiormq, over pamqp) decodes a message's properties, its header table included, in the
connection's frame reader, before any product code sees the message. pamqp decodes a nested table by
recursion, one Python frame pair per level: a table nested a few hundred deep (a few KB, well inside any
frame) raises ``RecursionError`` there, the reader dies, and the WHOLE connection drops — consumers, relay
and refusals of every tenant — while the message stays queued for the next worker to die on. Its decoder
also copies the rest of the frame for every value it reads, so a table of many tiny values costs time
quadratic in its size.

Field tables and arrays carry their length in bytes before their contents, so a decoder can step over one
without reading it. The decoder here reads tables and arrays by offset (linear in the frame), to a depth of
``MAX_HEADER_DEPTH``; a table or array nested deeper is skipped by its length and replaced by the string
``TOO_DEEP``, which the consumers refuse (``consumers/parsing.py``) and which encodes again like any string,
so a refusal can carry the message to the dead-letter queue and the tools that read it there can show it.
Values that are not tables or arrays are decoded by pamqp's own functions, each given exactly its bytes.

``install()`` puts it in pamqp's place for this process (idempotently): in the type tables that
``pamqp.base`` (message properties, method arguments) and the embedded-value decoder look decoders up in.
Decoding is otherwise identical to pamqp's (tests/unit/test_amqp_headers.py checks that against pamqp's
encoder); it touches pamqp's module-level tables, so pyproject.toml bounds pamqp's version.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from pamqp import common, decode

# Deeper than any header the product or its hosts write (the deepest is x-death: a list of tables holding
# a list), and shallow enough that Python's recursion limit is never near.
MAX_HEADER_DEPTH: Final = 16
# What a table or array nested beyond MAX_HEADER_DEPTH is decoded as. Not a valid value of any header the
# product reads, and printable, so it survives a copy to the dead-letter queue.
TOO_DEEP: Final = "intermission:header-too-deep"

_LENGTH: Final = struct.Struct(">I")
_KEY_LENGTH: Final = struct.Struct(">B")
# The size of every fixed-size value type, after its type byte (RabbitMQ's errata names the types).
_FIXED_SIZES: Final[dict[bytes, int]] = {
    b"t": 1,
    b"b": 1,
    b"B": 1,
    b"s": 2,
    b"u": 2,
    b"I": 4,
    b"i": 4,
    b"l": 8,
    b"L": 8,
    b"f": 4,
    b"d": 8,
    b"D": 5,
    b"T": 8,
    b"V": 0,
    b"\x00": 0,
}

Decoder = Callable[[bytes], tuple[int, common.FieldValue]]
# pamqp's own decoders of the values that are neither tables nor arrays, taken before install() replaces
# anything, so that a second install() still finds them.
_SCALARS: Final[dict[bytes, Decoder]] = {
    kind: decoder for kind, decoder in decode.TABLE_MAPPING.items() if kind not in (b"F", b"A")
}


def _length_at(data: bytes, offset: int) -> int:
    if offset + 4 > len(data):
        raise ValueError("Could not unpack data: a length runs past the end of the frame")
    length: int = _LENGTH.unpack_from(data, offset)[0]
    return length


def _value(data: bytes, offset: int, depth: int) -> tuple[int, common.FieldValue]:
    """The value whose type byte is at ``offset``, and the offset after it."""
    kind = data[offset : offset + 1]
    offset += 1
    if kind == b"F":
        return _table(data, offset, depth + 1)
    if kind == b"A":
        return _array(data, offset, depth + 1)
    decoder = _SCALARS.get(kind)
    if decoder is None:
        raise ValueError(f"Unknown type: {kind!r}")
    size = _FIXED_SIZES.get(kind)
    if size is None:
        # Every other type pamqp knows is a long string or a byte array.
        size = 4 + _length_at(data, offset)
    end = offset + size
    if end > len(data):
        raise ValueError(f"Could not unpack data: a value of type {kind!r} runs past the end of the frame")
    _, value = decoder(data[offset:end])
    return end, value


def _table(data: bytes, offset: int, depth: int) -> tuple[int, common.FieldValue]:
    end = offset + 4 + _length_at(data, offset)
    if end > len(data):
        raise ValueError("Field table length exceeds available data")
    if depth > MAX_HEADER_DEPTH:
        return end, TOO_DEEP
    table: dict[str, common.FieldValue] = {}
    offset += 4
    while offset < end:
        key_length: int = _KEY_LENGTH.unpack_from(data, offset)[0]
        offset += 1
        if offset + key_length > end:
            raise ValueError("Field table key length exceeds data")
        key = data[offset : offset + key_length].decode("utf-8")
        offset += key_length
        offset, table[key] = _value(data, offset, depth)
    if offset != end:
        raise ValueError("Field table values run past the table's length")
    return end, table


def _array(data: bytes, offset: int, depth: int) -> tuple[int, common.FieldValue]:
    end = offset + 4 + _length_at(data, offset)
    if end > len(data):
        raise ValueError("Field array length exceeds available data")
    if depth > MAX_HEADER_DEPTH:
        return end, TOO_DEEP
    items: list[common.FieldValue] = []
    offset += 4
    while offset < end:
        offset, item = _value(data, offset, depth)
        items.append(item)
    if offset != end:
        raise ValueError("Field array values run past the array's length")
    return end, items


def field_table(value: bytes) -> tuple[int, common.FieldValue]:
    """pamqp's ``decode.field_table``, bounded: bytes consumed and the table (a top-level header table is
    depth 1)."""
    try:
        return _table(bytes(value), 0, 1)
    except (struct.error, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"Could not unpack data: {exc}") from exc


def field_array(value: bytes) -> tuple[int, common.FieldValue]:
    """pamqp's ``decode.field_array``, bounded."""
    try:
        return _array(bytes(value), 0, 1)
    except (struct.error, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"Could not unpack data: {exc}") from exc


def embedded_value(value: bytes) -> tuple[int, common.FieldValue]:
    """pamqp's ``decode.embedded_value``, bounded."""
    if not value:
        return 0, None
    try:
        return _value(bytes(value), 0, 1)
    except (struct.error, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"Could not unpack data: {exc}") from exc


def install() -> None:
    """Decode every field table and array of this process with the bounded decoder (idempotent)."""
    decode.METHODS["table"] = field_table
    decode.METHODS["array"] = field_array
    decode.TABLE_MAPPING[b"F"] = field_table
    decode.TABLE_MAPPING[b"A"] = field_array
    # Module attributes too, for callers that look the functions up by name.
    decode.field_table = field_table  # type: ignore[assignment]
    decode.field_array = field_array  # type: ignore[assignment]
    decode.embedded_value = embedded_value


def installed() -> bool:
    return decode.METHODS.get("table") is field_table
