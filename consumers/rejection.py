"""Refusing a command: a ``command.rejected`` event for the sender, and a dead-lettered copy with its
reason in ``x-intermission-error``. Both are published with confirms BEFORE the original is acknowledged,
so a refused command is never lost: it is either in the dead-letter queue or still in its own queue."""

from __future__ import annotations

import asyncio
import json

from aio_pika.abc import AbstractExchange
from pydantic import ValidationError

from intermission.consumers.parsing import Delivery, scope_hint
from intermission.schemas.errors import IntermissionError
from intermission.schemas.events import CommandRejected
from intermission.schemas.scope import Scope
from intermission.wire import dead_copy, rejected_key, rejection_message


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
        copy = dead_copy(
            delivery.body,
            delivery.headers,
            message_id=delivery.message_id,
            correlation_id=delivery.correlation_id,
            routing_key=delivery.routing_key,
            code=error.code,
            detail=error.detail,
        )
        await asyncio.gather(
            self.events.publish(rejection_message(rejection), routing_key=rejected_key(scope)),
            self.dead.publish(copy, routing_key=delivery.routing_key),
        )
        return rejection
