"""The base every Intermission model shares.

Stored and transmitted values are pydantic v2 models serialised as JSON, never pickled. Bytes travel
as base64 in JSON, so `Continuation.prepared` survives jsonb and AMQP byte for byte: pydantic WRITES the
URL-safe alphabet (``-_``, padded) and READS either alphabet (tests/unit/test_schemas.py pins both).
Decode stored JSON with ``model_validate_json``: python-mode validation would take a base64 string for
raw bytes.

Stored JSON is decoded STRICTLY (``strict=True`` with the ``STORED`` context, ``store/rows.py``): a row
says ``"step_index": 3`` or it is malformed. Lax mode would read ``"3"`` as 3 and ``"true"`` as True, and a
row some other writer corrupted would then continue a run on values nobody wrote as such; the original
package scanned typed columns, where such a row is a scan error at the boundary.
"""

from __future__ import annotations

from typing import Final, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationInfo

M = TypeVar("M", bound=BaseModel)

# The validation context for decoding stored rows (``store/rows.py``).
STORED: Final[dict[str, bool]] = {"stored": True}

# What a stored record that predates schema versions reads as. It is still read (older evidence and older
# continuations are still valid), but as what it is, never silently as the current version.
LEGACY_SCHEMA_VERSION: Final = 0


def legacy_schema_version(record: M, info: ValidationInfo) -> M:
    """For a model's ``mode="after"`` validator: a STORED record without ``schema_version`` is legacy 0.

    The field's default is the current version, which is right for a record this code builds and wrong for
    one it reads: a row written before versions existed would otherwise read as current. (An AFTER
    validator, because a BEFORE one hands pydantic a Python dict and strict mode then refuses the base64
    text of a bytes field that JSON mode reads.)
    """
    if info.context and info.context.get("stored") and "schema_version" not in record.model_fields_set:
        # object.__setattr__: some versioned records are frozen; this is still their construction.
        object.__setattr__(record, "schema_version", LEGACY_SCHEMA_VERSION)
        record.model_fields_set.add("schema_version")
    return record


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
