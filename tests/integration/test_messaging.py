"""The whole product through the real RabbitMQ and PostgreSQL: hosts, approvers and the bus drive runs
with commands and hear every pause; duplicates have one effect; bad input is refused, dead-lettered and
changes nothing; a broker restart loses no Notice."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika

from intermission.fleet.worker import Worker
from intermission.publishers.clients import BusClient, HostClient, Received, Subscription, version_of
from intermission.schemas.commands import DecideCommand, Decision, ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store import Stores
from intermission.wire import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    ERROR_HEADER,
    EVENTS_EXCHANGE,
    SCHEMA_VERSION_HEADER,
    Command,
)
from tests.support.amqp import AmqpUser, Broker, CaptureFactory, Vhost
from tests.support.fleet import outbox_keys
from tests.support.waiting import eventually

WAIT = 20.0


def script(*turns: dict[str, Any]) -> list[ScriptTurn]:
    return [ScriptTurn.model_validate(t) for t in turns]


def start(scope: Scope, *turns: dict[str, Any], **changes: Any) -> StartCommand:
    body: dict[str, Any] = {
        "scope": scope,
        "run_id": f"run-{uuid.uuid4().hex[:12]}",
        "agent_id": "demo",
        "input": "hi",
        "script": script(*turns),
    }
    body.update(changes)
    return StartCommand(**body)


LOOKUP = {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}


async def next_event(
    events: Subscription[Any], wanted: Callable[[Received[Any]], bool], *, within: float = WAIT
) -> Received[Any]:
    async with asyncio.timeout(within):
        async for received in events:
            if wanted(received):
                return received
    raise AssertionError("the subscription ended")


def notice_for(run_id: str) -> Callable[[Received[Any]], bool]:
    return lambda r: isinstance(r.event, Notice) and r.event.run_id == run_id


def run_event(run_id: str, kind: RunEventKind) -> Callable[[Received[Any]], bool]:
    return lambda r: isinstance(r.event, RunEvent) and r.event.run_id == run_id and r.event.kind is kind


def rejection_of(message_id: str) -> Callable[[Received[Any]], bool]:
    return lambda r: isinstance(r.event, CommandRejected) and r.event.message_id == message_id


async def one_run_served(host: HostClient, scope: Scope, *, within: float = 30.0) -> str:
    """A run of ``scope`` started, paused on a tool result, answered and completed, through ``host``: what a
    tenant whose worker still serves it sees. Returns its id."""
    cmd = start(scope, LOOKUP, {"say": "done"})
    async with host.subscribe(scope) as subscription:
        await host.start(cmd)
        notice = (await next_event(subscription, notice_for(cmd.run_id), within=within)).event
        answer = ToolAnswer(call_id=notice.pending[0].id, content="42")
        await host.resume(ResumeCommand(scope=scope, version=version_of(notice), results=[answer]))
        await next_event(subscription, run_event(cmd.run_id, RunEventKind.COMPLETED), within=within)
    return cmd.run_id


async def queue_depths(rabbit: Broker, vhost: Vhost) -> dict[str, int]:
    """Ready plus unacknowledged messages per queue, as the broker counts them."""
    out = await rabbit.run("list_queues", "-p", vhost.name, "name", "messages", "--no-table-headers")
    depths: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            depths[parts[0]] = int(parts[1])
    return depths


async def commands_settled(rabbit: Broker, vhost: Vhost) -> None:
    """Every command queue is empty and nothing is unacknowledged: every command was fully handled."""

    async def settled() -> bool:
        depths = await queue_depths(rabbit, vhost)
        return all(depths.get(c.queue, 0) == 0 for c in Command)

    await eventually(settled, within=WAIT, what="every command acknowledged")


async def test_external_tool_end_to_end(stores: Stores, scope: Scope, worker: Worker, host: HostClient) -> None:
    cmd = start(scope, LOOKUP, {"say": "done"})
    async with host.subscribe(scope) as events:
        start_id = await host.start(cmd)
        notice = await next_event(events, notice_for(cmd.run_id))
        assert notice.correlation_id == start_id
        assert notice.routing_key == f"notice.external_tool.{scope.app}.{scope.tenant}"
        n = notice.event
        assert isinstance(n, Notice)
        assert [p.name for p in n.pending] == ["lookup"]
        resume_id = await host.resume(
            ResumeCommand(
                scope=scope, version=version_of(n), results=[ToolAnswer(call_id=n.pending[0].id, content="42")]
            )
        )
        resumed = await next_event(events, run_event(cmd.run_id, RunEventKind.RESUMED))
        completed = await next_event(events, run_event(cmd.run_id, RunEventKind.COMPLETED))
    assert resumed.correlation_id == resume_id
    assert completed.correlation_id == resume_id
    assert isinstance(completed.event, RunEvent)
    assert completed.event.output == "done"
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "done")
    # The run.resumed event was published from memory; its row is marked sent once its confirm is in.
    await worker.drain()
    async with stores.db.connection() as con:
        recorded = await con.raw.fetch("SELECT message_id FROM inbox WHERE run_id = $1 ORDER BY recorded_at", run.id)
        assert [r["message_id"] for r in recorded] == [start_id, resume_id]
        assert await con.raw.fetchval("SELECT count(*) FROM outbox WHERE run_id = $1 AND sent_at IS NULL", run.id) == 0


async def test_approval_end_to_end_with_a_listed_approver(
    stores: Stores, scope: Scope, worker: Worker, host: HostClient, rabbit: Broker
) -> None:
    email = {"to": "cfo@example.com", "subject": "Q3", "approvers": [rabbit.host.name]}
    cmd = start(scope, {"call": [{"tool": "send_email", "arguments": email}]})
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        n = (await next_event(events, notice_for(cmd.run_id))).event
        assert isinstance(n, Notice)
        assert (n.reason, n.approvers) == (SuspendReason.APPROVAL, [rabbit.host.name])
        assert n.checkpoint_id is not None
        await host.decide(
            DecideCommand(scope=scope, version=version_of(n), checkpoint_id=n.checkpoint_id, decision=Decision.APPROVE)
        )
        completed = await next_event(events, run_event(cmd.run_id, RunEventKind.COMPLETED))
    assert isinstance(completed.event, RunEvent)
    assert completed.event.output == "sent"
    async with stores.db.connection() as con:
        decided_by = await con.raw.fetchval("SELECT decided_by FROM checkpoints WHERE id = $1", n.checkpoint_id)
    assert decided_by == rabbit.host.name  # the broker-validated sender, not anything the body said


async def test_agent_reply_end_to_end_through_the_bus(
    stores: Stores, scope: Scope, worker: Worker, host: HostClient, bus: BusClient
) -> None:
    cmd = start(scope, {"call": [{"tool": "ask_agent", "arguments": {"agent": "pricer", "question": "?"}}]})
    reply = json.dumps({"performative": "inform", "sender": "pricer", "content": "42"})
    async with host.subscribe(scope) as events, bus.subscribe() as asks:
        await host.start(cmd)
        ask = await next_event(asks, notice_for(cmd.run_id))
        n = ask.event
        assert isinstance(n, Notice)
        await bus.reply(scope, version_of(n), n.pending[0].reply_with, reply)
        completed = await next_event(events, run_event(cmd.run_id, RunEventKind.COMPLETED))
    assert isinstance(completed.event, RunEvent)
    assert completed.event.output == reply
    admission = await stores.at(scope).resume.get_resume_admission(cmd.run_id, n.suspension_id)
    assert admission.request.input == reply.encode()


async def test_the_same_command_twice_has_one_effect(
    stores: Stores, scope: Scope, worker: Worker, host: HostClient, rabbit: Broker, amqp_vhost: Vhost
) -> None:
    cmd = start(scope, LOOKUP, {"say": "done"})
    async with host.subscribe(scope) as events:
        start_id = await host.start(cmd)
        await host.start(cmd, message_id=start_id)  # the same message again
        await host.start(cmd)  # the same start under a new id: a no-op too
        n = (await next_event(events, notice_for(cmd.run_id))).event
        assert isinstance(n, Notice)
        resume = ResumeCommand(
            scope=scope, version=version_of(n), results=[ToolAnswer(call_id=n.pending[0].id, content="x")]
        )
        resume_id = await host.resume(resume)
        await host.resume(resume, message_id=resume_id)
        await next_event(events, run_event(cmd.run_id, RunEventKind.COMPLETED))
        await commands_settled(rabbit, amqp_vhost)
        await worker.drain()
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert keys == [
        f"notice.external_tool.{scope.app}.{scope.tenant}",
        f"run.resumed.{scope.app}.{scope.tenant}",
        f"run.completed.{scope.app}.{scope.tenant}",
    ]
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM inbox WHERE run_id = $1", cmd.run_id) == 3
    # A duplicate is acknowledged quietly: no refusal, nothing dead-lettered.
    assert (await queue_depths(rabbit, amqp_vhost)).get("intermission.dead", 0) == 0


async def test_bad_commands_are_refused_dead_lettered_and_change_nothing(
    stores: Stores,
    scope: Scope,
    other_scope: Scope,
    worker: Worker,
    host: HostClient,
    rabbit: Broker,
    amqp_vhost: Vhost,
    amqp_connect: Any,
    capture: CaptureFactory,
) -> None:
    dead = await capture(amqp_vhost.url(), DEAD_EXCHANGE, "")
    refusals = await capture(amqp_vhost.url(), EVENTS_EXCHANGE, "command.rejected.#")
    ext = start(scope, LOOKUP, {"say": "done"})
    appr = start(scope, {"call": [{"tool": "send_email", "arguments": {"approvers": ["somebody-else"]}}]})
    ask = start(scope, {"call": [{"tool": "ask_agent", "arguments": {"agent": "a", "question": "q"}}]})
    async with host.subscribe(scope) as events:
        notices: dict[str, Notice] = {}
        for cmd in (ext, appr, ask):
            await host.start(cmd)
            n = (await next_event(events, notice_for(cmd.run_id))).event
            assert isinstance(n, Notice)
            notices[cmd.run_id] = n
        before = await rows_of(stores, [ext.run_id, appr.run_id, ask.run_id])

        as_host = await raw_publisher(amqp_connect, amqp_vhost, rabbit.host.name, rabbit.host.password)
        as_bus = await raw_publisher(amqp_connect, amqp_vhost, rabbit.bus.name, rabbit.bus.password)
        n_ext, n_appr, n_ask = notices[ext.run_id], notices[appr.run_id], notices[ask.run_id]
        good_resume = ResumeCommand(
            scope=scope, version=version_of(n_ext), results=[ToolAnswer(call_id=n_ext.pending[0].id, content="ok")]
        )
        good = good_resume.model_dump_json().encode()
        bad_scope = json.loads(good)
        bad_scope["scope"] = {"app": "no dots.allowed", "tenant": "t"}
        assert n_appr.checkpoint_id is not None
        not_an_approver = DecideCommand(
            scope=scope, version=version_of(n_appr), checkpoint_id=n_appr.checkpoint_id, decision=Decision.APPROVE
        )
        reply = {
            "scope": scope.model_dump(),
            "version": version_of(n_ask).model_dump(),
            "reply_with": n_ask.pending[0].reply_with,
            "input": "{}",
        }
        host_answers_ask = ResumeCommand(
            scope=scope, version=version_of(n_ask), results=[ToolAnswer(call_id=n_ask.pending[0].id)]
        )
        expected = {
            await as_host(Command.RESUME, b"{not json"): "invalid_message",
            await as_host(Command.RESUME, json.dumps({"scope": scope.model_dump()}).encode()): "invalid_message",
            await as_host(Command.RESUME, good, version=2): "unsupported_schema_version",
            await as_host(Command.RESUME, good, version=None): "unsupported_schema_version",
            await as_host(Command.RESUME, json.dumps(bad_scope).encode()): "invalid_scope",
            await as_host(
                Command.RESUME, good_resume.model_copy(update={"scope": other_scope}).model_dump_json().encode()
            ): "not_suspended",
            await host.decide(not_an_approver): "forbidden",
            await as_host(Command.REPLY, json.dumps(reply).encode()): "forbidden",  # a host, not the bus
            await host.resume(host_answers_ask): "not_agent_reply_resumable",
            await as_bus(
                Command.REPLY, json.dumps(dict(reply, input="x" * (8 * 1024 * 1024 + 1))).encode()
            ): "input_too_large",
        }
        # (A message without message_id cannot be sent from here: aiormq gives every publish one. The
        # envelope check that refuses it is covered in tests/unit/test_parsing.py.)

        def refused(got: list[Any]) -> bool:
            return {m.json()["message_id"] for m in got} >= set(expected)

        events_seen = await refusals.wait_for(refused, what="every refusal")
        assert {m.json()["message_id"]: m.json()["code"] for m in events_seen} == expected
        assert all(m.message_id == f"rejected:{m.json()['message_id']}" for m in events_seen)
        letters = await dead.wait_for(lambda got: len(got) >= len(expected), what="dead letters")
        assert {m.message_id: m.headers[ERROR_HEADER] for m in letters} == expected

        await commands_settled(rabbit, amqp_vhost)
        assert await rows_of(stores, [ext.run_id, appr.run_id, ask.run_id]) == before

        # The worker keeps serving.
        await host.resume(good_resume)
        await next_event(events, run_event(ext.run_id, RunEventKind.COMPLETED))


RawPublish = Callable[..., Awaitable[str]]


async def raw_publisher(amqp_connect: Any, vhost: Vhost, user: str, password: str) -> RawPublish:
    """Publish command bodies as given (past the clients' own models), as ``user``."""
    connection = await amqp_connect(vhost.url(AmqpUser(user, password)), f"raw {user}")
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(COMMANDS_EXCHANGE)

    async def publish(key: Command, body: bytes, *, version: int | None = 1) -> str:
        chosen = str(uuid.uuid4())
        await exchange.publish(
            aio_pika.Message(
                body,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=chosen,
                type=key.value,
                headers={} if version is None else {SCHEMA_VERSION_HEADER: version},
                user_id=user,
            ),
            routing_key=key.value,
        )
        return chosen

    return publish


async def rows_of(stores: Stores, run_ids: list[str]) -> dict[str, Any]:
    async with stores.db.connection() as con:
        raw = con.raw
        return {
            "runs": [
                dict(r)
                for r in await raw.fetch(
                    "SELECT id, state, revision, lease_owner, updated_at FROM runs WHERE id = ANY($1) ORDER BY id",
                    run_ids,
                )
            ],
            "suspensions": [
                dict(r)
                for r in await raw.fetch("SELECT * FROM suspensions WHERE run_id = ANY($1) ORDER BY id", run_ids)
            ],
            "progress": await raw.fetchval("SELECT count(*) FROM progress WHERE run_id = ANY($1)", run_ids),
            "inbox": await raw.fetchval(
                "SELECT count(*) FROM inbox WHERE run_id = ANY($1) AND routing_key <> 'run.start'", run_ids
            ),
            "admissions": await raw.fetchval("SELECT count(*) FROM resume_admissions WHERE run_id = ANY($1)", run_ids),
            "checkpoints": [
                dict(r)
                for r in await raw.fetch(
                    "SELECT id, state FROM checkpoints WHERE run_id = ANY($1) ORDER BY id", run_ids
                )
            ],
        }
