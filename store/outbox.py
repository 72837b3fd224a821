"""Outbox rows: the events a transition writes in its own transaction, for the relay to publish later.

A row's ``message_id`` is fixed when it is written, so every re-publication carries the same id and
subscribers can deduplicate. Where an event names something only the writing transaction knows (a pause's
id and deadline, a run's new revision), the event goes to the transition as everything else the caller
knows, and the transition adds those values itself (``store/migrations/0005_transitions.sql``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from intermission.schemas.events import RunEvent
from intermission.schemas.suspension import Notice
from intermission.tracing import headers_with_trace
from intermission.wire import SCHEMA_VERSION, SCHEMA_VERSION_HEADER, HeaderValue, notice_key, run_event_key

# What a pause's transaction adds to its Notice, and an end's to its run event.
NOTICE_FILLED_BY_THE_DATABASE = frozenset({"suspension_id", "run_revision", "expires_at", "checkpoint_id"})
RUN_EVENT_FILLED_BY_THE_DATABASE = frozenset({"revision"})


@dataclass(frozen=True)
class OutboxEvent:
    routing_key: str
    body: str
    correlation_id: str | None = None
    message_id: uuid.UUID = field(default_factory=uuid.uuid4)
    headers: dict[str, HeaderValue] = field(default_factory=lambda: {SCHEMA_VERSION_HEADER: SCHEMA_VERSION})

    def with_body(self, body: str) -> OutboxEvent:
        """This event with the body its transaction completed and wrote."""
        return OutboxEvent(self.routing_key, body, self.correlation_id, self.message_id, self.headers)

    def arguments(self, *, body: bool = True) -> dict[str, Any]:
        """The event as a transition's named ``event_*`` arguments (without its body when the transition
        takes the body as a document it completes)."""
        named: dict[str, Any] = {
            "event_message_id": self.message_id,
            "event_routing_key": self.routing_key,
            "event_correlation_id": self.correlation_id,
            "event_headers": json.dumps(self.headers),
        }
        if body:
            named["event_body"] = self.body
        return named


def written(arguments: Mapping[str, Any], body: str | None) -> OutboxEvent | None:
    """The event a transition wrote from its named ``event_*`` arguments (``OutboxEvent.arguments``) and the
    body it returns as written (None: it wrote none)."""
    if body is None:
        return None
    return OutboxEvent(
        routing_key=arguments["event_routing_key"],
        body=body,
        correlation_id=arguments["event_correlation_id"],
        message_id=arguments["event_message_id"],
        headers=json.loads(arguments["event_headers"]),
    )


def _headers(traceparent: str | None) -> dict[str, HeaderValue]:
    headers: dict[str, HeaderValue] = {SCHEMA_VERSION_HEADER: SCHEMA_VERSION}
    headers_with_trace(headers, traceparent)
    return headers


def notice_event(notice: Notice, correlation_id: str | None, *, traceparent: str | None = None) -> OutboxEvent:
    """A pause's Notice, its database-assigned fields left for the pause's transaction to fill in; with the
    pause's ``traceparent`` when it has one."""
    return OutboxEvent(
        routing_key=notice_key(notice.reason, notice.scope),
        body=notice.model_dump_json(exclude=set(NOTICE_FILLED_BY_THE_DATABASE)),
        correlation_id=correlation_id,
        headers=_headers(traceparent),
    )


def run_event(
    event: RunEvent, correlation_id: str | None, *, revision_known: bool = True, traceparent: str | None = None
) -> OutboxEvent:
    """A ``run.*`` event; with ``revision_known`` false its revision is left for the transaction; with the
    ``traceparent`` of the run's trace when it has one."""
    return OutboxEvent(
        routing_key=run_event_key(event.kind, event.scope),
        body=event.model_dump_json(exclude=None if revision_known else set(RUN_EVENT_FILLED_BY_THE_DATABASE)),
        correlation_id=correlation_id,
        headers=_headers(traceparent),
    )
