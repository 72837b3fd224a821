"""The dead-letter queue's figures: how many letters ``intermission.dead`` holds and how old its oldest is.

The sweeper's metrics read them every prune interval (``fleet/pruning.py``) and ``doctor`` and the dead-letter
tools show them; reading them takes nothing out of the queue.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from intermission.wire import DEAD_QUEUE


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
