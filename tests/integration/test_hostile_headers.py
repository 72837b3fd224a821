"""No header can take a connection down (docs/contracts.md, "Headers").

A confined host publishes, on its own scoped key, a command whose header table nests 500 deep: a few KB
the broker takes. pamqp's decoder recursed once per level, so the worker's frame reader died with a
RecursionError and the whole connection dropped (consumers, relay and refusals of every tenant), while the
message stayed queued for the next worker. Decoded within bounds (``intermission/amqp_headers.py``), it is
refused like any malformed command: dead-lettered with its code, ``command.rejected`` to its sender's
scope, nothing written, the worker's connection never closed, another tenant's run served as usual. In
``intermission.dead`` it no longer breaks the tools that read the queue.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection, FieldValue

from intermission.fleet.worker import Worker
from intermission.ops.dead import list_dead
from intermission.ops.doctor import Status, dead_letters
from intermission.publishers.clients import HostClient
from intermission.publishers.dead_queue import dead_stats
from intermission.schemas.scope import Scope
from intermission.wire import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_QUEUE,
    ERROR_HEADER,
    EVENTS_EXCHANGE,
    SCHEMA_VERSION_HEADER,
    Command,
    declare,
)
from tests.integration.test_hostile_messages import resume_body
from tests.integration.test_messaging import one_run_served
from tests.support.amqp import CaptureFactory, ConnectionFactory, Vhost
from tests.support.confined import Confiner
from tests.support.hostile import allow_raw_fields, nested_array, nested_table
from tests.support.inspect import Inspector
from tests.support.waiting import eventually

WAIT = 30.0

DEPTHS = {
    "table_500_deep": nested_table(500),
    "array_500_deep": nested_array(500),
    "table_5000_deep": nested_table(5000),
}


def closes_of(connection: AbstractRobustConnection) -> list[object]:
    """Every close of ``connection`` from now on, a reconnect's included (the robust connection calls its
    close callbacks when the underlying connection is lost, before it reconnects)."""
    closes: list[object] = []
    connection.close_callbacks.add(lambda _sender, exc: closes.append(exc))
    return closes


@pytest.mark.parametrize("kind", sorted(DEPTHS))
async def test_a_header_nested_hundreds_deep_is_refused_and_the_worker_keeps_its_connection(
    kind: str,
    worker: Worker,
    scope: Scope,
    other_scope: Scope,
    host: HostClient,
    confiner: Confiner,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    db: Inspector,
) -> None:
    allow_raw_fields()
    closes = closes_of(worker.connection)
    dead = await capture(amqp_vhost.url(), DEAD_EXCHANGE, "")
    refused = await capture(amqp_vhost.url(), EVENTS_EXCHANGE, f"command.rejected.{scope.routing_suffix()}")
    attacker = await confiner.confined(scope, prefix="nester")
    connection = await amqp_connect(amqp_vhost.url(attacker), "nester")
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
    message_id = f"nested-{uuid.uuid4()}"
    await exchange.publish(
        aio_pika.Message(
            resume_body(scope),
            message_id=message_id,
            headers={SCHEMA_VERSION_HEADER: 1, "x-nest": DEPTHS[kind]},
            content_type="application/json",
        ),
        routing_key=Command.RESUME.key(scope),
    )

    # Another tenant's run, published behind it on the same queues, pauses and completes.
    await one_run_served(host, other_scope, within=WAIT)

    [event] = await refused.wait_count(1, within=WAIT)
    assert event.json()["message_id"] == message_id
    assert event.json()["code"] == "invalid_message"
    assert "nest" in event.json()["detail"]
    [letter] = await dead.wait_for(lambda got: len(got) >= 1, within=WAIT, what="the dead copy")
    assert letter.message_id == message_id
    assert letter.headers[ERROR_HEADER] == "invalid_message"
    # Nothing of the refused command was written: no inbox row under its id, in any scope.
    assert await db.con.fetchval("SELECT count(*) FROM inbox WHERE message_id = $1", message_id) == 0
    assert closes == []
    assert not worker.connection.is_closed


async def test_the_dead_letter_tools_read_a_queue_holding_a_nested_header(
    amqp_vhost: Vhost, amqp_connect: ConnectionFactory
) -> None:
    """Put straight into ``intermission.dead`` (as only a trusted identity can), a message with a header
    nested 5,000 deep is listed (``dead list``), counted and aged (``doctor``'s dead-letter check); the
    connection that read it stays open."""
    allow_raw_fields()
    admin = await amqp_connect(amqp_vhost.url(), "admin")
    channel = await admin.channel(publisher_confirms=True)
    await declare(channel, delivery_limit=10)
    dead = await channel.get_exchange(DEAD_EXCHANGE)
    published: list[tuple[str, dict[str, FieldValue]]] = [
        ("deep-letter", {"x-nest": nested_table(5000)}),
        ("plain-letter", {}),
    ]
    for message_id, headers in published:
        letter = aio_pika.Message(b"{}", message_id=message_id, headers=headers, timestamp=datetime.now(UTC))
        await dead.publish(letter, routing_key=Command.CANCEL.value)

    async def both_queued() -> bool:
        """Both letters ready again: a reader's unacknowledged letters go back when its channel closes,
        which a quorum queue applies a moment after the close."""
        probe = await admin.channel()
        try:
            queue = await probe.declare_queue(DEAD_QUEUE, passive=True)
            return queue.declaration_result.message_count == len(published)
        finally:
            await probe.close()

    reader = await amqp_connect(amqp_vhost.url(), "dead reader")
    closes = closes_of(reader)
    await eventually(both_queued, within=WAIT, what="both letters queued")
    letters = await list_dead(reader)
    assert [letter.message_id for letter in letters] == ["deep-letter", "plain-letter"]
    await eventually(both_queued, within=WAIT, what="both letters back after dead list")
    stats = await dead_stats(reader)
    # The head of the queue, the letter dead_stats reads for its age, is the deep one.
    assert stats.depth == 2
    assert stats.oldest_seconds is not None
    await eventually(both_queued, within=WAIT, what="both letters back after dead_stats")
    check = await dead_letters(reader)
    assert check.status is Status.WARN
    assert check.details["depth"] == 2
    assert check.details["oldest_seconds"] is not None
    assert closes == []
    assert not reader.is_closed
