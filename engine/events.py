"""The one encoder of event bodies, and the outbox row an event is written as.

Every event a transition causes (a claim's ``run.resumed``, a pause's Notice, an end's ``run.*``) is built
here, from the contract's models, before its transition runs: the body is the model's JSON as pydantic
writes it, and the transition stores that text in the outbox exactly as given (migration 0016). So whether
a subscriber hears an event from the worker that committed it (handed over from memory, ``EventSink``) or
from a relay after that worker died (read back from its row), the body is the same bytes, and a TypeScript
or Go client parses one format: compact JSON, keys in the model's field order, timestamps as pydantic
writes them (``2026-12-04T17:37:32.123456Z``).

A row's ``message_id`` is fixed here too, so every publication of one event carries the same id and
subscribers can deduplicate.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from intermission.schemas.events import RunEvent
from intermission.schemas.suspension import Notice
from intermission.tracing import headers_with_trace
from intermission.wire import SCHEMA_VERSION, SCHEMA_VERSION_HEADER, HeaderValue, notice_key, run_event_key


def _schema_headers() -> dict[str, HeaderValue]:
    return {SCHEMA_VERSION_HEADER: SCHEMA_VERSION}


@dataclass(frozen=True)
class OutboxEvent:
    """One event as its outbox row holds it, and as it is published: key, body, ids and headers."""

    routing_key: str
    body: str
    correlation_id: str | None = None
    message_id: uuid.UUID = field(default_factory=uuid.uuid4)
    headers: dict[str, HeaderValue] = field(default_factory=_schema_headers)

    def columns(self) -> tuple[uuid.UUID, str, str, str | None, str]:
        """The event as a transition's ``event_*`` fields: message_id, routing_key, body, correlation_id,
        headers (JSON)."""
        return self.message_id, self.routing_key, self.body, self.correlation_id, json.dumps(self.headers)


def _headers(traceparent: str | None) -> dict[str, HeaderValue]:
    headers = _schema_headers()
    headers_with_trace(headers, traceparent)
    return headers


def notice_event(notice: Notice, correlation_id: str | None, *, traceparent: str | None = None) -> OutboxEvent:
    """A pause's Notice, whole; with the ``traceparent`` its pause recorded (the run's trace)."""
    return OutboxEvent(
        routing_key=notice_key(notice.reason, notice.scope),
        body=notice.model_dump_json(),
        correlation_id=correlation_id,
        headers=_headers(traceparent),
    )


def run_event(event: RunEvent, correlation_id: str | None, *, traceparent: str | None = None) -> OutboxEvent:
    """A ``run.*`` event, whole; with the ``traceparent`` of the run's trace when it has one."""
    return OutboxEvent(
        routing_key=run_event_key(event.kind, event.scope),
        body=event.model_dump_json(),
        correlation_id=correlation_id,
        headers=_headers(traceparent),
    )
