"""Outbox rows: events written in the same transaction as the change that caused them.

The relay (``publishers/``) publishes them later with confirms; a row's ``message_id`` is fixed when it is
written, so every re-publication carries the same id and subscribers can deduplicate.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from intermission.schemas.events import RunEvent
from intermission.schemas.suspension import Notice
from intermission.store.db import Conn
from intermission.wire import SCHEMA_VERSION, SCHEMA_VERSION_HEADER, notice_key, run_event_key


@dataclass(frozen=True)
class OutboxEvent:
    routing_key: str
    body: str
    app: str
    tenant: str
    run_id: str | None
    correlation_id: str | None = None
    message_id: uuid.UUID = field(default_factory=uuid.uuid4)
    headers: dict[str, str | int] = field(default_factory=lambda: {SCHEMA_VERSION_HEADER: SCHEMA_VERSION})


def notice_event(notice: Notice, correlation_id: str | None) -> OutboxEvent:
    return OutboxEvent(
        routing_key=notice_key(notice.reason, notice.scope),
        body=notice.model_dump_json(),
        app=notice.scope.app,
        tenant=notice.scope.tenant,
        run_id=notice.run_id,
        correlation_id=correlation_id,
    )


def run_event(event: RunEvent, correlation_id: str | None) -> OutboxEvent:
    return OutboxEvent(
        routing_key=run_event_key(event.kind, event.scope),
        body=event.model_dump_json(),
        app=event.scope.app,
        tenant=event.scope.tenant,
        run_id=event.run_id,
        correlation_id=correlation_id,
    )


def columns(event: OutboxEvent) -> tuple[uuid.UUID, str, str, str | None, str]:
    """(message_id, routing_key, body, correlation_id, headers) for a statement that inserts the row itself
    (its scope and run come from the row it changes)."""
    return event.message_id, event.routing_key, event.body, event.correlation_id, json.dumps(event.headers)


async def write(con: Conn, event: OutboxEvent) -> None:
    await con.execute(
        "insert_outbox",
        event.message_id,
        event.routing_key,
        event.body,
        event.correlation_id,
        json.dumps(event.headers),
        event.app,
        event.tenant,
        event.run_id,
    )
