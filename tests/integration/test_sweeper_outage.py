"""A sweeper whose first expiry falls inside a RabbitMQ outage backs off and publishes it once the broker is
back, instead of dying. Found by the soak (bench/soak): its publisher opens a channel on first use, and on a
robust connection that is reconnecting aio-pika refuses with a bare RuntimeError ("Connection was not
opened"), which no retry loop treats as transient, so `intermission sweeper` exited."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import asyncpg
import pytest

from intermission.publishers.amqp import TRANSIENT_AMQP_ERRORS, ConfirmingPublisher
from intermission.publishers.sweeper import ExpirySweeper
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.wire import COMMANDS_EXCHANGE, Command
from intermission.wire import message as json_message
from tests.support.factories import paused_run
from tests.support.waiting import eventually

if TYPE_CHECKING:
    from tests.support.amqp import Broker, CaptureFactory, ConnectionFactory

TINY_TTL = 0.001
STOP_WITHIN = 10.0


async def _passed(database_url: str, run_id: str) -> bool:
    con = await asyncpg.connect(database_url)
    try:
        return bool(await con.fetchval("SELECT expires_at <= now() FROM suspensions WHERE run_id = $1", run_id))
    finally:
        await con.close()


async def test_a_sweeper_that_first_publishes_during_a_broker_outage_backs_off_and_publishes_after_it(
    stores: Stores,
    database_url: str,
    scope: Scope,
    rabbit: Broker,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
) -> None:
    seen = await capture(amqp_url, COMMANDS_EXCHANGE, Command.EXPIRE.binding)
    sweeper = ExpirySweeper(
        stores.db,
        await amqp_connect(amqp_url, "sweeper"),
        interval_seconds=0.2,
        publish_timeout=1.0,
        max_backoff_seconds=0.5,
    )
    stop = asyncio.Event()
    # Nothing has expired yet: the sweeper has published nothing, so its channel is not open yet.
    serving = asyncio.create_task(sweeper.serve(stop))
    try:
        await eventually(lambda: _swept(sweeper), what="a first, empty sweep")
        async with rabbit.stopped():
            expired = await paused_run(stores, scope, ttl_seconds=TINY_TTL)
            await eventually(lambda: _passed(database_url, expired.run.id), what="the deadline to pass")

            async def backing_off() -> bool:
                if serving.done():
                    raise AssertionError(f"the sweeper died: {serving.exception()!r}")
                return sweeper.failures >= 1

            await eventually(backing_off, what="a sweep that failed while the broker was away")
        await seen.wait_ids({f"expire:{expired.run.id}:{expired.suspension.id}"}, within=30.0)
        assert not serving.done()
    finally:
        stop.set()
        async with asyncio.timeout(STOP_WITHIN):
            await serving
        await sweeper.close()


async def test_a_publisher_that_opens_its_channel_during_an_outage_fails_transiently(
    rabbit: Broker, amqp_url: str, amqp_connect: ConnectionFactory
) -> None:
    publisher = ConfirmingPublisher(await amqp_connect(amqp_url, "publisher"), COMMANDS_EXCHANGE, mandatory=True)
    try:
        async with rabbit.stopped():
            with pytest.raises(TRANSIENT_AMQP_ERRORS):
                await publisher.publish(json_message(b"{}", message_id="m", routing_key="run.expire"), "run.expire")
    finally:
        await publisher.close()


async def _swept(sweeper: ExpirySweeper) -> bool:
    return sweeper.sweeps >= 1
