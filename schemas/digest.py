"""The one canonical digest Intermission binds evidence with.

``digest(value)`` is the lowercase hex SHA-256 of the value's canonical JSON:

- objects with keys sorted by code point, no insignificant whitespace, UTF-8 (no ``\\u`` escapes for
  non-ASCII text);
- bytes as standard base64 (with padding);
- times as RFC 3339 in UTC with exactly six fractional digits and a ``Z``
  (``2026-11-30T15:33:05.000000Z``); a naive time is refused rather than guessed;
- enums as their values; pydantic models by their JSON field names, transient (excluded) fields left out.

Changing any of this changes every stored digest, so it is versioned with ``schema_version`` and never
edited in place.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel


def _canonical(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return _canonical(value.model_dump(mode="python", by_alias=True))
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("a naive datetime has no canonical form")
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if isinstance(value, Enum):
        return _canonical(value.value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"no canonical JSON form for {type(value).__name__}")


def canonical_json(value: Any) -> bytes:
    return json.dumps(
        _canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()
