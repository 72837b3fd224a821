"""A host's subscription loses no notice: an event is acknowledged only once its consumer is done with it
(asks for the next, or leaves cleanly), so one whose handler raised or whose process died is delivered
again; by default it reads a durable queue named after the user and scope, so what is published while no
subscriber is connected waits for the next one; ``exclusive=True`` is the throwaway listener that misses it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, TypeVar

import aiormq
import pytest
from aio_pika.abc import AbstractRobustConnection

from intermission.publishers.clients import BusClient, EventKind, HostClient, HostEvent, Received, Subscription
from intermission.publishers.relay import OutboxRelay
from intermission.schemas.commands import CancelCommand
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from tests.support.factories import PausedRun, paused_run
from tests.support.netproxy import net_proxy
from tests.support.waiting import eventually

if TYPE_CHECKING:
    from tests.support.amqp import Broker, ConnectionFactory, Vhost

E = TypeVar("E")
WITHIN = 15.0


class HandlerFailed(Exception):
    """What a host's handler raised."""


@pytest.fixture
async def relay(stores: Stores, amqp_url: str, amqp_connect: ConnectionFactory) -> AsyncIterator[OutboxRelay]:
    one = OutboxRelay(stores.db, await amqp_connect(amqp_url, "relay"))
    yield one
    await one.close()


async def next_of(events: Subscription[E]) -> Received[E]:
    async with asyncio.timeout(WITHIN):
        return await anext(events)


async def pause(stores: Stores, scope: Scope, relay: OutboxRelay) -> PausedRun:
    """A run paused, and its notice published."""
    paused = await paused_run(stores, scope)
    assert await relay.run_once() == 1
    return paused


async def ready_in(inspect: AbstractRobustConnection, name: str) -> int:
    """How many messages of the queue ``name`` wait for a consumer (delivered ones, acknowledged or not, are
    not among them), as the broker answers a passive declaration: its own count, at once."""
    channel = await inspect.channel()
    try:
        queue = await channel.declare_queue(name, passive=True)
        count = queue.declaration_result.message_count
        assert count is not None
        return count
    finally:
        await channel.close()


async def test_an_event_is_acknowledged_only_once_its_consumer_asks_for_the_next_or_leaves_cleanly(
    stores: Stores,
    scope: Scope,
    amqp_url: str,
    amqp_vhost: Vhost,
    rabbit: Broker,
    amqp_connect: ConnectionFactory,
    relay: OutboxRelay,
) -> None:
    host = HostClient(await amqp_connect(amqp_url, "host"), user_id="guest")
    inspect = await amqp_connect(amqp_url, "inspect")
    # prefetch=1: the broker hands over one unacknowledged event at a time, so what is left ready in the
    # queue tells whether the one handed out was acknowledged.
    async with host.subscribe(scope, {EventKind.NOTICE}, prefetch=1) as notices:
        first = await pause(stores, scope, relay)
        second = await pause(stores, scope, relay)
        assert (await next_of(notices)).event.run_id == first.run.id
        # Being handled, the first is NOT acknowledged, so the broker holds the second back.
        assert await ready_in(inspect, notices.queue_name) == 1
        assert (await next_of(notices)).event.run_id == second.run.id
        # Asking for the second acknowledged the first (else the second could not have come).
        assert await ready_in(inspect, notices.queue_name) == 0
    # Leaving cleanly acknowledged the second: the next subscription of the queue starts after it.
    async with host.subscribe(scope, {EventKind.NOTICE}) as again:
        marker = await pause(stores, scope, relay)
        after = await next_of(again)
    assert after.event.run_id == marker.run.id
    assert not after.redelivered
    await host.close()


async def test_an_event_whose_handler_raised_is_delivered_again(
    stores: Stores, scope: Scope, amqp_url: str, amqp_connect: ConnectionFactory, relay: OutboxRelay
) -> None:
    host = HostClient(await amqp_connect(amqp_url, "host"), user_id="guest")
    taken: list[Received[HostEvent]] = []

    async def consume_and_fail() -> None:
        async with host.subscribe(scope) as events:
            taken.append(await next_of(events))
            raise HandlerFailed

    async with host.subscribe(scope):
        # The queue exists from here on, so the notice below waits in it.
        pass
    paused = await pause(stores, scope, relay)
    with pytest.raises(HandlerFailed):
        await consume_and_fail()
    (first,) = taken
    assert not first.redelivered
    async with host.subscribe(scope) as events:
        again = await next_of(events)
    assert isinstance(again.event, Notice)
    assert again.event.run_id == paused.run.id
    assert again.message_id == first.message_id
    assert again.redelivered
    await host.close()


async def test_a_subscriber_that_dies_mid_handler_gets_the_event_again_and_what_was_published_while_it_was_gone(
    stores: Stores,
    scope: Scope,
    amqp_url: str,
    amqp_vhost: Vhost,
    rabbit: Broker,
    amqp_connect: ConnectionFactory,
    relay: OutboxRelay,
) -> None:
    async with net_proxy(amqp_url) as link:
        doomed_connection = await amqp_connect(link.url(amqp_url), "host that dies")
        doomed = HostClient(doomed_connection, user_id="guest")
        # Entered by hand and never left: a process that dies runs nothing more, not even its __aexit__.
        events = await doomed.subscribe(scope).__aenter__()
        name = events.queue_name
        held = await pause(stores, scope, relay)
        taken = await next_of(events)
        assert isinstance(taken.event, Notice)
        assert taken.event.run_id == held.run.id
        # The handler gets as far as sending its command (a round trip to the broker on the same
        # connection: anything written before it, an acknowledgement too, has reached the broker), then the
        # process dies: its TCP connection goes, with no AMQP goodbye.
        await doomed.cancel(CancelCommand(scope=scope, run_id=held.run.id))
        await link.close()

        inspect = await amqp_connect(amqp_url, "inspect")

        async def handed_back() -> bool:
            return await ready_in(inspect, name) == 1

        # The broker notices the dead connection and returns the unfinished event to the queue.
        await eventually(handed_back, within=WITHIN, what="the unacknowledged event back in the queue")
    with contextlib.suppress(aiormq.exceptions.AMQPError, ConnectionError):
        await doomed_connection.close()

    # While no subscriber is connected, more pauses are published: they wait in the durable queue.
    meanwhile = [await pause(stores, scope, relay) for _ in range(2)]
    assert await ready_in(inspect, name) == 3

    # The host, restarted: a new connection, the same default queue.
    restarted = HostClient(await amqp_connect(amqp_url, "host, restarted"), user_id="guest")
    async with restarted.subscribe(scope) as events:
        assert events.queue_name == name
        got = {r.message_id: r for r in [await next_of(events) for _ in range(3)]}
    # The one whose handler never finished, the same event under the same id, marked as delivered before.
    assert got[taken.message_id].redelivered
    assert {r.event.run_id for r in got.values() if isinstance(r.event, Notice)} == {
        held.run.id,
        *(p.run.id for p in meanwhile),
    }
    assert await ready_in(inspect, name) == 0
    await restarted.close()


async def test_an_exclusive_subscription_is_a_throwaway_listener_that_misses_what_it_was_not_there_for(
    stores: Stores, scope: Scope, amqp_url: str, amqp_connect: ConnectionFactory, relay: OutboxRelay
) -> None:
    host = HostClient(await amqp_connect(amqp_url, "host"), user_id="guest")
    async with host.subscribe(scope, exclusive=True) as events:
        name = events.queue_name
        first = await pause(stores, scope, relay)
        assert (await next_of(events)).event.run_id == first.run.id
    await pause(stores, scope, relay)  # nobody listening: gone for an exclusive listener
    inspect = await (await amqp_connect(amqp_url, "inspect")).channel()
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
        await inspect.declare_queue(name, passive=True)
    async with host.subscribe(scope, exclusive=True) as events:
        marker = await pause(stores, scope, relay)
        assert (await next_of(events)).event.run_id == marker.run.id
    await host.close()


async def test_default_queues_are_named_after_the_user_the_scope_and_what_they_hear(
    scope: Scope, other_scope: Scope, amqp_url: str, amqp_vhost: Vhost, rabbit: Broker, amqp_connect: ConnectionFactory
) -> None:
    host = HostClient(await amqp_connect(amqp_url, "host"), user_id="guest")
    async with (
        host.subscribe(scope) as everything,
        host.subscribe(scope, {EventKind.RUN, EventKind.NOTICE}) as some,
        host.subscribe(scope, durable_queue="billing-host") as named,
    ):
        assert everything.queue_name == "guest.acme.t1"
        assert some.queue_name == "guest.acme.t1.notice+run"
        assert named.queue_name == "billing-host"
    with pytest.raises(ValueError, match="not both"):
        host.subscribe(scope, durable_queue="billing-host", exclusive=True)
    await host.close()
    async with (
        await BusClient.connect(amqp_vhost.url(rabbit.bus)) as bus,
        bus.subscribe() as asks,
        bus.subscribe(other_scope) as one_scope,
    ):
        assert asks.queue_name == f"{rabbit.bus.name}.agent_reply"
        assert one_scope.queue_name == f"{rabbit.bus.name}.acme.t2.agent_reply"
