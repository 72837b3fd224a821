"""The base every Intermission model shares.

Stored and transmitted values are pydantic v2 models serialised as JSON, never pickled. Bytes travel
as base64 in JSON, so `Continuation.prepared` survives jsonb and AMQP byte for byte: pydantic WRITES the
URL-safe alphabet (``-_``, padded) and READS either alphabet (tests/unit/test_schemas.py pins both).
Decode stored JSON with ``model_validate_json``: python-mode validation would take a base64 string for
raw bytes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    """A domain value as stored: unknown fields are ignored so a newer worker's rows still read."""

    model_config = ConfigDict(
        extra="ignore",
        ser_json_bytes="base64",
        val_json_bytes="base64",
        populate_by_name=True,
    )


class StrictModel(BaseModel):
    """A value that crosses a trust boundary (a command body): unknown fields are refused."""

    model_config = ConfigDict(
        extra="forbid",
        ser_json_bytes="base64",
        val_json_bytes="base64",
        populate_by_name=True,
    )
