"""Tenants confined by the broker (docs/contracts.md, "Who may publish and read what").

Real RabbitMQ users, granted their scopes by ``intermission grant``'s own code (and once by the
``rabbitmqctl`` lines it prints): what a user confined to scope A cannot do is refused by RabbitMQ itself
(publishing another scope's key or the bare key, binding ``#`` or another scope's keys, publishing an
event); what it can get past the broker (a body naming another scope under its own key) the worker refuses
``forbidden``, telling only A, with the other tenant's run untouched.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import uuid
from typing import Any

import aio_pika
import aiormq
import pytest

from intermission.fleet.worker import Worker
from intermission.ops.grants import rabbitmqctl_lines
from intermission.publishers.amqp import ConfirmingPublisher, PublishFailed
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import CancelCommand, ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from intermission.wire import COMMANDS_EXCHANGE, EVENTS_EXCHANGE, Command, message
from tests.support.amqp import AmqpUser, Broker, CaptureFactory, ConnectionFactory, Vhost
from tests.support.confined import Confiner
from tests.support.waiting import eventually

WAIT = 20.0
LOOKUP = {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}


def start(scope: Scope, *turns: dict[str, Any]) -> StartCommand:
    return StartCommand(
        scope=scope,
        run_id=f"run-{uuid.uuid4().hex[:12]}",
        agent_id="demo",
        input="hi",
        script=[ScriptTurn.model_validate(t) for t in turns],
    )


async def refused_publish(url: str, exchange: str, routing_key: str, amqp_connect: ConnectionFactory) -> str:
    """Publish as the URL's user and return the broker's refusal (the test fails if it takes the message)."""
    publisher = ConfirmingPublisher(await amqp_connect(url, f"publish {routing_key}"), exchange, mandatory=False)
    try:
        with pytest.raises(PublishFailed) as refused:
            await publisher.publish(message(b"{}", message_id=str(uuid.uuid4()), routing_key=routing_key), routing_key)
    finally:
        await publisher.close()
    cause = refused.value.__cause__
    assert isinstance(cause, aiormq.exceptions.ChannelAccessRefused), repr(cause)
    return str(cause)


async def refused_binding(url: str, user: AmqpUser, binding: str, amqp_connect: ConnectionFactory) -> str:
    connection = await amqp_connect(url, f"bind {binding}")
    channel = await connection.channel()
    queue = await channel.declare_queue(f"{user.name}.probe-{uuid.uuid4().hex[:6]}", exclusive=True)
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused) as refused:
        await queue.bind(EVENTS_EXCHANGE, routing_key=binding)
    return str(refused.value)


async def victim_rows(stores: Stores, run_id: str) -> dict[str, Any]:
    async with stores.db.connection() as con:
        run = await con.raw.fetchrow(
            "SELECT state::text, revision, lease_owner, updated_at FROM runs WHERE id = $1", run_id
        )
        pauses = await con.raw.fetch("SELECT * FROM suspensions WHERE run_id = $1 ORDER BY id", run_id)
        outbox = await con.raw.fetchval("SELECT count(*) FROM outbox WHERE run_id = $1", run_id)
    return {"run": dict(run or {}), "suspensions": [dict(p) for p in pauses], "outbox": outbox}


async def test_the_broker_refuses_a_confined_host_everything_outside_its_scope(
    amqp_url: str,
    amqp_vhost: Vhost,
    confiner: Confiner,
    amqp_connect: ConnectionFactory,
    scope: Scope,
    other_scope: Scope,
) -> None:
    user = await confiner.confined(scope)
    url = amqp_vhost.url(user)

    # Another scope's key, the bare key: RabbitMQ's topic permission refuses the publish.
    other_key = Command.RESUME.key(other_scope)
    answer = await refused_publish(url, COMMANDS_EXCHANGE, other_key, amqp_connect)
    assert "ACCESS_REFUSED" in answer
    assert other_key in answer
    answer = await refused_publish(url, COMMANDS_EXCHANGE, Command.CANCEL.value, amqp_connect)
    assert "ACCESS_REFUSED" in answer
    # No event can be forged: no write on intermission.events at all.
    answer = await refused_publish(url, EVENTS_EXCHANGE, f"run.completed.{scope.routing_suffix()}", amqp_connect)
    assert "ACCESS_REFUSED" in answer
    assert EVENTS_EXCHANGE in answer
    # Nor any command exchange but its own scope's keys, nor the default exchange.
    answer = await refused_publish(url, "", "intermission.resume", amqp_connect)
    assert "ACCESS_REFUSED" in answer

    # Hearing everything, or another scope: the topic read permission refuses the binding.
    for binding in (
        "#",
        f"notice.*.{other_scope.routing_suffix()}",
        f"command.rejected.{other_scope.routing_suffix()}",
    ):
        answer = await refused_binding(url, user, binding, amqp_connect)
        assert "ACCESS_REFUSED" in answer, binding

    # What it was granted works: its own scope's commands and its own events, from its durable queue or a
    # throwaway one (both named after it: <user>.<app>.<tenant>, <user>.exclusive-<hex>).
    async with await HostClient.connect(url, name="confined host") as host:
        await host.cancel(CancelCommand(scope=scope, run_id="run-1"))
        async with host.subscribe(scope) as durable:
            assert durable.queue_name == f"{user.name}.{scope.app}.{scope.tenant}"
        async with host.subscribe(scope, exclusive=True) as throwaway:
            assert throwaway.queue_name.startswith(f"{user.name}.exclusive-")


async def test_a_command_keyed_for_one_scope_with_another_scopes_body_is_forbidden_and_told_only_to_its_sender(
    worker: Worker,
    stores: Stores,
    host: HostClient,
    amqp_vhost: Vhost,
    confiner: Confiner,
    capture: CaptureFactory,
    amqp_url: str,
    scope: Scope,
    other_scope: Scope,
) -> None:
    # The victim: a run of another tenant, paused on an external tool.
    victim = start(other_scope, LOOKUP, {"say": "done"})
    async with host.subscribe(other_scope) as theirs:
        await host.start(victim)
        async with asyncio.timeout(WAIT):
            async for received in theirs:
                if isinstance(received.event, Notice) and received.event.run_id == victim.run_id:
                    notice = received.event
                    break
    before = await victim_rows(stores, victim.run_id)
    their_stream = await capture(amqp_url, EVENTS_EXCHANGE, f"*.*.{other_scope.routing_suffix()}")

    # The attacker, confined to its own scope, sends a resume keyed for itself with the victim's body.
    attacker = await confiner.confined(scope, prefix="mallory")
    forged = ResumeCommand(
        scope=other_scope,
        version=version_of(notice),
        results=[ToolAnswer(call_id=notice.pending[0].id, content="forged")],
    )
    mid = f"forged-{uuid.uuid4()}"
    connection = await aio_pika.connect_robust(amqp_vhost.url(attacker))
    try:
        publisher = ConfirmingPublisher(connection, COMMANDS_EXCHANGE, mandatory=True)
        async with HostClient(connection, user_id=attacker.name).subscribe(scope) as mine:
            key = Command.RESUME.key(scope)
            outgoing = message(forged.model_dump_json(), message_id=mid, routing_key=key, user_id=attacker.name)
            await publisher.publish(outgoing, key)
            async with asyncio.timeout(WAIT):
                async for received in mine:
                    if isinstance(received.event, CommandRejected) and received.event.message_id == mid:
                        refusal = received
                        break
        await publisher.close()
    finally:
        await connection.close()

    assert isinstance(refusal.event, CommandRejected)
    assert refusal.event.code == "forbidden"
    assert refusal.routing_key == f"command.rejected.{scope.routing_suffix()}"
    assert refusal.event.scope == scope
    assert other_scope.routing_suffix() in refusal.event.detail

    assert await victim_rows(stores, victim.run_id) == before
    assert before["run"]["state"] == RunState.PAUSED.value
    assert [s["id"] for s in before["suspensions"]] == [notice.suspension_id]
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM inbox WHERE message_id = $1", mid) == 0
    # The victim's stream heard nothing of it; a real resume of theirs still works afterwards.
    await host.resume(forged.model_copy(update={"results": [ToolAnswer(call_id=notice.pending[0].id, content="42")]}))
    seen = await their_stream.wait_for(
        lambda got: any((m.routing_key or "").startswith("run.completed.") for m in got), what="the victim's completion"
    )
    assert not [m for m in seen if m.correlation_id == mid or mid in m.body.decode(errors="replace")]


async def test_a_confined_host_serves_its_own_scope_end_to_end(
    worker: Worker, stores: Stores, amqp_vhost: Vhost, confiner: Confiner, scope: Scope
) -> None:
    user = await confiner.confined(scope)
    cmd = start(scope, LOOKUP, {"say": "done"})
    async with (
        await HostClient.connect(amqp_vhost.url(user), name="confined host") as host,
        host.subscribe(scope) as events,
    ):
        await host.start(cmd)
        kinds: list[str] = []
        async with asyncio.timeout(WAIT):
            async for received in events:
                event = received.event
                if isinstance(event, Notice) and event.run_id == cmd.run_id:
                    kinds.append("notice")
                    await host.resume(
                        ResumeCommand(
                            scope=scope,
                            version=version_of(event),
                            results=[ToolAnswer(call_id=event.pending[0].id, content="42")],
                        )
                    )
                elif isinstance(event, RunEvent) and event.run_id == cmd.run_id:
                    kinds.append(event.kind.value)
                    if event.kind is RunEventKind.COMPLETED:
                        break
    assert kinds == ["notice", "resumed", "completed"]
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "done")


async def test_revoke_takes_a_scope_away_at_once_and_leaves_the_others(
    amqp_url: str,
    amqp_vhost: Vhost,
    confiner: Confiner,
    amqp_connect: ConnectionFactory,
    scope: Scope,
    other_scope: Scope,
) -> None:
    user = await confiner.confined(scope, other_scope)
    grants = confiner.management.grants(amqp_vhost.name)
    try:
        assert sorted(await grants.scopes(user.name), key=str) == sorted([scope, other_scope], key=str)
        assert (await grants.all_grants())[user.name] == await grants.scopes(user.name)

        # A connection opened while both scopes were granted, publishing for the one about to go.
        early = await aio_pika.connect_robust(amqp_vhost.url(user), client_properties={"connection_name": "early"})
        client = HostClient(early, user_id=user.name)
        await client.cancel(CancelCommand(scope=other_scope, run_id="run-1"))
        # And a durable subscription to the scope about to go, whose queue outlives the connection.
        async with client.subscribe(other_scope):
            pass
        queue = f"{user.name}.{other_scope.app}.{other_scope.tenant}"
        assert await confiner.event_bindings(queue), "the subscription bound its queue"

        async def listed() -> bool:
            return bool(await confiner.connections_of(user.name))

        await eventually(listed, within=WAIT, what="the early connection in the management API")
        assert await grants.revoke(user.name, other_scope) == [scope]

        # The early connection was closed by the revocation: nothing published before it goes on.
        async def gone() -> bool:
            return early.is_closed or not early.connected.is_set()

        await eventually(gone, within=WAIT, what="the early connection closed")
        # Its queue hears nothing more of the revoked scope: a binding is never checked again by the broker.
        assert await confiner.event_bindings(queue) == []
        await client.close()
        await early.close()
    finally:
        await grants.close()

    # New publishes: the revoked scope is refused, the kept one still taken.
    answer = await refused_publish(
        amqp_vhost.url(user), COMMANDS_EXCHANGE, Command.CANCEL.key(other_scope), amqp_connect
    )
    assert "ACCESS_REFUSED" in answer
    async with await HostClient.connect(amqp_vhost.url(user), name="after revoke") as host:
        await host.cancel(CancelCommand(scope=scope, run_id="run-1"))


async def test_the_rabbitmqctl_lines_grant_the_same_permissions(
    amqp_url: str,
    amqp_vhost: Vhost,
    confiner: Confiner,
    rabbit: Broker,
    amqp_connect: ConnectionFactory,
    scope: Scope,
    other_scope: Scope,
) -> None:
    by_tool = await confiner.confined(scope, prefix="by-tool")
    by_hand = await confiner.add_user("by-hand")
    for line in rabbitmqctl_lines(by_hand.name, [scope], amqp_vhost.name):
        argv = shlex.split(line)
        assert argv[0] == "rabbitmqctl"
        await rabbit.run(*argv[1:])

    async def permissions(user: str, kind: str) -> list[dict[str, Any]]:
        response = await confiner.http.get(f"/api/users/{user}/{kind}")
        response.raise_for_status()
        # Each user's own queues are in its patterns, under its own name.
        rows = [{k: v.replace(re.escape(user), "<user>") for k, v in r.items() if k != "user"} for r in response.json()]
        return sorted(rows, key=lambda r: str(sorted(r.items())))

    for kind in ("permissions", "topic-permissions"):
        made_by_tool = await permissions(by_tool.name, kind)
        assert made_by_tool == await permissions(by_hand.name, kind) != [], kind

    answer = await refused_publish(
        amqp_vhost.url(by_hand), COMMANDS_EXCHANGE, Command.START.key(other_scope), amqp_connect
    )
    assert "ACCESS_REFUSED" in answer


async def test_two_tenants_using_one_message_id_send_two_commands(
    worker: Worker, stores: Stores, amqp_vhost: Vhost, confiner: Confiner, scope: Scope, other_scope: Scope
) -> None:
    # Message ids are idempotency keys within a scope: one tenant cannot pre-empt another's ids.
    shared = f"start-{uuid.uuid4()}"
    starts = {s: start(s, {"say": f"done in {s.tenant}"}) for s in (scope, other_scope)}
    for s, command in starts.items():
        user = await confiner.confined(s)
        async with await HostClient.connect(amqp_vhost.url(user), name=f"host of {s}") as host:
            assert await host.start(command, message_id=shared) == shared

    async def both_recorded() -> bool:
        async with stores.db.connection() as con:
            rows = await con.raw.fetch(
                "SELECT app, tenant, run_id FROM inbox WHERE message_id = $1 ORDER BY tenant", shared
            )
        return len(rows) == 2

    await eventually(both_recorded, within=WAIT, what="both starts recorded")
    for s, command in starts.items():

        async def completed(s: Scope = s, run_id: str = command.run_id) -> bool:
            return (await stores.at(s).runs.get_run(run_id)).state is RunState.COMPLETED

        await eventually(completed, within=WAIT, what=f"{s}'s run completed")
        run = await stores.at(s).runs.get_run(command.run_id)
        assert run.output == f"done in {s.tenant}"
