"""The RabbitMQ topology of DESIGN.md section 5, declared idempotently at start.

Declarations are made on robust objects, so aio-pika replays them after a reconnect.

- ``intermission.commands`` (direct) routes each command to its quorum queue. Every queue dead-letters
  to ``intermission.dead`` (fanout, into the quorum queue ``intermission.dead``) at least once, and has a
  delivery limit, so a command that keeps failing ends there instead of looping forever.
- ``intermission.events`` (topic) carries notices and run events to hosts and the bus.

A command refused for a permanent reason is not rejected into the dead-letter exchange: the consumer
publishes a copy to ``intermission.dead`` itself, with the error code in ``x-intermission-error`` (a
broker dead-lettering cannot add a header), and acknowledges the original once that copy is confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

from intermission.schemas.names import (
    COMMAND_QUEUES,
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_QUEUE,
    EVENTS_EXCHANGE,
    Command,
)


@dataclass(frozen=True)
class Topology:
    commands: AbstractExchange
    events: AbstractExchange
    dead: AbstractExchange
    dead_queue: AbstractQueue
    queues: dict[Command, AbstractQueue]


def command_queue_arguments(delivery_limit: int) -> dict[str, Any]:
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DEAD_EXCHANGE,
        # At-least-once dead-lettering: a dead-lettered command is never dropped on the way.
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
        "x-delivery-limit": delivery_limit,
    }


async def declare(channel: AbstractChannel, *, delivery_limit: int) -> Topology:
    commands = await channel.declare_exchange(COMMANDS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True)
    events = await channel.declare_exchange(EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
    dead = await channel.declare_exchange(DEAD_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    dead_queue = await channel.declare_queue(DEAD_QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
    await dead_queue.bind(dead)
    queues: dict[Command, AbstractQueue] = {}
    for command, name in COMMAND_QUEUES.items():
        queue = await channel.declare_queue(name, durable=True, arguments=command_queue_arguments(delivery_limit))
        await queue.bind(commands, routing_key=command.value)
        queues[command] = queue
    return Topology(commands=commands, events=events, dead=dead, dead_queue=dead_queue, queues=queues)
