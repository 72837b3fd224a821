"""The host and bus clients on the real RabbitMQ (and PostgreSQL for the events): the exact command
contract, a bus identity RabbitMQ itself vouches for, and subscriptions that hear their own scope only,
typed and deduplicated."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, TypeVar

import aio_pika
import aiormq
import asyncpg
import pytest

from intermission.engine import events as outbox
from intermission.publishers.amqp import PublishFailed
from intermission.publishers.clients import BusClient, EventKind, HostClient, Received, Subscription, version_of
from intermission.publishers.relay import OutboxRelay
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ResumeCommand,
    StartCommand,
    ToolAnswer,
)
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Notice, SuspendReason
from intermission.store import Stores
from intermission.wire import (
    COMMANDS_EXCHANGE,
    SCHEMA_VERSION,
    SCHEMA_VERSION_HEADER,
    TRACEPARENT_HEADER,
    Command,
    rejected_key,
)
from tests.support import outbox as support_outbox
from tests.support.factories import paused_run, running_run, writes

if TYPE_CHECKING:
    # Types only: importing tests.support.amqp here would defeat pytest's assertion rewriting of the plugin.
    from tests.support.amqp import Broker, CaptureFactory, ConnectionFactory, Vhost

# The broker fixtures (a vhost per test, captures, the test users) until tests/conftest.py lists them.

WITHIN = 10.0
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
async def relay(stores: Stores, amqp_url: str, amqp_connect: ConnectionFactory) -> AsyncIterator[OutboxRelay]:
    one = OutboxRelay(stores.db, await amqp_connect(amqp_url, "relay"))
    yield one
    await one.close()


E = TypeVar("E")


async def next_of(events: Subscription[E]) -> Received[E]:
    async with asyncio.timeout(WITHIN):
        return await anext(events)


async def reject(stores: Stores, scope: Scope, message_id: str) -> str:
    """A ``command.rejected`` event in the outbox, as the consumers write it."""
    event = outbox.OutboxEvent(
        routing_key=rejected_key(scope),
        body=CommandRejected(
            message_id=message_id,
            routing_key=Command.RESUME.value,
            code="not_suspended",
            detail="no pause",
            scope=scope,
        ).model_dump_json(),
        correlation_id=message_id,
    )
    (written,) = await support_outbox.insert(stores, scope, event)
    return written


async def test_host_client_publishes_the_command_contract(
    scope: Scope, amqp_url: str, amqp_connect: ConnectionFactory, capture: CaptureFactory
) -> None:
    seen = await capture(amqp_url, COMMANDS_EXCHANGE, *(c.binding for c in Command))
    version = ClaimVersion(run_id="run-1", suspension_id=7, run_revision=3)
    start = StartCommand(scope=scope, run_id="run-1", agent_id="demo", input="hi")
    resume = ResumeCommand(scope=scope, version=version, results=[ToolAnswer(call_id="c1", content="42")])
    decide = DecideCommand(scope=scope, version=version, checkpoint_id=9, decision=Decision.APPROVE)
    cancel = CancelCommand(scope=scope, run_id="run-1", reason="changed my mind")

    async with await HostClient.connect(amqp_url, name="test host") as host:
        sent = {
            await host.start(start, message_id="start-1", correlation_id="corr-1", traceparent=TRACEPARENT): (
                Command.START,
                start,
            ),
            await host.resume(resume): (Command.RESUME, resume),
            await host.decide(decide, correlation_id="corr-3"): (Command.DECIDE, decide),
            await host.cancel(cancel): (Command.CANCEL, cancel),
        }
    assert "start-1" in sent
    assert len(sent) == 4  # fresh ids where none was given

    got = await seen.wait_ids(set(sent))
    for message in got:
        command, body = sent[message.message_id or ""]
        # Keyed by the body's scope, which is what the broker's topic permissions confine.
        assert (
            message.routing_key == message.type == command.key(scope) == f"{command.value}.{scope.app}.{scope.tenant}"
        )
        assert message.body == body.model_dump_json().encode()
        assert message.content_type == "application/json"
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert message.headers[SCHEMA_VERSION_HEADER] == SCHEMA_VERSION
        # The connection's own user, which RabbitMQ checked.
        assert message.user_id == "guest"
    by_id = {m.message_id: m for m in got}
    assert by_id["start-1"].correlation_id == "corr-1"
    assert by_id["start-1"].headers[TRACEPARENT_HEADER] == TRACEPARENT
    decided = next(m for m in got if m.type == Command.DECIDE.key(scope))
    assert decided.correlation_id == "corr-3"
    assert TRACEPARENT_HEADER not in decided.headers

    # The commands also sit in the topology's quorum queues, where the consumers read them.
    connection = await amqp_connect(amqp_url, "inspect")
    channel = await connection.channel()
    for command in (Command.START, Command.RESUME, Command.DECIDE, Command.CANCEL):
        queue = await channel.declare_queue(command.queue, passive=True)
        assert queue.declaration_result.message_count == 1, command


async def test_a_command_no_queue_takes_fails_loudly(
    scope: Scope, amqp_vhost: Vhost, amqp_connect: ConnectionFactory
) -> None:
    # A vhost with the commands exchange but no queues bound: mandatory publishing returns the command.
    connection = await amqp_connect(amqp_vhost.url(), "bare")
    channel = await connection.channel()
    await channel.declare_exchange(COMMANDS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
    host = HostClient(connection, user_id="guest")
    try:
        with pytest.raises(PublishFailed):
            await host.cancel(CancelCommand(scope=scope, run_id="run-1"))
    finally:
        await host.close()


async def test_bus_reply_carries_the_bus_user_and_rabbitmq_refuses_a_forged_one(
    scope: Scope,
    rabbit: Broker,
    amqp_vhost: Vhost,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
) -> None:
    seen = await capture(amqp_url, COMMANDS_EXCHANGE, Command.REPLY.binding)
    version = ClaimVersion(run_id="run-1", suspension_id=7, run_revision=3)
    reply_input = json.dumps({"performative": "inform", "sender": "peer", "content": "ok \u00e9"})

    # A host, logged in as itself, claims to be the bus.
    forger = BusClient(await amqp_connect(amqp_vhost.url(rabbit.host), "forger"), user_id=rabbit.bus.name)
    try:
        with pytest.raises(PublishFailed) as refused:
            await forger.reply(scope, version, "tok-1", reply_input, message_id="forged")
    finally:
        await forger.close()
    cause = refused.value.__cause__
    assert isinstance(cause, aiormq.exceptions.ChannelPreconditionFailed)
    assert "user_id" in str(cause)

    async with await BusClient.connect(amqp_vhost.url(rabbit.bus), name="test bus") as bus:
        sent = await bus.reply(scope, version, "tok-1", reply_input, correlation_id="q-1")

    (message,) = await seen.wait_ids({sent})
    assert message.user_id == rabbit.bus.name
    assert message.type == message.routing_key == Command.REPLY.key(scope)
    assert message.correlation_id == "q-1"
    body = json.loads(message.body)
    assert body["input"] == reply_input
    assert body["reply_with"] == "tok-1"
    # The forged reply never reached a queue: the genuine one is the only message there.
    assert seen.ids() == [sent]


async def test_host_subscription_hears_its_scope_only_typed(
    stores: Stores,
    scope: Scope,
    other_scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    relay: OutboxRelay,
) -> None:
    host = HostClient(await amqp_connect(amqp_url, "host"), user_id="guest")
    try:
        async with host.subscribe(scope) as everything, host.subscribe(scope, {EventKind.NOTICE}) as notices_only:
            await paused_run(stores, other_scope)
            paused = await paused_run(stores, scope, reason=SuspendReason.APPROVAL, approvers=["alice"])
            await reject(stores, other_scope, "cmd-other")
            run, held = await running_run(stores, scope)
            await writes(stores, scope).runs.end_run(
                run.id, held.owner, RunEventKind.COMPLETED, output="done", correlation_id="cmd-end"
            )
            rejected_id = await reject(stores, scope, "cmd-bad")
            assert await relay.run_once() == 5

            got = [await next_of(everything) for _ in range(3)]
            notice, ended, rejected = (r.event for r in got)
            assert isinstance(notice, Notice)
            assert notice.run_id == paused.run.id
            assert notice.scope == scope
            assert notice.checkpoint_id is not None
            assert notice.approvers == ["alice"]
            assert isinstance(ended, RunEvent)
            assert (ended.run_id, ended.kind, ended.output) == (run.id, RunEventKind.COMPLETED, "done")
            assert got[1].correlation_id == "cmd-end"
            assert isinstance(rejected, CommandRejected)
            assert (rejected.message_id, rejected.code) == ("cmd-bad", "not_suspended")
            assert got[2].message_id == rejected_id
            assert all(r.event.scope == scope for r in got)

            only = await next_of(notices_only)
            assert isinstance(only.event, Notice)
            assert only.message_id == got[0].message_id
            # The other tenant's events were never routed here; the run and rejection events not to the
            # notices-only subscription. A marker sent last arrives next, proving nothing else is queued.
            marker = await paused_run(stores, scope)
            assert await relay.run_once() == 1
            assert (await next_of(everything)).event.run_id == marker.run.id
            assert (await next_of(notices_only)).event.run_id == marker.run.id
    finally:
        await host.close()


async def test_subscription_drops_a_republished_message_id(
    stores: Stores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    relay: OutboxRelay,
) -> None:
    host = HostClient(await amqp_connect(amqp_url, "host"), user_id="guest")
    try:
        async with host.subscribe(scope, {EventKind.NOTICE}) as notices:
            first = await paused_run(stores, scope)
            assert await relay.run_once() == 1
            delivered = await next_of(notices)
            assert delivered.event.run_id == first.run.id

            # As after a relay crash between the confirm and the commit: the row is published again.
            con = await asyncpg.connect(database_url)
            try:
                await con.execute("UPDATE outbox SET sent_at = NULL")
            finally:
                await con.close()
            second = await paused_run(stores, scope)
            assert await relay.run_once() == 2

            after = await next_of(notices)
            assert after.event.run_id == second.run.id
            assert after.message_id != delivered.message_id
    finally:
        await host.close()


async def test_bus_subscription_hears_agent_reply_notices_of_every_scope(
    stores: Stores,
    scope: Scope,
    other_scope: Scope,
    rabbit: Broker,
    amqp_vhost: Vhost,
    amqp_url: str,
    relay: OutboxRelay,
) -> None:
    bus = await BusClient.connect(amqp_vhost.url(rabbit.bus), name="test bus")
    async with bus, bus.subscribe() as every_scope, bus.subscribe(other_scope) as one_scope:
        await paused_run(stores, scope, reason=SuspendReason.EXTERNAL_TOOL)
        mine = await paused_run(stores, scope, reason=SuspendReason.AGENT_REPLY)
        await paused_run(stores, scope, reason=SuspendReason.APPROVAL)
        theirs = await paused_run(stores, other_scope, reason=SuspendReason.AGENT_REPLY)
        assert await relay.run_once() == 4

        heard = [(await next_of(every_scope)).event for _ in range(2)]
        assert [(n.run_id, n.scope, n.reason) for n in heard] == [
            (mine.run.id, scope, SuspendReason.AGENT_REPLY),
            (theirs.run.id, other_scope, SuspendReason.AGENT_REPLY),
        ]
        assert (await next_of(one_scope)).event.run_id == theirs.run.id
        # What the bus answers with: the pause's own pin.
        assert version_of(heard[0]) == ClaimVersion(
            run_id=mine.run.id, suspension_id=mine.suspension.id, run_revision=mine.revision
        )
