"""What an operator sends about one run, through the paths everything else uses: a ``run.cancel`` as a host
sends it (``publishers/clients.py``), the sweeper's own ``run.expire`` (``publishers/sweeper.py``), and a
Notice published again as the relay publishes its row (``publishers/relay.py``). Nothing here writes a row:
the workers apply the commands, exactly as they apply everybody's.

A command's outcome is heard, not read: the operator subscribes to the run's scope (an exclusive queue of
its own, gone with it) BEFORE publishing, and waits for the run's end or the command's refusal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from aio_pika.abc import AbstractRobustConnection

from intermission.publishers.amqp import ConfirmingPublisher, amqp_nodes
from intermission.publishers.clients import EventKind, HostClient
from intermission.publishers.relay import outbox_message
from intermission.publishers.sweeper import expire_message, expire_message_id
from intermission.schemas.commands import CancelCommand
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.store.across_scopes import ExpiredPause, OutboxRow
from intermission.store.runs import StoredEvent
from intermission.wire import COMMANDS_EXCHANGE, EVENTS_EXCHANGE, Command

# The events that say a run is over: what a cancel or an expiry waits for (a run.resumed comes first).
ENDS: Final = frozenset({RunEventKind.COMPLETED, RunEventKind.FAILED, RunEventKind.CANCELLED, RunEventKind.EXPIRED})


@dataclass(frozen=True)
class Outcome:
    """What became of a command: the run's end (``cancelled``, ``completed``, ``failed``, ``expired``), its
    refusal (``rejected``, with the code), or nothing heard in time (``timeout``)."""

    message_id: str
    outcome: str
    code: str | None = None
    detail: str = ""
    revision: int | None = None

    @property
    def heard(self) -> bool:
        return self.outcome != "timeout"


def user_of(amqp_url: str) -> str:
    """The user an AMQP URL logs in as: the ``user_id`` its messages may carry (RabbitMQ checks it)."""
    return amqp_nodes(amqp_url)[0].user or "guest"


async def send_and_wait(
    connection: AbstractRobustConnection,
    scope: Scope,
    run_id: str,
    send: Callable[[HostClient], Awaitable[str]],
    *,
    user_id: str,
    within: float,
    publish_timeout: float = 10.0,
) -> Outcome:
    """Subscribe to ``scope``'s run events and refusals, ``send`` a command (returning its message id), and
    wait up to ``within`` seconds for ``run_id``'s end or that command's refusal."""
    client = HostClient(connection, user_id=user_id, publish_timeout=publish_timeout)
    try:
        async with client.subscribe(scope, {EventKind.RUN, EventKind.REJECTED}, exclusive=True) as events:
            message_id = await send(client)
            try:
                async with asyncio.timeout(within):
                    async for received in events:
                        event = received.event
                        # The run by its key: another scope's run of that id is not this one.
                        if (
                            isinstance(event, RunEvent)
                            and event.run_id == run_id
                            and event.scope == scope
                            and event.kind in ENDS
                        ):
                            return Outcome(
                                message_id, event.kind.value, detail=event.error or "", revision=event.revision
                            )
                        if isinstance(event, CommandRejected) and event.message_id == message_id:
                            return Outcome(message_id, "rejected", code=event.code, detail=event.detail)
            except TimeoutError:
                pass
            return Outcome(message_id, "timeout")
    finally:
        await client.close()


def cancel(scope: Scope, run_id: str, reason: str) -> Callable[[HostClient], Awaitable[str]]:
    """A ``run.cancel`` as hosts send it, under a fresh message id."""

    async def send(client: HostClient) -> str:
        return await client.cancel(CancelCommand(scope=scope, run_id=run_id, reason=reason))

    return send


def expire(pause: ExpiredPause) -> Callable[[HostClient], Awaitable[str]]:
    """The sweeper's ``run.expire`` for ``pause``, byte for byte (the same deterministic message id), with
    publisher confirms and ``mandatory`` as the sweeper publishes it."""

    async def send(client: HostClient) -> str:
        publisher = ConfirmingPublisher(client.connection, COMMANDS_EXCHANGE, mandatory=True)
        try:
            await publisher.publish(expire_message(pause), Command.EXPIRE.key(pause.scope))
        finally:
            await publisher.close()
        return expire_message_id(pause)

    return send


async def republish(connection: AbstractRobustConnection, event: StoredEvent, *, confirm_seconds: float = 10.0) -> None:
    """Publish a stored event again exactly as the relay publishes its row: its message id, key, body,
    correlation id and headers, with publisher confirms. PublishFailed when the broker did not confirm."""
    publisher = ConfirmingPublisher(connection, EVENTS_EXCHANGE, mandatory=False, timeout=confirm_seconds)
    try:
        row = OutboxRow(
            id=event.id,
            message_id=event.message_id,
            routing_key=event.routing_key,
            body=event.body,
            correlation_id=event.correlation_id,
            headers=dict(event.headers),
        )
        await publisher.publish(outbox_message(row), row.routing_key)
    finally:
        await publisher.close()
