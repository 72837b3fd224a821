"""From a delivery to a validated command, or a typed refusal.

Everything a worker reads off the wire is checked here, before any database access: the message_id (the
idempotency key), the schema version header, and the body against the command's strict model (unknown
fields are refused). A scope that is missing or malformed is ``invalid_scope``; any other shape problem is
``invalid_message``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from intermission.schemas.errors import InvalidMessage, InvalidScope, UnsupportedSchemaVersion
from intermission.wire import SCHEMA_VERSION, SCHEMA_VERSION_HEADER

C = TypeVar("C", bound=BaseModel)


# A command body is small; anything near this is an attack or a bug. The 8 MiB reply input (JSON escaped)
# plus its envelope fits.
MAX_BODY_BYTES = 17 * 1024 * 1024


@dataclass(frozen=True)
class Delivery:
    """The parts of an AMQP delivery the policy reads."""

    message_id: str | None
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    user_id: str | None
    correlation_id: str | None


def check_envelope(delivery: Delivery) -> str:
    """The message_id and schema version; returns the message_id."""
    if not delivery.message_id:
        raise InvalidMessage("the message has no message_id")
    if len(delivery.message_id) > 256:
        raise InvalidMessage("the message_id is longer than 256 characters")
    version = delivery.headers.get(SCHEMA_VERSION_HEADER)
    if version is None:
        raise UnsupportedSchemaVersion(f"the message has no {SCHEMA_VERSION_HEADER} header")
    if isinstance(version, bool) or not isinstance(version, int | str) or str(version) != str(SCHEMA_VERSION):
        raise UnsupportedSchemaVersion(f"{SCHEMA_VERSION_HEADER} {version!r} is not {SCHEMA_VERSION}")
    return delivery.message_id


def parse_body(model: type[C], body: bytes) -> C:
    if len(body) > MAX_BODY_BYTES:
        raise InvalidMessage(f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        if any(err["loc"] and err["loc"][0] == "scope" for err in errors):
            raise InvalidScope("the scope is missing or malformed (app and tenant: [A-Za-z0-9_-]{1,64})") from exc
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidMessage(f"{where}: {first['msg']} ({len(errors)} problem(s))") from exc


def scope_hint(body: bytes) -> tuple[str, str] | None:
    """The body's scope if it is readable at all, to route a rejection to the sender's scope."""
    try:
        parsed = json.loads(body)
        scope = parsed.get("scope") if isinstance(parsed, dict) else None
        if isinstance(scope, dict):
            app, tenant = scope.get("app"), scope.get("tenant")
            if isinstance(app, str) and isinstance(tenant, str):
                return app, tenant
    except (ValueError, UnicodeDecodeError):
        return None
    return None
