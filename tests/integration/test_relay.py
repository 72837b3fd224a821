"""The outbox relay on the real PostgreSQL and RabbitMQ: every unsent row is published with its stable
``message_id`` and marked sent only after its confirm; relays share the outbox without double-publishing;
LISTEN/NOTIFY wakes them; a broker restart loses nothing and marks nothing sent without a confirm."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aio_pika
import asyncpg
import pytest

from intermission.engine import events as outbox
from intermission.publishers.relay import OutboxRelay
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import SuspendReason
from intermission.store import Stores
from intermission.store.db import Database
from intermission.wire import EVENTS_EXCHANGE, SCHEMA_VERSION, SCHEMA_VERSION_HEADER, TRACEPARENT_HEADER, notice_key
from tests.conftest import MakeStores, race
from tests.support import outbox as support_outbox
from tests.support.factories import paused_run, running_run, writes
from tests.support.waiting import eventually

if TYPE_CHECKING:
    # Types only: importing tests.support.amqp here would defeat pytest's assertion rewriting of the plugin.
    from tests.support.amqp import Broker, CaptureFactory, ConnectionFactory

# The broker fixtures (a vhost per test, captures, the test users) until tests/conftest.py lists them.

ALL_EVENTS = "#"
STOP_WITHIN = 10.0


async def outbox_rows(database_url: str) -> list[asyncpg.Record]:
    con = await asyncpg.connect(database_url)
    try:
        return await con.fetch(
            "SELECT id, message_id::text AS message_id, routing_key, body, correlation_id, headers::text AS headers,"
            "       sent_at FROM outbox ORDER BY id"
        )
    finally:
        await con.close()


async def refusals(database_url: str) -> list[asyncpg.Record]:
    """The rows the broker refused at least once."""
    con = await asyncpg.connect(database_url)
    try:
        return await con.fetch(
            "SELECT message_id::text AS message_id, attempts, last_error, quarantined_at FROM outbox"
            " WHERE attempts > 0 ORDER BY id"
        )
    finally:
        await con.close()


async def unsent_ids(database_url: str) -> set[str]:
    return {r["message_id"] for r in await outbox_rows(database_url) if r["sent_at"] is None}


async def write_events(stores: Stores, scope: Scope, n: int) -> list[str]:
    """``n`` run events in ONE transaction (one NOTIFY), cheaper than n runs for volume tests."""
    events = [
        outbox.run_event(
            RunEvent(kind=RunEventKind.COMPLETED, run_id=f"bulk-{i}", revision=1, scope=scope, output=str(i)),
            correlation_id=f"cmd-{i}",
        )
        for i in range(n)
    ]
    return await support_outbox.insert(stores, scope, *events)


async def end_run(stores: Stores, scope: Scope, *, correlation_id: str) -> str:
    run, held = await running_run(stores, scope)
    await writes(stores, scope).runs.end_run(
        run.id, held.owner, RunEventKind.COMPLETED, output="done", correlation_id=correlation_id
    )
    return run.id


@pytest.fixture
async def relays(amqp_url: str, amqp_connect: ConnectionFactory) -> AsyncIterator[list[OutboxRelay]]:
    """Relays a test makes (append them); closed after the test."""
    made: list[OutboxRelay] = []
    yield made
    for relay in made:
        await relay.close()


async def new_relay(
    db: Database, amqp_url: str, amqp_connect: ConnectionFactory, made: list[OutboxRelay], **options: Any
) -> OutboxRelay:
    relay = OutboxRelay(db, await amqp_connect(amqp_url, "relay"), **options)
    made.append(relay)
    return relay


async def test_relay_publishes_every_unsent_row_with_its_stable_message_id_and_marks_it_sent_after_the_confirm(
    stores: Stores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    relays: list[OutboxRelay],
) -> None:
    seen = await capture(amqp_url, EVENTS_EXCHANGE, ALL_EVENTS)
    await paused_run(stores, scope, reason=SuspendReason.EXTERNAL_TOOL)
    await paused_run(stores, scope, reason=SuspendReason.AGENT_REPLY)
    await end_run(stores, scope, correlation_id="cmd-end")
    # A row whose writer passed a trace context along: the relay forwards every stored header unchanged.
    traced = outbox.OutboxEvent(
        routing_key=notice_key(SuspendReason.APPROVAL, scope),
        body='{"traced": true}',
        correlation_id="cmd-traced",
        headers={SCHEMA_VERSION_HEADER: SCHEMA_VERSION, TRACEPARENT_HEADER: "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    )
    await support_outbox.insert(stores, scope, traced)
    rows = await outbox_rows(database_url)
    assert len(rows) == 4
    assert all(r["sent_at"] is None for r in rows)

    relay = await new_relay(stores.db, amqp_url, amqp_connect, relays)
    assert await relay.run_once() == 4

    got = await seen.wait_ids({r["message_id"] for r in rows})
    by_id = {m.message_id: m for m in got}
    for row in rows:
        message = by_id[row["message_id"]]
        assert message.routing_key == row["routing_key"]
        assert message.type == row["routing_key"]
        assert message.content_type == "application/json"
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert message.body == row["body"].encode()
        assert message.correlation_id == row["correlation_id"]
        assert message.headers == json.loads(row["headers"])
        assert message.headers[SCHEMA_VERSION_HEADER] == SCHEMA_VERSION
    assert by_id[str(traced.message_id)].headers[TRACEPARENT_HEADER] == traced.headers[TRACEPARENT_HEADER]
    assert all(r["sent_at"] is not None for r in await outbox_rows(database_url))
    # Nothing is left: a second pass publishes nothing.
    assert await relay.run_once() == 0
    assert Counter(seen.ids()) == Counter(r["message_id"] for r in rows)


async def test_relay_counts_a_nacked_row_leaves_it_unsent_and_republishes_it_later_under_the_same_id(
    stores: Stores,
    database_url: str,
    scope: Scope,
    other_scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    relays: list[OutboxRelay],
) -> None:
    seen = await capture(amqp_url, EVENTS_EXCHANGE, ALL_EVENTS)
    # A full queue that refuses new messages makes the broker NACK every publication routed to it: here,
    # the other tenant's notices.
    blocker_connection = await amqp_connect(amqp_url, "blocker")
    channel = await blocker_connection.channel()
    blocker = await channel.declare_queue(
        f"blocker-{uuid.uuid4().hex[:8]}", arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
    )
    await blocker.bind(EVENTS_EXCHANGE, notice_key(SuspendReason.EXTERNAL_TOOL, other_scope))
    await paused_run(stores, scope)
    blocked = await paused_run(stores, other_scope)
    await paused_run(stores, scope)
    rows = await outbox_rows(database_url)
    blocked_id = next(r["message_id"] for r in rows if r["routing_key"].endswith(other_scope.tenant))

    relay = await new_relay(stores.db, amqp_url, amqp_connect, relays, refusal_wait_seconds=0.2)
    # A refusal is not an outage: the batch goes through without an error.
    assert await relay.run_once() == 2

    # Confirmed rows are marked sent; the nacked one is not, and carries one refusal with the broker's word.
    assert await unsent_ids(database_url) == {blocked_id}
    assert relay.published == 2
    assert relay.refused == 1
    (refused,) = await refusals(database_url)
    assert refused["message_id"] == blocked_id
    assert refused["attempts"] == 1
    assert "basic.nack" in refused["last_error"]
    assert refused["quarantined_at"] is None

    await blocker.delete(if_unused=False, if_empty=False)

    # Once its wait is over (by the database clock), the next pass publishes it.
    async def sent_again() -> bool:
        await relay.run_once()
        return not await unsent_ids(database_url)

    await eventually(sent_again, what="the nacked row published once its wait was over")
    assert relay.published == 3
    # The re-publication carries the row's own message_id. (The nacked attempt also reached the queues
    # that accepted it, so this subscriber sees that id twice: a duplicate only ever follows a failure.)
    got = await seen.wait_for(
        lambda got: sum(m.message_id == blocked_id for m in got) == 2, what="the re-published notice"
    )
    republished = [m for m in got if m.message_id == blocked_id]
    assert republished[0].body == republished[1].body
    assert json.loads(republished[1].body)["run_id"] == blocked.run.id
    counts = Counter(seen.ids())
    assert all(counts[r["message_id"]] == 1 for r in rows if r["message_id"] != blocked_id)


async def test_two_relays_at_once_never_publish_the_same_row(
    stores: Stores,
    make_stores: MakeStores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    relays: list[OutboxRelay],
) -> None:
    seen = await capture(amqp_url, EVENTS_EXCHANGE, ALL_EVENTS)
    ids = await write_events(stores, scope, 400)
    a_stores, b_stores = await make_stores(2)
    a = await new_relay(a_stores.db, amqp_url, amqp_connect, relays, batch_size=16)
    b = await new_relay(b_stores.db, amqp_url, amqp_connect, relays, batch_size=16)

    results = await race(2, lambda i: (a, b)[i].run_once())

    assert results[0] + results[1] == 400, results
    assert a.failures == b.failures == 0
    assert await unsent_ids(database_url) == set()
    # A last row published after both relays finished arrives after everything they published (one queue
    # keeps publication order), so once it is here every duplicate would be here too.
    (last,) = await write_events(stores, scope, 1)
    assert await a.run_once() == 1
    await seen.wait_ids({last})
    counts = Counter(seen.ids())
    assert set(counts) == {*ids, last}
    assert max(counts.values()) == 1, [i for i, n in counts.items() if n > 1]


async def test_relay_wakes_on_notify_and_listens_again_after_its_connection_drops(
    stores: Stores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    relays: list[OutboxRelay],
) -> None:
    seen = await capture(amqp_url, EVENTS_EXCHANGE, ALL_EVENTS)
    name = f"relay-{uuid.uuid4().hex[:8]}"
    # Polling an hour apart: only a notification can make these rows go out while the test waits.
    relay = await new_relay(
        stores.db, amqp_url, amqp_connect, relays, listen_dsn=database_url, poll_seconds=3600, name=name
    )
    stop = asyncio.Event()
    serving = asyncio.create_task(relay.serve(stop))
    try:
        async with asyncio.timeout(STOP_WITHIN):
            await relay.wait_listening(1)
        first = await paused_run(stores, scope)
        await seen.wait_for(lambda got: any(first.run.id in m.body.decode() for m in got), what="the first notice")

        # Drop the LISTEN connection from the server side: the relay must notice and listen again.
        admin = await asyncpg.connect(database_url)
        try:
            dropped = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1", name
            )
        finally:
            await admin.close()
        assert dropped == 1
        async with asyncio.timeout(STOP_WITHIN):
            await relay.wait_listening(2)
        second = await paused_run(stores, scope)
        await seen.wait_for(lambda got: any(second.run.id in m.body.decode() for m in got), what="the second notice")
        assert not serving.done()
    finally:
        stop.set()
        async with asyncio.timeout(STOP_WITHIN):
            await serving
    assert await unsent_ids(database_url) == set()


async def test_relay_survives_a_broker_restart_and_marks_nothing_sent_without_a_confirm(
    stores: Stores,
    database_url: str,
    scope: Scope,
    rabbit: Broker,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    relays: list[OutboxRelay],
) -> None:
    seen = await capture(amqp_url, EVENTS_EXCHANGE, ALL_EVENTS)
    relay = await new_relay(
        stores.db,
        amqp_url,
        amqp_connect,
        relays,
        listen_dsn=database_url,
        poll_seconds=0.5,
        publish_timeout=1.0,
        max_backoff_seconds=0.5,
    )
    stop = asyncio.Event()
    serving = asyncio.create_task(relay.serve(stop))
    try:
        before = await paused_run(stores, scope)
        await seen.wait_for(lambda got: any(before.run.id in m.body.decode() for m in got), what="the first notice")

        async with rabbit.stopped():
            during = [(await paused_run(stores, scope)).run.id for _ in range(3)]
            failures = relay.failures
            # The relay tries while the broker is down (woken by the new rows) and fails; the broker's
            # absence is outside this process, hence the bounded poll.
            await eventually(lambda: _at_least(relay.failures, failures + 1), what="a failed attempt")
            pending = await unsent_ids(database_url)
            # No confirm could arrive, so no row may be marked sent.
            assert len(pending) == 3

        await seen.wait_ids(pending, within=30.0)
        await eventually(lambda: _no_unsent(database_url), within=30.0, what="every row marked sent")
        assert not serving.done()
    finally:
        stop.set()
        async with asyncio.timeout(STOP_WITHIN):
            await serving
    bodies = [m.body.decode() for m in seen.messages]
    assert all(any(run_id in body for body in bodies) for run_id in during)
    # Everything marked sent was received.
    assert {r["message_id"] for r in await outbox_rows(database_url)} <= set(seen.ids())


async def _at_least(value: int, floor: int) -> bool:
    return value >= floor


async def _no_unsent(database_url: str) -> bool:
    return not await unsent_ids(database_url)
