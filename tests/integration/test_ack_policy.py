"""The ack policy's transient path on the real broker: a passing failure is retried with backoff and then
applied once; a failure that outlasts the retries goes back to its queue, and the quorum queue's delivery
limit dead-letters a command that keeps failing.

The handler here fails on purpose (the database cannot be made to fail exactly N times on cue); what is
under test is what the policy and RabbitMQ do with such failures.
"""

from __future__ import annotations

import uuid

import aio_pika
from aio_pika.abc import AbstractRobustConnection

from intermission.consumers.handlers import CommandHandlers, WorkerHooks
from intermission.consumers.parsing import Delivery
from intermission.consumers.policy import AckPolicy
from intermission.consumers.rejection import Rejecter
from intermission.consumers.service import CommandConsumers
from intermission.schemas.errors import StoreUnavailable
from intermission.schemas.run import Lease
from intermission.store import Stores
from intermission.store.commands import Claimed, RunDefaults
from intermission.wire import COMMANDS_EXCHANGE, DEAD_EXCHANGE, SCHEMA_VERSION_HEADER, Command, declare
from tests.support.amqp import DELIVERY_LIMIT, CaptureFactory, ConnectionFactory
from tests.support.waiting import eventually


class FlakyHandlers(CommandHandlers):
    """Fails with a transient error the first ``failures`` times it is asked, then applies nothing."""

    def __init__(self, stores: Stores, failures: int) -> None:
        super().__init__(
            stores,
            WorkerHooks(
                lease=lambda: Lease(owner="w", ttl_seconds=5),
                defaults=RunDefaults(pause_ttl_seconds=0, max_steps=5),
                bus_user="bus",
            ),
        )
        self.failures = failures
        self.calls = 0

    async def apply(self, command: Command, delivery: Delivery, message_id: str) -> Claimed | None:
        self.calls += 1
        if self.calls <= self.failures:
            raise StoreUnavailable("the database went away")
        return None


async def consume_with(
    stores: Stores, connection: AbstractRobustConnection, handlers: FlakyHandlers, attempts: int
) -> CommandConsumers:
    channel = await connection.channel(publisher_confirms=True)
    await channel.set_qos(prefetch_count=1)
    topology = await declare(channel, delivery_limit=DELIVERY_LIMIT)
    policy = AckPolicy(handlers, Rejecter(topology.events, topology.dead), lambda _: None, attempts=attempts)
    consumers = CommandConsumers(policy, {Command.CANCEL: topology.queues[Command.CANCEL]})
    await consumers.start()
    return consumers


async def send_cancel(connection: AbstractRobustConnection) -> str:
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
    message_id = str(uuid.uuid4())
    await exchange.publish(
        aio_pika.Message(
            b'{"scope": {"app": "a", "tenant": "t"}, "run_id": "r1"}',
            message_id=message_id,
            headers={SCHEMA_VERSION_HEADER: 1},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ),
        routing_key=Command.CANCEL.value,
    )
    return message_id


async def test_a_passing_failure_is_retried_then_applied_once(
    stores: Stores, amqp_url: str, amqp_connect: ConnectionFactory, capture: CaptureFactory
) -> None:
    dead = await capture(amqp_url, DEAD_EXCHANGE, "")
    handlers = FlakyHandlers(stores, failures=2)
    connection = await amqp_connect(amqp_url, "policy")
    consumers = await consume_with(stores, connection, handlers, attempts=5)
    await send_cancel(connection)

    async def done() -> bool:
        return handlers.calls == 3 and consumers.in_flight == 0

    await eventually(done, what="the command applied after two transient failures")
    await consumers.stop(grace=5)
    assert handlers.calls == 3  # two failures retried within one delivery, then one success
    assert dead.messages == []


async def test_a_command_that_keeps_failing_is_dead_lettered_by_the_delivery_limit(
    stores: Stores, amqp_url: str, amqp_connect: ConnectionFactory, capture: CaptureFactory
) -> None:
    dead = await capture(amqp_url, DEAD_EXCHANGE, "")
    handlers = FlakyHandlers(stores, failures=10_000)
    connection = await amqp_connect(amqp_url, "policy")
    consumers = await consume_with(stores, connection, handlers, attempts=2)
    message_id = await send_cancel(connection)
    (letter,) = await dead.wait_count(1, within=60)
    await consumers.stop(grace=5)
    assert letter.message_id == message_id
    deaths = letter.headers["x-death"]
    assert deaths[0]["reason"] == "delivery_limit"  # the broker's limit, not a refusal of ours
    # Every delivery was retried (two attempts with backoff) before it went back to the queue, and the
    # broker gave up only after the limit.
    assert handlers.calls % 2 == 0
    assert handlers.calls // 2 >= DELIVERY_LIMIT, handlers.calls
