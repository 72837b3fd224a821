"""The harness's observer: EVERY event published on ``intermission.events`` and every message that reaches
``intermission.dead``, recorded from the very start for the checker.

The capture is a durable quorum queue bound to ``#``, declared before any worker starts, read over a robust
connection and acknowledged only once recorded: it keeps what is routed to it across a broker restart.
Deliveries are recorded as they come, duplicates included (the relay delivers at least once).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustConnection
from pydantic_core import from_json

from intermission.ops.dead import Source, describe
from intermission.publishers.amqp import connect
from intermission.wire import DEAD_QUEUE, EVENTS_EXCHANGE

CAPTURE_QUEUE = "soak.capture"
# Bodies above this are recorded by size only (the oversized commands' dead-lettered copies).
KEEP_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class Event:
    message_id: str | None
    routing_key: str
    correlation_id: str | None
    text: str
    body: dict[str, Any] | None
    arrived: float


@dataclass(frozen=True)
class DeadLetter:
    message_id: str | None
    correlation_id: str | None
    routing_key: str
    # x-intermission-error: set by the consumer's refusal; None for a broker dead-lettering (delivery limit).
    error: str | None
    death: str | None
    size: int
    run_id: str | None
    arrived: float


def _json(raw: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None. A parser with a recursion limit of its own: the soak sends bodies
    nested 5,000 deep, on which the standard library's parser raises RecursionError."""
    try:
        parsed = from_json(raw)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _body_run_id(body: dict[str, Any] | None) -> str | None:
    if body is None:
        return None
    version = body.get("version")
    found = version.get("run_id") if isinstance(version, dict) else body.get("run_id")
    return found if isinstance(found, str) else None


@dataclass
class Observer:
    url: str
    events: list[Event] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    # Indexes kept as events arrive (first delivery of each id counts once).
    seen_ids: set[str] = field(default_factory=set)
    rejected: dict[str, dict[str, Any]] = field(default_factory=dict)
    resumed_by: dict[str, int] = field(default_factory=dict)
    completed_at: list[float] = field(default_factory=list)
    # The message ids of every dead-lettered copy (the drain asks of each refused command).
    dead_ids: set[str] = field(default_factory=set)
    _connection: AbstractRobustConnection | None = None
    _channel: AbstractRobustChannel | None = None
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def start(self) -> None:
        self._connection = await connect(self.url, "soak observer", reconnect_interval=0.5)
        channel = self._connection.channel()
        await channel
        self._channel = channel
        await channel.set_qos(prefetch_count=512)
        capture = await channel.declare_queue(CAPTURE_QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
        await capture.bind(EVENTS_EXCHANGE, "#")
        await capture.consume(self._event)
        dead = await channel.declare_queue(DEAD_QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
        await dead.consume(self._dead)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def _event(self, message: AbstractIncomingMessage) -> None:
        raw = message.body
        body = _json(raw)
        event = Event(
            message_id=message.message_id,
            routing_key=message.routing_key or "",
            correlation_id=message.correlation_id,
            text=raw.decode("utf-8", errors="replace"),
            body=body,
            arrived=time.monotonic(),
        )
        self.events.append(event)
        first = event.message_id is None or event.message_id not in self.seen_ids
        if event.message_id is not None:
            self.seen_ids.add(event.message_id)
        if first and body is not None:
            key = event.routing_key
            if key.startswith("command.rejected."):
                mid = body.get("message_id")
                if isinstance(mid, str) and mid:
                    self.rejected[mid] = body
            elif key.startswith("run.resumed.") and event.correlation_id:
                self.resumed_by[event.correlation_id] = self.resumed_by.get(event.correlation_id, 0) + 1
            elif key.startswith("run.completed."):
                self.completed_at.append(event.arrived)
        await message.ack()
        async with self._changed:
            self._changed.notify_all()

    async def _dead(self, message: AbstractIncomingMessage) -> None:
        raw = message.body
        body = _json(raw) if len(raw) <= KEEP_BODY_BYTES else None
        # Read as the operators' tools read it (ops/dead.py): its key the broker's, its refusal the worker's
        # own or none, whatever headers the sender wrote; the checker holds the tools to what was sent.
        letter = describe(message)
        death = (message.headers or {}).get("x-death")
        self.dead.append(
            DeadLetter(
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                routing_key=letter.routing_key,
                error=letter.code if letter.source is Source.WORKER else None,
                death=str(death)[:300] if death is not None else None,
                size=len(raw),
                run_id=_body_run_id(body),
                arrived=time.monotonic(),
            )
        )
        if message.message_id:
            self.dead_ids.add(message.message_id)
        await message.ack()
        async with self._changed:
            self._changed.notify_all()

    async def wait(self, check: Callable[[], bool], within: float) -> bool:
        """Wait (woken by every arrival) until ``check()`` holds; False when ``within`` seconds passed first."""
        try:
            async with asyncio.timeout(within), self._changed:
                await self._changed.wait_for(check)
        except TimeoutError:
            return False
        return True

    def was_rejected(self, message_id: str) -> bool:
        return message_id in self.rejected

    def effect_seen(self, message_id: str) -> bool:
        return self.resumed_by.get(message_id, 0) > 0
