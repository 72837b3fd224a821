"""Operator tools behind ``intermission runs`` and ``intermission dead``.

``dead list`` reads the dead-letter queue without taking anything out of it (every message it fetched is
returned to the queue when it is done). ``dead replay`` republishes dead-lettered commands to their
original routing key (a bare one made scoped by the body's scope), with the refusal headers removed, waits
for the broker's confirm, and only then acknowledges the dead copy: a command is never in neither place.
Replaying keeps the ``message_id``, so a command whose effect did commit after all is acknowledged as a
duplicate, not applied twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from intermission.consumers.parsing import readable_body, scope_hint
from intermission.schemas.scope import Scope
from intermission.wire import (
    COMMANDS_EXCHANGE,
    DEAD_QUEUE,
    DETAIL_HEADER,
    ERROR_HEADER,
    ORIGINAL_KEY_HEADER,
    Command,
    replayed_command,
)


@dataclass(frozen=True)
class DeadLetter:
    message_id: str | None
    routing_key: str
    code: str
    detail: str
    size: int


def _original_key(message: AbstractIncomingMessage) -> str:
    headers = message.headers or {}
    key = headers.get(ORIGINAL_KEY_HEADER)
    if isinstance(key, str) and key:
        return key
    # Dead-lettered by the broker (the delivery limit): x-death names the routing keys it came with.
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        keys = deaths[0].get("routing-keys")
        if isinstance(keys, list) and keys and isinstance(keys[0], str):
            return keys[0]
    return message.routing_key or ""


def describe(message: AbstractIncomingMessage) -> DeadLetter:
    headers = message.headers or {}
    code = headers.get(ERROR_HEADER)
    detail = headers.get(DETAIL_HEADER)
    if code is None and "x-death" in headers:
        code, detail = "delivery_limit", "kept failing; dead-lettered by the queue's delivery limit"
    return DeadLetter(
        message_id=message.message_id,
        routing_key=_original_key(message),
        code=str(code or "unknown"),
        detail=str(detail or ""),
        size=len(message.body),
    )


async def _fetch_all(connection: AbstractRobustConnection, limit: int) -> tuple[Any, list[AbstractIncomingMessage]]:
    channel = await connection.channel(publisher_confirms=True)
    queue = await channel.get_queue(DEAD_QUEUE)
    fetched: list[AbstractIncomingMessage] = []
    while len(fetched) < limit:
        message = await queue.get(no_ack=False, fail=False)
        if message is None:
            break
        fetched.append(message)
    return channel, fetched


@dataclass(frozen=True)
class DeadStats:
    """How many messages ``intermission.dead`` holds, and how long ago the oldest was dead-lettered."""

    depth: int
    oldest_seconds: float | None


def dead_since(message: AbstractIncomingMessage) -> datetime | None:
    """When a message was dead-lettered: its refusal's timestamp (the consumer's dead copies carry one),
    else the broker's x-death time (a delivery limit); None when it says neither."""
    if message.timestamp is not None:
        return message.timestamp if message.timestamp.tzinfo else message.timestamp.replace(tzinfo=UTC)
    deaths = (message.headers or {}).get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        when = deaths[0].get("time")
        if isinstance(when, datetime):
            return when if when.tzinfo else when.replace(tzinfo=UTC)
    return None


async def dead_stats(connection: AbstractRobustConnection) -> DeadStats:
    """The dead-letter queue's depth and the age of its oldest message, which is looked at and put back
    (unacknowledged, returned when the channel closes): nothing is taken out."""
    channel = await connection.channel()
    try:
        queue = await channel.declare_queue(DEAD_QUEUE, passive=True)
        depth = queue.declaration_result.message_count or 0
        head = await queue.get(no_ack=False, fail=False) if depth else None
        since = dead_since(head) if head is not None else None
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
    oldest = (datetime.now(UTC) - since).total_seconds() if since is not None else None
    return DeadStats(depth=depth, oldest_seconds=oldest)


async def list_dead(connection: AbstractRobustConnection, limit: int = 100) -> list[DeadLetter]:
    """What is in the dead-letter queue (up to ``limit``), leaving it all there."""
    channel, fetched = await _fetch_all(connection, limit)
    try:
        return [describe(m) for m in fetched]
    finally:
        # Unacknowledged messages go back to the queue when their channel closes.
        with contextlib.suppress(Exception):
            await channel.close()


async def replay_dead(
    connection: AbstractRobustConnection,
    wanted: Callable[[DeadLetter], bool],
    limit: int = 1000,
    on_looked_at: Callable[[], None] = lambda: None,
) -> list[DeadLetter]:
    """Republish the dead-lettered commands ``wanted`` selects; returns what was replayed. ``on_looked_at``
    is called once per dead letter looked at, replayed or not (a progress bar)."""
    channel, fetched = await _fetch_all(connection, limit)
    replayed: list[DeadLetter] = []
    try:
        exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
        for message in fetched:
            on_looked_at()
            letter = describe(message)
            command = Command.of_key(letter.routing_key)
            if command is None or not wanted(letter):
                continue
            key = scoped_key(command, letter.routing_key, message.body)
            await exchange.publish(
                replayed_command(
                    message.body,
                    message.headers or {},
                    message_id=message.message_id,
                    correlation_id=message.correlation_id,
                    routing_key=key,
                    user_id=message.user_id if message.user_id == _connection_user(connection) else None,
                    content_type=message.content_type,
                ),
                routing_key=key,
            )
            # Confirmed: the command is back in its queue, so the dead copy may go.
            await message.ack()
            replayed.append(letter)
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
    return replayed


def scoped_key(command: Command, routing_key: str, body: bytes) -> str:
    """The key a replay publishes under: the original when it names a scope; for a command sent with the
    bare key (before scoped routing, or by a trusted identity), the key of its body's scope when the body
    names a valid one, so that every replayed command is keyed by scope; the bare key otherwise."""
    if routing_key != command.value:
        return routing_key
    hint = scope_hint(readable_body(body))
    if hint is None:
        return routing_key
    try:
        return command.key(Scope(app=hint[0], tenant=hint[1]))
    except ValueError:
        return routing_key


def _connection_user(connection: AbstractRobustConnection) -> str | None:
    # RabbitMQ refuses a user_id other than the publishing connection's own: a replay can keep a
    # sender's user_id only when the operator connects as that user.
    url = getattr(connection, "url", None)
    return getattr(url, "user", None)
