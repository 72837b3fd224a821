"""The ack policy's transient path on the real broker: a passing failure is retried with backoff, holding
the delivery, and then applied once; while it lasts no other command is attempted; a failure that outlasts
the retry window goes back to its queue, and the quorum queue's delivery limit dead-letters a command that
keeps failing.

The handler here fails on purpose (the database cannot be made to fail exactly N times on cue); what is
under test is what the policy and RabbitMQ do with such failures.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
from aio_pika.abc import AbstractRobustConnection

from intermission.consumers.handlers import CommandHandlers
from intermission.consumers.policy import AckPolicy
from intermission.consumers.rejection import Rejecter
from intermission.consumers.service import CommandConsumers
from intermission.engine.commands import Claimed
from intermission.engine.core import Engine
from intermission.engine.transition import Applicable
from intermission.schemas.errors import NotSuspended, StoreUnavailable
from intermission.schemas.run import Lease
from intermission.store import Stores
from intermission.wire import COMMANDS_EXCHANGE, DEAD_EXCHANGE, SCHEMA_VERSION_HEADER, Command, declare
from tests.support.amqp import DELIVERY_LIMIT, CaptureFactory, ConnectionFactory
from tests.support.waiting import eventually


class FlakyHandlers(CommandHandlers):
    """Fails with a transient error the first ``failures`` times it is asked (or, with ``until``, until that
    event is set), then applies nothing. Records the message ids it was asked to apply, in order."""

    def __init__(
        self, stores: Stores, failures: int, until: asyncio.Event | None = None, then_refuse: str | None = None
    ) -> None:
        super().__init__(Engine.over(stores, lease=Lease(owner="w", ttl_seconds=5)), bus_user="bus")
        self.failures = failures
        self.until = until
        # The message that, once the outage is over, is refused (the database answered it with a refusal).
        self.then_refuse = then_refuse
        self.calls = 0
        self.asked: list[str] = []

    async def apply(self, command: Command, operation: Applicable[Claimed | None]) -> Claimed | None:
        receipt = getattr(operation, "receipt", None)
        assert receipt is not None  # every command's operation carries its delivery's receipt
        message_id = receipt.message_id
        self.calls += 1
        self.asked.append(message_id)
        if self.until is not None and not self.until.is_set():
            raise StoreUnavailable("the database went away")
        if message_id == self.then_refuse:
            raise NotSuspended("answered while the database was away: nothing to claim")
        if self.calls <= self.failures:
            raise StoreUnavailable("the database went away")
        return None


class Nowhere:
    """Where claimed runs go in these tests: nowhere (the handlers claim none)."""

    def submit(self, claimed: Claimed) -> None:
        raise AssertionError(f"no run is claimed here, but {claimed.run.id} was")


async def consume_with(
    stores: Stores,
    connection: AbstractRobustConnection,
    handlers: FlakyHandlers,
    retry_seconds: float,
    *,
    prefetch: int = 1,
) -> CommandConsumers:
    channel = await connection.channel(publisher_confirms=True)
    await channel.set_qos(prefetch_count=prefetch)
    topology = await declare(channel, delivery_limit=DELIVERY_LIMIT)
    policy = AckPolicy(
        handlers,
        Rejecter(topology.events, topology.dead),
        Nowhere(),
        retry_seconds=retry_seconds,
        max_backoff_seconds=0.2,
    )
    consumers = CommandConsumers(policy, {Command.CANCEL: topology.queues[Command.CANCEL]})
    await consumers.start()
    return consumers


async def send_cancel(connection: AbstractRobustConnection, message_id: str | None = None) -> str:
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
    message_id = message_id or str(uuid.uuid4())
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
    consumers = await consume_with(stores, connection, handlers, retry_seconds=30)
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
    consumers = await consume_with(stores, connection, handlers, retry_seconds=0.3)
    message_id = await send_cancel(connection)
    (letter,) = await dead.wait_count(1, within=60)
    await consumers.stop(grace=5)
    assert letter.message_id == message_id
    deaths = letter.headers["x-death"]
    assert deaths[0]["reason"] == "delivery_limit"  # the broker's limit, not a refusal of ours
    # Each delivery was retried within its window before it went back to the queue, and the broker gave up
    # only after the limit.
    assert handlers.calls > DELIVERY_LIMIT, handlers.calls


async def test_an_outage_holds_the_delivery_and_starts_no_other_command_until_it_is_over(
    stores: Stores, amqp_url: str, amqp_connect: ConnectionFactory, capture: CaptureFactory
) -> None:
    dead = await capture(amqp_url, DEAD_EXCHANGE, "")
    over = asyncio.Event()
    handlers = FlakyHandlers(stores, failures=0, until=over)
    connection = await amqp_connect(amqp_url, "policy")
    consumers = await consume_with(stores, connection, handlers, retry_seconds=60, prefetch=4)
    first = await send_cancel(connection)

    async def failing_for_a_while() -> bool:
        return handlers.calls >= 5

    await eventually(failing_for_a_while, what="the first command retried during the outage")
    later = [await send_cancel(connection) for _ in range(3)]

    async def later_ones_delivered() -> bool:
        return consumers.in_flight == 4

    await eventually(later_ones_delivered, what="the later commands delivered to the worker")
    calls_during = handlers.calls
    await eventually(lambda: asyncio.sleep(0, result=handlers.calls >= calls_during + 3), what="more retries")
    # While the database is away, only the held command is retried; the others wait untried.
    assert set(handlers.asked) == {first}
    over.set()

    async def all_applied() -> bool:
        return consumers.in_flight == 0 and set(handlers.asked) == {first, *later}

    await eventually(all_applied, what="every command applied once the outage ended")
    await consumers.stop(grace=5)
    # Each later command needed one attempt; nothing was dead-lettered or requeued.
    assert [handlers.asked.count(m) for m in later] == [1, 1, 1]
    assert dead.messages == []


async def test_commands_waiting_out_an_outage_go_as_soon_as_the_database_answers_even_with_a_refusal(
    stores: Stores, amqp_url: str, amqp_connect: ConnectionFactory, capture: CaptureFactory
) -> None:
    over = asyncio.Event()
    connection = await amqp_connect(amqp_url, "policy")
    first_id = f"first-{uuid.uuid4()}"
    handlers = FlakyHandlers(stores, failures=0, until=over, then_refuse=first_id)
    # A retry window far longer than the waits below: a command that waited for the window to pass would
    # fail this test.
    consumers = await consume_with(stores, connection, handlers, retry_seconds=600, prefetch=4)
    await send_cancel(connection, message_id=first_id)

    async def probing() -> bool:
        return handlers.calls >= 3

    await eventually(probing, what="the first command retried during the outage")
    later = [await send_cancel(connection) for _ in range(3)]

    async def waiting() -> bool:
        return consumers.in_flight == 4

    await eventually(waiting, what="the later commands waiting")
    over.set()

    async def all_applied() -> bool:
        return consumers.in_flight == 0 and set(handlers.asked) >= set(later)

    await eventually(all_applied, within=20, what="the waiting commands applied once the database answered")
    await consumers.stop(grace=5)
