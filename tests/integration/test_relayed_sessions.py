"""A process that runs a relay wakes it in-process and notifies nobody; everybody else still notifies.

Before migration 0004 every commit that added outbox rows sent a NOTIFY that woke the relay of EVERY
worker; now a worker's own commits wake only its own relay (the engine hands them to it: engine/sink.py),
and rows written elsewhere (a host using the store, the CLI) still wake the fleet at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import asyncpg
import pytest

from intermission.engine.core import Engine
from intermission.engine.events import OutboxEvent
from intermission.publishers.relay import OutboxRelay
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.wire import EVENTS_EXCHANGE
from tests.support.factories import paused_run
from tests.support.outbox import ended_run_event

if TYPE_CHECKING:
    from tests.support.amqp import CaptureFactory, ConnectionFactory

CHANNEL = "intermission_outbox"


class Woken:
    """An event sink that only records, under a name, that a commit wrote events (and holds no row)."""

    def __init__(self, woken: list[str], name: str) -> None:
        self.woken = woken
        self.name = name

    @property
    def hold_seconds(self) -> float | None:
        return None

    def committed(self, events: Sequence[OutboxEvent]) -> None:
        self.woken.append(self.name)


WITHIN = 15.0


class Notifications:
    """Every notification on the outbox channel, and a sentinel to wait for: notifications arrive in
    commit order, so whatever a commit notified has arrived by the time a later sentinel does."""

    def __init__(self, con: asyncpg.Connection) -> None:
        self.con = con
        self.payloads: list[str] = []
        # Where the notifications after the last sentinel begin.
        self._mark = 0
        self._arrived = asyncio.Condition()

    def received(self, _con: object, _pid: int, _channel: str, payload: object) -> None:
        self.payloads.append(str(payload))
        asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        async with self._arrived:
            self._arrived.notify_all()

    async def since_last_sentinel(self) -> list[str]:
        """The notifications that arrived before a new sentinel, after the previous one (or the start)."""
        sentinel = f"sentinel-{uuid.uuid4().hex}"
        await self.con.execute("SELECT pg_notify($1, $2)", CHANNEL, sentinel)
        async with asyncio.timeout(WITHIN), self._arrived:
            await self._arrived.wait_for(lambda: sentinel in self.payloads)
        end = self.payloads.index(sentinel)
        between, self._mark = self.payloads[self._mark : end], end + 1
        return between


@pytest.fixture
async def notifications(database_url: str) -> AsyncIterator[Notifications]:
    con = await asyncpg.connect(database_url)
    heard = Notifications(con)
    await con.add_listener(CHANNEL, heard.received)
    try:
        yield heard
    finally:
        await con.close()


async def test_a_relayed_process_commits_outbox_rows_without_notifying_and_wakes_its_own_relay(
    database_url: str, scope: Scope, notifications: Notifications
) -> None:
    relayed = await Stores.connect(database_url, max_size=2, relayed=True)
    plain = await Stores.connect(database_url, max_size=2)
    woken: list[str] = []
    relayed_engine, plain_engine = Engine.over(relayed), Engine.over(plain)
    stop_waking = relayed_engine.hand_events_to(Woken(woken, "relayed"))
    plain_engine.hand_events_to(Woken(woken, "plain"))
    try:
        await ended_run_event(relayed, scope, relayed_engine)
        assert await notifications.since_last_sentinel() == []
        # Its start wrote no event; its end did.
        assert woken == ["relayed"]

        # A transaction that adds no outbox row wakes nobody.
        async with relayed.db.transaction() as con:
            await con.fetchval("database_now")
        assert woken == ["relayed"]

        # A process without a relay of its own still wakes every relay through the database.
        await ended_run_event(plain, scope, plain_engine)
        assert await notifications.since_last_sentinel() == [""]
        assert woken == ["relayed", "plain"]

        stop_waking()
        await ended_run_event(relayed, scope, relayed_engine)
        assert woken == ["relayed", "plain"]
        assert await notifications.since_last_sentinel() == []
    finally:
        await relayed.close()
        await plain.close()


async def test_a_relay_woken_in_process_publishes_its_processs_rows_without_notify_or_poll(
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
) -> None:
    seen = await capture(amqp_url, EVENTS_EXCHANGE, "#")
    relayed = await Stores.connect(database_url, max_size=4, relayed=True)
    # No LISTEN, and a poll an hour away: only the in-process wake-up can publish the rows in time.
    relay = OutboxRelay(relayed.db, await amqp_connect(amqp_url, "relay"), poll_seconds=3600)
    # No hand-over either: the relay only learns that rows were written, and wakes.
    engine = Engine.over(relayed)
    engine.hand_events_to(relay)
    stop = asyncio.Event()
    serving = asyncio.create_task(relay.serve(stop))
    try:
        first = await ended_run_event(relayed, scope, engine)
        await seen.wait_ids({first})
        # Every other transition's events (here a run that pauses: its Notice) wake it the same way.
        paused = await paused_run(relayed, scope, through=engine)
        await seen.wait_for(lambda got: any(paused.run.id in m.body.decode() for m in got), what="the notice")
    finally:
        stop.set()
        async with asyncio.timeout(WITHIN):
            await serving
        await relay.close()
        await relayed.close()
