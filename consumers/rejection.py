"""Refusing a command: a ``command.rejected`` event for the sender, and a dead-lettered copy with its
reason in ``x-intermission-error``. Both are published with confirms BEFORE the original is acknowledged,
so a refused command is never lost: it is either in the dead-letter queue or still in its own queue.

Whatever the refused message holds, building the refusal must not fail: what it says about the body (its
scope, its run) is read with a parser that cannot recurse without bound and is left out when unreadable,
the ids derived from its message_id always fit the wire (``intermission/wire.py``), and its headers are
copied in a form the wire can carry again.
"""

from __future__ import annotations

import re
from typing import Any

from aio_pika.abc import AbstractExchange
from pydantic import ValidationError

from intermission.consumers.parsing import Delivery, readable_body, scope_hint
from intermission.schemas.errors import IntermissionError
from intermission.schemas.events import CommandRejected
from intermission.schemas.ids import RUN_ID_PATTERN
from intermission.schemas.scope import Scope
from intermission.tracing import current_traceparent
from intermission.wire import Command, dead_copy, rejected_key, rejection_message, scope_of_command_key

_RUN_ID = re.compile(RUN_ID_PATTERN)


def _scope(body: dict[str, Any] | None) -> Scope | None:
    hint = scope_hint(body)
    if hint is None:
        return None
    try:
        return Scope(app=hint[0], tenant=hint[1])
    except ValidationError:
        return None


def _refusal_scope(routing_key: str, body: dict[str, Any] | None) -> Scope | None:
    """Whose stream hears a refusal: the scope the routing key names, which the broker vouches for, and
    never the scope a body merely claims (a host keyed for its own scope must not be able to send refusals,
    with their run ids and details, into another tenant's stream). A bare key was published by an identity
    trusted with every scope, so its body's scope is the sender's; a key that names no valid scope is
    nobody's."""
    if routing_key in set(Command):
        return _scope(body)
    return scope_of_command_key(routing_key)


def _run_id(body: dict[str, Any] | None) -> str | None:
    if body is None:
        return None
    version = body.get("version")
    candidate = version.get("run_id") if isinstance(version, dict) else body.get("run_id")
    return candidate if isinstance(candidate, str) and _RUN_ID.fullmatch(candidate) else None


class Rejecter:
    def __init__(self, events: AbstractExchange, dead: AbstractExchange, *, timeout: float = 10.0) -> None:
        self.events = events
        self.dead = dead
        # A confirm that never comes must not hold the delivery for ever: it is retried as an outage is.
        self.timeout = timeout

    async def reject(self, delivery: Delivery, error: IntermissionError) -> CommandRejected:
        body = readable_body(delivery.body)
        scope = _refusal_scope(delivery.routing_key, body)
        rejection = CommandRejected(
            message_id=delivery.message_id or "",
            routing_key=delivery.routing_key,
            code=error.code,
            detail=error.detail,
            scope=scope,
            run_id=_run_id(body),
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
        # The copy first: the sender hears of a refusal only once the refused command is kept, and a copy the
        # broker would not take (retried by the caller) announces nothing yet.
        await self.dead.publish(copy, routing_key=delivery.routing_key, timeout=self.timeout)
        # In the refused command's trace: its span is current here.
        refused = rejection_message(rejection, traceparent=current_traceparent())
        await self.events.publish(refused, routing_key=rejected_key(scope), timeout=self.timeout)
        return rejection
