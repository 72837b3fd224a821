"""The broker's own floor for the unloaded resume: what two quorum-queue hops cost, with nothing else.

An unloaded resume crosses RabbitMQ twice whatever a worker does: the host's ``run.resume`` goes into a
quorum command queue, and the ``run.completed`` it waits for into the host's own durable (quorum)
subscription queue. Each hop is a Raft commit with its WAL sync before the message is delivered. This
measures exactly that, one message at a time: the driver publishes into a quorum queue, a consumer on a
second connection republishes what it receives (with a confirm, as the worker does) into a second quorum
queue, and the driver times the publication to the arrival. ``bench.resume`` prints it beside the unloaded
latency, so that a latency target is read against what the broker alone costs on this machine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

FIRST: Final = "bench.floor.first"
SECOND: Final = "bench.floor.second"
BODY: Final = b"x" * 200


async def quorum_round_trips(url: str, samples: int, warmup: int = 5) -> list[float]:
    """Seconds from each publication into the first queue to its arrival from the second, ``samples`` of
    them after ``warmup``, one message at a time with a quiet moment between (as the unloaded phase)."""
    driver = await aio_pika.connect(url, client_properties={"connection_name": "bench floor driver"})
    relay = await aio_pika.connect(url, client_properties={"connection_name": "bench floor relay"})
    try:
        channel = await driver.channel(publisher_confirms=True)
        first = await channel.declare_queue(FIRST, durable=True, arguments={"x-queue-type": "quorum"})
        second = await channel.declare_queue(SECOND, durable=True, arguments={"x-queue-type": "quorum"})
        relay_channel = await relay.channel(publisher_confirms=True)
        onward = relay_channel.default_exchange

        async def forward(message: AbstractIncomingMessage) -> None:
            await onward.publish(aio_pika.Message(message.body), routing_key=SECOND)
            await message.ack()

        await (await relay_channel.get_queue(FIRST)).consume(forward)
        arrived: asyncio.Queue[float] = asyncio.Queue()

        async def back(message: AbstractIncomingMessage) -> None:
            await message.ack()
            arrived.put_nowait(time.perf_counter())

        await second.consume(back)
        timings: list[float] = []
        for i in range(warmup + samples):
            await asyncio.sleep(0.02)
            sent = time.perf_counter()
            await channel.default_exchange.publish(aio_pika.Message(BODY), routing_key=FIRST)
            async with asyncio.timeout(30):
                landed = await arrived.get()
            if i >= warmup:
                timings.append(landed - sent)
        await first.purge()
        return timings
    finally:
        await relay.close()
        await driver.close()
