"""Refusing a command: a ``command.rejected`` event for the sender, and a dead-lettered copy with its
reason in ``x-intermission-error``. Both are published with confirms BEFORE the original is acknowledged,
so a refused command is never lost: it is either in the dead-letter queue or still in its own queue."""

from __future__ import annotations

import asyncio
import json

import aio_pika
from aio_pika.abc import AbstractExchange
from pydantic import ValidationError

from intermission.consumers.parsing import Delivery, scope_hint
from intermission.schemas.errors import IntermissionError
from intermission.schemas.events import CommandRejected
from intermission.schemas.names import ERROR_HEADER, SCHEMA_VERSION, SCHEMA_VERSION_HEADER, rejected_key
from intermission.schemas.scope import Scope

DETAIL_HEADER = "x-intermission-detail"
ORIGINAL_KEY_HEADER = "x-intermission-routing-key"


def _scope(delivery: Delivery) -> Scope | None:
    hint = scope_hint(delivery.body)
    if hint is None:
        return None
    try:
        return Scope(app=hint[0], tenant=hint[1])
    except ValidationError:
        return None


def _run_id(delivery: Delivery) -> str | None:
    try:
        body = json.loads(delivery.body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    version = body.get("version")
    candidate = version.get("run_id") if isinstance(version, dict) else body.get("run_id")
    return candidate if isinstance(candidate, str) and len(candidate) <= 128 else None


class Rejecter:
    def __init__(self, events: AbstractExchange, dead: AbstractExchange) -> None:
        self.events = events
        self.dead = dead

    async def reject(self, delivery: Delivery, error: IntermissionError) -> CommandRejected:
        scope = _scope(delivery)
        rejection = CommandRejected(
            message_id=delivery.message_id or "",
            routing_key=delivery.routing_key,
            code=error.code,
            detail=error.detail,
            scope=scope,
            run_id=_run_id(delivery),
        )
        event = aio_pika.Message(
            rejection.model_dump_json().encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            # Stable per refused message, so a refusal repeated after a redelivery deduplicates.
            message_id=f"rejected:{delivery.message_id}" if delivery.message_id else None,
            correlation_id=delivery.message_id,
            type=rejected_key(scope),
            headers={SCHEMA_VERSION_HEADER: SCHEMA_VERSION},
        )
        copy = aio_pika.Message(
            delivery.body,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=delivery.message_id,
            correlation_id=delivery.correlation_id,
            type=delivery.routing_key,
            headers={
                **{k: v for k, v in delivery.headers.items() if isinstance(k, str)},
                ERROR_HEADER: error.code,
                DETAIL_HEADER: error.detail[:1000],
                ORIGINAL_KEY_HEADER: delivery.routing_key,
            },
        )
        await asyncio.gather(
            self.events.publish(event, routing_key=rejected_key(scope)),
            self.dead.publish(copy, routing_key=delivery.routing_key),
        )
        return rejection
