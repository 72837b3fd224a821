"""The outbox quarantine on the real PostgreSQL and RabbitMQ: an event the broker keeps refusing is set aside
after ``max_attempts`` refusals while every other subscriber keeps receiving its events; operators list the
quarantined rows and send them again under their own ``message_id``; an outage (no confirm in time, a lost
connection, a missing exchange) counts against no row; a channel the broker closes over one message of a
batch is charged to that message alone."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractQueue, AbstractRobustConnection
from click.testing import CliRunner, Result

from intermission.agent.loop import default_executor
from intermission.engine import events as outbox
from intermission.fleet.metrics import WorkerMetrics
from intermission.fleet.worker import running_worker
from intermission.ops.cli import main
from intermission.publishers.amqp import ConfirmingPublisher, Outgoing, PublishFailed, refusal
from intermission.publishers.clients import HostClient
from intermission.publishers.relay import OutboxRelay
from intermission.schemas.commands import StartCommand
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import SuspendReason
from intermission.store import Stores
from intermission.store.db import Database
from intermission.wire import COMMANDS_EXCHANGE, EVENTS_EXCHANGE, message, notice_key
from tests.support import outbox as support_outbox
from tests.support.amqp import DELIVERY_LIMIT, Capture
from tests.support.fleet import fast_settings
from tests.support.metrics import free_port, samples, scrape
from tests.support.netproxy import net_proxy
from tests.support.waiting import eventually

if TYPE_CHECKING:
    from tests.support.amqp import Broker, CaptureFactory, ConnectionFactory, Vhost

WITHIN = 15.0


def every_key_of(scope: Scope) -> str:
    """The topic binding that matches every event of ``scope`` (notice.*, run.*, command.rejected)."""
    return f"*.*.{scope.app}.{scope.tenant}"


async def full_queue(connection: AbstractRobustConnection, binding: str) -> AbstractQueue:
    """A subscriber's queue at its length limit that refuses new messages (reject-publish), as a host's queue
    is when the host stopped reading: the broker nacks every publication routed to it."""
    channel = await connection.channel(publisher_confirms=True)
    queue = await channel.declare_queue(
        f"subscriber-{uuid.uuid4().hex[:8]}",
        durable=True,
        arguments={"x-max-length": 1, "x-overflow": "reject-publish"},
    )
    await queue.bind(EVENTS_EXCHANGE, binding)
    await channel.default_exchange.publish(aio_pika.Message(b"what filled it"), routing_key=queue.name)
    return queue


def run_events(scope: Scope, n: int, tag: str) -> list[outbox.OutboxEvent]:
    return [
        outbox.run_event(
            RunEvent(kind=RunEventKind.COMPLETED, run_id=f"{tag}-{i}", revision=1, scope=scope, output=str(i)),
            correlation_id=f"cmd-{tag}-{i}",
        )
        for i in range(n)
    ]


async def outbox_rows(database_url: str) -> dict[str, asyncpg.Record]:
    """Every outbox row by message id, as the database holds it."""
    con = await asyncpg.connect(database_url)
    try:
        found = await con.fetch(
            "SELECT id, message_id::text AS message_id, routing_key, body, attempts, next_attempt_at,"
            "       quarantined_at, last_error, sent_at FROM outbox ORDER BY id"
        )
    finally:
        await con.close()
    return {r["message_id"]: r for r in found}


async def all_quarantined(database_url: str, ids: list[str]) -> bool:
    rows = await outbox_rows(database_url)
    return all(rows[i]["quarantined_at"] is not None for i in ids)


async def cli(database_url: str, *args: str) -> Result:
    """``intermission`` as an operator runs it, against the test database (in a thread: it runs its own loop)."""
    return await asyncio.to_thread(
        CliRunner().invoke, main, list(args), env={"INTERMISSION_DATABASE_URL": database_url}
    )


@pytest.fixture
async def relays() -> AsyncIterator[list[OutboxRelay]]:
    """Relays a test makes (append them); closed after the test."""
    made: list[OutboxRelay] = []
    yield made
    for relay in made:
        await relay.close()


async def new_relay(
    db: Database, connection: AbstractRobustConnection, made: list[OutboxRelay], **options: Any
) -> OutboxRelay:
    relay = OutboxRelay(db, connection, **options)
    made.append(relay)
    return relay


async def test_a_row_the_broker_keeps_refusing_is_quarantined_while_other_scopes_keep_receiving_theirs(
    stores: Stores,
    database_url: str,
    scope: Scope,
    other_scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    relays: list[OutboxRelay],
) -> None:
    refusing = await full_queue(await amqp_connect(amqp_url, "stalled subscriber"), every_key_of(scope))
    theirs = await capture(amqp_url, EVENTS_EXCHANGE, every_key_of(other_scope))
    # A healthy subscriber of everything: it receives each publication of a refused row (the broker routes
    # it to every bound queue and only the full one refuses), in publication order.
    everything = await capture(amqp_url, EVENTS_EXCHANGE, "#")
    relay = await new_relay(
        stores.db,
        await amqp_connect(amqp_url, "relay"),
        relays,
        listen_dsn=database_url,
        max_attempts=3,
        # Refused rows wait 0.5 s, then 1 s: long enough for the other scope's rows to be written and sent
        # while the refused ones are still being tried.
        refusal_wait_seconds=0.5,
        max_backoff_seconds=1.0,
    )
    metrics = WorkerMetrics()
    metrics.watch_relay(relay)
    stop = asyncio.Event()
    serving = asyncio.create_task(relay.serve(stop))
    try:
        async with asyncio.timeout(WITHIN):
            await relay.wait_listening()
        poisoned = await support_outbox.insert(stores, scope, *run_events(scope, 2, "refused"))
        first = await support_outbox.insert(stores, other_scope, *run_events(other_scope, 2, "first"))

        async def refused_once() -> bool:
            rows = await outbox_rows(database_url)
            return all(rows[i]["attempts"] >= 1 for i in poisoned)

        await eventually(refused_once, within=WITHIN, what="a first refusal of the rows routed to the full queue")
        meantime = await support_outbox.insert(stores, other_scope, *run_events(other_scope, 3, "meantime"))
        await eventually(lambda: all_quarantined(database_url, poisoned), within=WITHIN, what="the quarantine")
        # After the quarantine, later batches flow as before.
        after = await support_outbox.insert(stores, other_scope, *run_events(other_scope, 2, "after"))
        theirs_ids = {*first, *meantime, *after}
        await theirs.wait_ids(theirs_ids, within=WITHIN)

        async def gauge_counted() -> bool:
            return metrics.registry.get_sample_value("intermission_outbox_quarantined_rows") == 2

        await eventually(gauge_counted, within=WITHIN, what="the quarantined rows' gauge")
    finally:
        stop.set()
        async with asyncio.timeout(WITHIN):
            await serving

    rows = await outbox_rows(database_url)
    for message_id in poisoned:
        row = rows[message_id]
        assert row["attempts"] == 3
        assert row["quarantined_at"] is not None
        assert row["sent_at"] is None
        assert row["next_attempt_at"] is None
        assert "basic.nack" in row["last_error"]
        assert "reject-publish" in row["last_error"]
    quarantined_at = min(rows[i]["quarantined_at"] for i in poisoned)
    for message_id in theirs_ids:
        assert rows[message_id]["sent_at"] is not None
        assert rows[message_id]["attempts"] == 0
    # The rows written while the refused ones were still being tried went out before the quarantine: the
    # refused rows never held them up.
    assert all(rows[i]["sent_at"] < quarantined_at for i in meantime)
    # Every one of the other scope's events arrived exactly once, and nothing of the refused scope's did.
    assert Counter(theirs.ids()) == Counter(theirs_ids)
    # A refused row was published once per attempt and never again once quarantined: the rows written after
    # the quarantine came later on the same channel, so any further publication would be here by now.
    await everything.wait_ids(set(after), within=WITHIN)
    assert Counter(i for i in everything.ids() if i in poisoned) == dict.fromkeys(poisoned, 3)
    # The stalled subscriber's queue holds only what filled it.
    passive = await (await (await amqp_connect(amqp_url, "inspect")).channel()).declare_queue(
        refusing.name, passive=True
    )
    assert passive.declaration_result.message_count == 1
    assert (relay.refused, relay.quarantined) == (6, 2)
    assert metrics.registry.get_sample_value("intermission_outbox_refused_total") == 6
    assert metrics.registry.get_sample_value("intermission_outbox_quarantined_total") == 2
    assert await stores.across_scopes.count_quarantined_outbox() == 2
    assert await stores.across_scopes.count_unsent_outbox() == 0


async def test_operators_list_quarantined_rows_and_retry_them_under_the_same_message_id(
    stores: Stores,
    database_url: str,
    scope: Scope,
    other_scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    relays: list[OutboxRelay],
) -> None:
    refusing = await full_queue(await amqp_connect(amqp_url, "stalled subscriber"), every_key_of(scope))
    # Polling an hour apart: only the retry's notification can make the retried rows go out while we wait.
    relay = await new_relay(
        stores.db,
        await amqp_connect(amqp_url, "relay"),
        relays,
        listen_dsn=database_url,
        poll_seconds=3600,
        max_attempts=1,
    )
    poisoned = await support_outbox.insert(stores, scope, *run_events(scope, 2, "refused"))
    assert await relay.run_once() == 0
    rows = await outbox_rows(database_url)
    first_id = rows[poisoned[0]]["id"]
    # A row nobody has tried yet: the plain list shows it (and its refusals: none).
    (waiting,) = await support_outbox.insert(stores, other_scope, *run_events(other_scope, 1, "waiting"))

    listed = await cli(database_url, "outbox", "list", "--quarantined")
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[-1] == "2 quarantined outbox row(s)"
    for message_id, line in zip(poisoned, lines[:2], strict=True):
        fields = line.split()
        assert fields[0] == str(rows[message_id]["id"])
        assert fields[1] == rows[message_id]["routing_key"]
        assert fields[2:4] == ["attempts", "1"]
        assert f"{rows[message_id]['quarantined_at']:%Y-%m-%d %H:%M:%S}" in line
        assert "basic.nack" in line
        # An event's body is the hosts' data: the operator's list never shows it.
        assert rows[message_id]["body"] not in line
    unsent = await cli(database_url, "outbox", "list")
    assert unsent.exit_code == 0, unsent.output
    (line, total) = unsent.output.splitlines()
    assert total == "1 unsent outbox row(s)"
    waiting_row = (await outbox_rows(database_url))[waiting]
    assert line.split() == [str(waiting_row["id"]), waiting_row["routing_key"], "attempts", "0", "-", "-"]

    # The subscriber reads again: its queue has room.
    received = Capture()
    await received.consume(refusing)
    stop = asyncio.Event()
    serving = asyncio.create_task(relay.serve(stop))
    try:
        async with asyncio.timeout(WITHIN):
            await relay.wait_listening()
        one = await cli(database_url, "outbox", "retry", str(first_id))
        assert one.exit_code == 0, one.output
        assert one.output.strip() == "1 outbox row(s) handed back to the relay"
        await received.wait_ids({poisoned[0]}, within=WITHIN)
        # Only the one asked for: the other stays set aside.
        assert (await outbox_rows(database_url))[poisoned[1]]["quarantined_at"] is not None

        every = await cli(database_url, "outbox", "retry", "--all")
        assert every.exit_code == 0, every.output
        assert every.output.strip() == "1 outbox row(s) handed back to the relay"
        await received.wait_ids(set(poisoned), within=WITHIN)
    finally:
        stop.set()
        async with asyncio.timeout(WITHIN):
            await serving

    rows = await outbox_rows(database_url)
    for message_id in poisoned:
        assert rows[message_id]["sent_at"] is not None
        assert rows[message_id]["quarantined_at"] is None
        assert rows[message_id]["attempts"] == 0
    # The same events as stored, under the same ids: a subscriber that got one after all drops the copy.
    by_id = {m.message_id: m for m in received.messages}
    for message_id in poisoned:
        assert by_id[message_id].body == rows[message_id]["body"].encode()
        assert by_id[message_id].routing_key == rows[message_id]["routing_key"]

    again = await cli(database_url, "outbox", "retry", str(first_id))
    assert again.exit_code == 1
    assert "0 outbox row(s) handed back to the relay" in again.output
    assert f"not quarantined: {first_id}" in again.output
    neither = await cli(database_url, "outbox", "retry")
    assert neither.exit_code == 2
    assert "say which" in neither.output


async def test_an_outage_counts_against_no_row(
    stores: Stores,
    database_url: str,
    scope: Scope,
    other_scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    relays: list[OutboxRelay],
) -> None:
    await full_queue(await amqp_connect(amqp_url, "stalled subscriber"), every_key_of(scope))
    theirs = await capture(amqp_url, EVENTS_EXCHANGE, every_key_of(other_scope))
    # max_attempts=1: a single refusal counted by mistake would quarantine a row at once.
    async with net_proxy(amqp_url) as stalling, net_proxy(amqp_url) as cut:
        stalling_link = await amqp_connect(stalling.url(amqp_url), "relay, link stalls")
        cut_link = await amqp_connect(cut.url(amqp_url), "relay, link cut")
        stalled = await new_relay(stores.db, stalling_link, relays, publish_timeout=0.5, max_attempts=1)
        lost = await new_relay(stores.db, cut_link, relays, publish_timeout=WITHIN, max_attempts=1)
        # Both channels open while the links work.
        assert await stalled.run_once() == 0
        assert await lost.run_once() == 0
        poisoned = await support_outbox.insert(stores, scope, *run_events(scope, 2, "refused"))
        theirs_ids = await support_outbox.insert(stores, other_scope, *run_events(other_scope, 2, "theirs"))

        # No confirm in time: the link stops delivering.
        stalling.freeze()
        with pytest.raises(PublishFailed) as timed_out:
            await stalled.run_once()
        assert isinstance(timed_out.value.__cause__, TimeoutError)
        await _nothing_counted(database_url, [*poisoned, *theirs_ids])

        # The connection lost under a batch in flight: its publications reached the link, then it broke.
        cut.freeze()
        in_flight = asyncio.create_task(lost.run_once())
        async with asyncio.timeout(WITHIN):
            await cut.held.wait()
        await cut.cut()
        cut.thaw()
        with pytest.raises(PublishFailed) as broken:
            await in_flight
        assert refusal(broken.value.__cause__) is None
        await _nothing_counted(database_url, [*poisoned, *theirs_ids])
        assert stalled.refused == lost.refused == 0
        # Closed before their links go, so they do not try to reconnect to a proxy that is gone (and over a
        # link that delivers again, or each close would wait for its answer until the heartbeat gives up).
        stalling.thaw()
        for relay in (stalled, lost):
            await relay.close()
        await stalling_link.close()
        await cut_link.close()

    # The same rows, with a broker that answers: the full queue's rows ARE refused (and, at one attempt,
    # quarantined), the others are sent. So the outage above is what kept them from counting.
    answering = await new_relay(stores.db, await amqp_connect(amqp_url, "relay"), relays, max_attempts=1)
    assert await answering.run_once() == 2
    rows = await outbox_rows(database_url)
    assert all(rows[i]["attempts"] == 1 and rows[i]["quarantined_at"] is not None for i in poisoned)
    await theirs.wait_ids(set(theirs_ids), within=WITHIN)


async def _nothing_counted(database_url: str, ids: list[str]) -> None:
    rows = await outbox_rows(database_url)
    for message_id in ids:
        row = rows[message_id]
        assert row["sent_at"] is None
        assert row["attempts"] == 0
        assert row["last_error"] is None
        assert row["quarantined_at"] is None
        assert row["next_attempt_at"] is None


async def test_a_broker_that_refuses_every_row_alike_counts_against_none(
    stores: Stores,
    database_url: str,
    scope: Scope,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    relays: list[OutboxRelay],
) -> None:
    # A vhost without the topology: every publication to intermission.events is refused 404 NOT_FOUND
    # (the channel closed). That is the broker refusing the exchange, not any one event.
    relay = await new_relay(
        stores.db, await amqp_connect(amqp_vhost.url(), "relay, no topology"), relays, max_attempts=1
    )
    ids = await support_outbox.insert(stores, scope, *run_events(scope, 3, "nowhere"))
    with pytest.raises(PublishFailed) as refused_all:
        await relay.run_once()
    assert "NOT_FOUND" in str(refused_all.value.__cause__)
    await _nothing_counted(database_url, ids)


async def test_a_channel_closed_over_one_message_of_a_batch_is_charged_to_that_message_alone(
    amqp_url: str, amqp_connect: ConnectionFactory, capture: CaptureFactory
) -> None:
    everything = await capture(amqp_url, EVENTS_EXCHANGE, "#")
    publisher = ConfirmingPublisher(await amqp_connect(amqp_url, "publisher"), EVENTS_EXCHANGE, mandatory=False)
    ids = [str(uuid.uuid4()) for _ in range(12)]
    # RabbitMQ closes the channel (406 PRECONDITION_FAILED) over a user_id that is not the connection's,
    # as it does over a message above its max size; every publication in flight on it fails alike.
    forged = {4, 9}
    batch = [
        Outgoing(
            message(
                "{}",
                message_id=i,
                routing_key="run.completed.acme.t9",
                user_id="somebody-else" if n in forged else None,
            ),
            "run.completed.acme.t9",
        )
        for n, i in enumerate(ids)
    ]
    try:
        outcomes = await publisher.publish_all(batch)
    finally:
        await publisher.close()

    reasons = [refusal(outcome) for outcome in outcomes]
    assert [n for n, reason in enumerate(reasons) if reason is not None] == sorted(forged)
    assert all("PRECONDITION_FAILED" in str(reasons[n]) and "user_id" in str(reasons[n]) for n in forged)
    assert [n for n, outcome in enumerate(outcomes) if outcome is None] == [n for n in range(12) if n not in forged]
    # Every message the broker did not refuse arrived (some perhaps twice, as after any failure); the forged
    # ones never did.
    delivered = {i for n, i in enumerate(ids) if n not in forged}
    await everything.wait_ids(delivered, within=WITHIN)
    assert not {ids[n] for n in forged} & set(everything.ids())

    # A mandatory message no queue takes is returned, and that is a refusal of it too.
    # (The commands exchange routes by exact key; the capture above takes every event.)
    mandatory = ConfirmingPublisher(await amqp_connect(amqp_url, "mandatory"), COMMANDS_EXCHANGE, mandatory=True)
    try:
        (returned,) = await mandatory.publish_all(
            [Outgoing(message("{}", message_id="r", routing_key="nobody.binds.this"), "nobody.binds.this")]
        )
    finally:
        await mandatory.close()
    assert "312 NO_ROUTE" in str(refusal(returned))


async def test_a_worker_quarantines_at_its_setting_and_its_metrics_say_so(
    stores: Stores,
    scope: Scope,
    database_url: str,
    amqp_url: str,
    amqp_vhost: Vhost,
    rabbit: Broker,
    amqp_connect: ConnectionFactory,
) -> None:
    port = free_port()
    settings = fast_settings(
        database_url,
        amqp_url=amqp_url,
        bus_user=rabbit.bus.name,
        delivery_limit=DELIVERY_LIMIT,
        metrics_port=port,
        outbox_max_attempts=2,
    )
    await full_queue(await amqp_connect(amqp_url, "stalled host"), notice_key(SuspendReason.EXTERNAL_TOOL, scope))
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    async with (
        running_worker(settings, executor=default_executor(), stores=stores),
        await HostClient.connect(amqp_vhost.url(rabbit.host)) as host,
    ):
        script = [ScriptTurn.model_validate({"call": [{"tool": "lookup"}]})]
        await host.start(StartCommand(scope=scope, run_id=run_id, agent_id="demo", script=script))

        async def notice_quarantined() -> bool:
            async with stores.db.connection() as con:
                found = await con.fetch("list_outbox_for_run", run_id, scope.app, scope.tenant)
            return any(r["routing_key"].startswith("notice.") for r in found) and (
                await stores.across_scopes.count_quarantined_outbox() == 1
            )

        await eventually(notice_quarantined, within=WITHIN, what="the run's notice quarantined")

        async def counted() -> bool:
            values = samples(await asyncio.to_thread(scrape, port))
            return (
                values.get(("intermission_outbox_quarantined_total", ())) == 1
                and values.get(("intermission_outbox_quarantined_rows", ())) == 1
            )

        await eventually(counted, within=WITHIN, what="the worker's quarantine metrics")
        values = samples(await asyncio.to_thread(scrape, port))
        assert values[("intermission_outbox_refused_total", ())] == 2
    (entry,) = await stores.across_scopes.list_outbox(quarantined=True, limit=10)
    assert entry.routing_key == notice_key(SuspendReason.EXTERNAL_TOOL, scope)
    assert entry.run_id == run_id
    assert entry.attempts == 2


async def test_a_row_no_client_could_send_is_refused_and_quarantined_without_failing_its_batch(
    stores: Stores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    relays: list[OutboxRelay],
) -> None:
    # A foreign writer's row: a routing key over AMQP's 255 bytes, which the client would raise on before
    # the broker saw anything (the whole batch failing with it, every time).
    received = await capture(amqp_url, EVENTS_EXCHANGE, every_key_of(scope))
    relay = await new_relay(stores.db, await amqp_connect(amqp_url, "relay"), relays, max_attempts=1)
    good = run_events(scope, 3, "fine")
    bad = outbox.OutboxEvent(routing_key="run.completed." + "k" * 300, body="{}")
    ids = await support_outbox.insert(stores, scope, good[0], bad, *good[1:])
    assert await relay.run_once() == 3
    await received.wait_ids({ids[0], *ids[2:]})
    rows = await outbox_rows(database_url)
    assert rows[ids[1]]["sent_at"] is None
    assert rows[ids[1]]["quarantined_at"] is not None
    assert rows[ids[1]]["last_error"] == "cannot be put on the wire: its routing key is over 255 bytes"
