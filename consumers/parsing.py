"""From a delivery to a validated command, or a typed refusal.

Everything a worker reads off the wire is checked here, before any database access: the headers (how
many, how large, and none nested past what the client decodes), the message_id (the idempotency key), the
schema version header, the body's size and nesting depth (before anything parses
it), and the body against the command's strict model (unknown fields are refused). A scope that is missing
or malformed is ``invalid_scope``; any other shape problem is ``invalid_message``.

The limits exist because a command queue is shared: one message that makes its handler raise something
other than a refusal, or spend seconds of CPU, stops or slows every command behind it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from intermission.amqp_headers import MAX_HEADER_DEPTH, TOO_DEEP
from intermission.schemas.errors import Forbidden, InvalidMessage, InvalidScope, UnsupportedSchemaVersion
from intermission.schemas.scope import Scope
from intermission.wire import SCHEMA_VERSION, SCHEMA_VERSION_HEADER, Command, KeyScopeInvalid

C = TypeVar("C", bound=BaseModel)


# run.reply carries the agent's reply, up to 8 MiB of JSON-escaped input (schemas/resume.py); escaped once
# more inside the command's JSON it can double, and the envelope adds a little. Every other command's limit
# is a setting (``INTERMISSION_MAX_COMMAND_BYTES``, 1 MiB by default): a resume's tool results are the
# largest of them and are not meant to carry documents.
MAX_REPLY_BODY_BYTES: Final = 17 * 1024 * 1024
# Deeper than any command the contract describes (script arguments are the deepest, a few levels). The JSON
# parser's own limit (200) would refuse deeper bodies too, but Python's json module and any code that walks
# the parsed value recursively would not be safe at that depth; the check runs before either can.
MAX_JSON_DEPTH: Final = 64
# An AMQP short string: the longest message_id the wire can carry, and so the longest an id may be.
MAX_SHORT_STRING_BYTES: Final = 255

# A command's headers: the schema version, perhaps a traceparent and tracestate, whatever a host adds for
# its own tracing. These bounds are far above that and far below a frame: a refusal's dead copy adds its own
# headers to the sender's, and must still fit (intermission/wire.py).
MAX_HEADERS: Final = 64
MAX_HEADER_VALUES: Final = 1024
MAX_COMMAND_HEADER_BYTES: Final = 16 * 1024

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_CHANGE = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


@dataclass(frozen=True)
class Delivery:
    """The parts of an AMQP delivery the policy reads."""

    message_id: str | None
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    user_id: str | None
    correlation_id: str | None


def check_headers(headers: dict[str, Any]) -> None:
    """The header table within bounds: at most ``MAX_HEADERS`` headers, ``MAX_HEADER_VALUES`` values in
    all, about ``MAX_COMMAND_HEADER_BYTES`` of names and values, and nothing nested deeper than the client decodes
    (``amqp_headers.TOO_DEEP`` in its place). Walked without recursion, whatever a hand-made Delivery holds."""
    if len(headers) > MAX_HEADERS:
        raise InvalidMessage(f"the message has {len(headers)} headers, over the limit of {MAX_HEADERS}")
    values, size = 0, 0
    waiting: list[object] = [headers]
    while waiting:
        value = waiting.pop()
        values += 1
        if values > MAX_HEADER_VALUES:
            raise InvalidMessage(f"the headers hold more than {MAX_HEADER_VALUES} values")
        if value == TOO_DEEP:
            raise InvalidMessage(f"a header nests deeper than {MAX_HEADER_DEPTH} tables or arrays")
        if isinstance(value, dict):
            size += sum(len(str(key)) for key in value)
            waiting.extend(value.values())
        elif isinstance(value, list | tuple):
            waiting.extend(value)
        elif isinstance(value, str | bytes | bytearray):
            size += len(value)
        else:
            size += 9  # a number, a timestamp, a decimal: at most a type byte and eight bytes
        if size > MAX_COMMAND_HEADER_BYTES:
            raise InvalidMessage(f"the headers are larger than {MAX_COMMAND_HEADER_BYTES} bytes")


def check_envelope(delivery: Delivery) -> str:
    """The headers, the message_id and the schema version; returns the message_id."""
    check_headers(delivery.headers)
    if not delivery.message_id:
        raise InvalidMessage("the message has no message_id")
    if not delivery.message_id.isprintable():
        # Control characters (NUL above all, which PostgreSQL text cannot hold) in an id are a forgery or a
        # bug, and an id is copied into logs and events.
        raise InvalidMessage("the message_id holds control characters")
    if len(delivery.message_id.encode()) > MAX_SHORT_STRING_BYTES:
        # Only a Delivery made by hand can get here: AMQP itself carries no longer id.
        raise InvalidMessage(f"the message_id is longer than {MAX_SHORT_STRING_BYTES} bytes")
    version = delivery.headers.get(SCHEMA_VERSION_HEADER)
    if version is None:
        raise UnsupportedSchemaVersion(f"the message has no {SCHEMA_VERSION_HEADER} header")
    if isinstance(version, bool) or not isinstance(version, int | str) or str(version) != str(SCHEMA_VERSION):
        raise UnsupportedSchemaVersion(f"{SCHEMA_VERSION_HEADER} {version!r} is not {SCHEMA_VERSION}")
    return delivery.message_id


def check_body_limits(body: bytes, max_bytes: int) -> None:
    """Size and nesting depth, checked on the raw bytes before anything parses the body."""
    if len(body) > max_bytes:
        raise InvalidMessage(f"the body is {len(body)} bytes, over this command's limit of {max_bytes}")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise InvalidMessage(f"the body nests deeper than {MAX_JSON_DEPTH} levels")


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in ``body``, counted without parsing it: strings are removed first
    (a bracket inside a string is text), then only brackets are kept. Linear in the body's size, with no
    recursion, whatever the body holds; a malformed body gives some number and the parser refuses it later."""
    skeleton = _JSON_STRING.sub(b"", body).translate(None, _NOT_A_BRACKET)
    if not skeleton:
        return 0
    return max(0, max(accumulate(_DEPTH_CHANGE[b] for b in skeleton)))


def parse_body(model: type[C], body: bytes) -> C:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        if any(err["loc"] and err["loc"][0] == "scope" for err in errors):
            raise InvalidScope("the scope is missing or malformed (app and tenant: [A-Za-z0-9_-]{1,64})") from exc
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidMessage(f"{where}: {first['msg']} ({len(errors)} problem(s))") from exc


def key_scope(command: Command, routing_key: str) -> Scope | None:
    """The scope ``routing_key`` names (None for the bare key); InvalidScope when it names none."""
    try:
        return command.scope_of_key(routing_key)
    except KeyScopeInvalid as exc:
        raise InvalidScope(str(exc)) from exc


def check_key_scope(command: Command, routing_key: str, body_scope: Scope) -> None:
    """A command keyed for one scope must act in that scope. The broker lets a confined host publish only
    its own scopes' keys; the body is the host's word, so a body naming another scope is a forgery (or a
    bug) and is ``forbidden``. The bare key carries no scope: only identities trusted with every scope can
    publish it, and their body's scope is taken as it is."""
    named = key_scope(command, routing_key)
    if named is not None and named != body_scope:
        raise Forbidden(
            f"the routing key names the scope {named.routing_suffix()} but the body acts in "
            f"{body_scope.routing_suffix()}"
        )


def readable_body(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, if it is one within the limits, for what a refusal can say about it
    (its scope, its run). Never raises: a refusal must be possible whatever the body holds. The parser
    used has a recursion limit of its own, and the depth is checked first anyway."""
    if len(body) > MAX_REPLY_BODY_BYTES or json_depth(body) > MAX_JSON_DEPTH:
        return None
    try:
        parsed = from_json(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def scope_hint(body: dict[str, Any] | None) -> tuple[str, str] | None:
    """The body's scope if it is readable at all, to route a rejection to the sender's scope."""
    scope = body.get("scope") if body is not None else None
    if isinstance(scope, dict):
        app, tenant = scope.get("app"), scope.get("tenant")
        if isinstance(app, str) and isinstance(tenant, str):
            return app, tenant
    return None
