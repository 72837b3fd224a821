"""The bounded header decoder (intermission/amqp_headers.py): what pamqp's encoder writes, it reads back as
pamqp would; what nests past its depth it steps over by length, in linear time and without recursion
trouble; what is malformed it refuses with pamqp's own ValueError."""

from __future__ import annotations

import importlib.util
import struct
import sys
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import decode, encode

from intermission import amqp_headers
from intermission.amqp_headers import MAX_HEADER_DEPTH, TOO_DEEP, field_table
from tests.support.hostile import nested_array, nested_table

amqp_headers.install()


def pristine_pamqp_decode() -> Any:
    """A copy of pamqp's decode module loaded apart from the one install() patched: its own type tables,
    its own recursive field_table, exactly as pamqp ships it."""
    spec = importlib.util.find_spec("pamqp.decode")
    assert spec is not None
    assert spec.origin is not None
    copy = importlib.util.spec_from_file_location("pamqp_decode_as_shipped", spec.origin)
    assert copy is not None
    assert copy.loader is not None
    module = importlib.util.module_from_spec(copy)
    copy.loader.exec_module(module)
    return module


PAMQP_DECODE = pristine_pamqp_decode()

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    # pamqp writes a float as single precision (type f).
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.binary(max_size=40).map(bytearray),
    st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2100, 1, 1)).map(
        lambda d: d.replace(microsecond=0, tzinfo=UTC)
    ),
    st.decimals(places=2, min_value=-(10**6), max_value=10**6, allow_nan=False, allow_infinity=False),
)
keys = st.text(alphabet=st.characters(codec="utf-8"), max_size=12).filter(lambda k: len(k.encode()) < 256)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=25
)


@pytest.mark.unit
@given(st.dictionaries(keys, values, max_size=8))
def test_what_pamqp_encodes_decodes_to_the_same_headers(headers: dict[str, Any]) -> None:
    data = encode.field_table(headers)
    consumed, decoded = field_table(data)
    assert consumed == len(data)
    assert decoded == headers
    # And exactly what pamqp's own decoder, untouched, reads from the same bytes.
    assert PAMQP_DECODE.field_table is not decode.field_table
    assert (consumed, decoded) == PAMQP_DECODE.field_table(data)


@pytest.mark.unit
def test_the_decoder_is_the_one_pamqp_uses_for_message_properties() -> None:
    assert amqp_headers.installed()
    data = encode.field_table({"a": {"b": [1]}})
    assert decode.by_type(data, "table") == (len(data), {"a": {"b": [1]}})
    assert decode.METHODS["table"] is field_table


@pytest.mark.unit
@pytest.mark.parametrize("nest", [nested_table, nested_array])
def test_a_value_nested_past_the_depth_is_stepped_over_by_its_length(nest: Any) -> None:
    # The header table itself is the first level: a header's value may nest MAX_HEADER_DEPTH - 1 more.
    empty: Any = {} if nest is nested_table else []
    stepped_over: Any = {"k": TOO_DEEP} if nest is nested_table else [TOO_DEEP]
    for value, innermost in ((nest(MAX_HEADER_DEPTH - 1), empty), (nest(MAX_HEADER_DEPTH), stepped_over)):
        # A header table holding the value under "x", then another header: the frame stays aligned.
        entries = b"\x01x" + bytes(value) + b"\x01yS" + struct.pack(">I", 2) + b"ok"
        consumed, table = field_table(struct.pack(">I", len(entries)) + entries)
        assert consumed == len(entries) + 4
        assert isinstance(table, dict)
        assert table["y"] == "ok"
        inner: Any = table["x"]
        for _ in range(MAX_HEADER_DEPTH - 2):
            inner = inner["k"] if isinstance(inner, dict) else inner[0]
        assert inner == innermost


@pytest.mark.unit
def test_a_table_thousands_deep_decodes_far_inside_the_recursion_limit() -> None:
    value = nested_table(50_000)
    entries = b"\x01x" + bytes(value)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # pamqp's decoder would need 100,000 frames
    try:
        _, table = field_table(struct.pack(">I", len(entries)) + entries)
    finally:
        sys.setrecursionlimit(limit)
    assert isinstance(table, dict)
    assert "x" in table


@pytest.mark.unit
@pytest.mark.parametrize(
    "data",
    [
        struct.pack(">I", 10) + b"\x01x",  # the table claims more bytes than the frame has
        struct.pack(">I", 3) + b"\x01xZ",  # an unknown type
        struct.pack(">I", 7) + b"\x01xS" + struct.pack(">I", 99),  # a string past its table
        struct.pack(">I", 4) + b"\x01xI",  # an integer cut short
    ],
)
def test_malformed_tables_are_a_value_error_as_in_pamqp(data: bytes) -> None:
    with pytest.raises(ValueError, match=r"Could not unpack|Unknown type|exceeds"):
        field_table(data)


@pytest.mark.unit
def test_decimals_and_timestamps_read_as_pamqp_reads_them() -> None:
    when = datetime(2026, 12, 3, 6, 0, 0, tzinfo=UTC)
    data = encode.field_table({"d": Decimal("12.34"), "t": when, "v": None})
    assert field_table(data)[1] == {"d": Decimal("12.34"), "t": when, "v": None}
