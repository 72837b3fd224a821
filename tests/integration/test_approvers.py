"""Who may decide an approval (docs/contracts.md, "Commands"): named by the host, never by the model.

``run.start``'s config names approvers per tool (``RunConfig.approvers``); a call's own ``approvers``
argument (the demo's ``send_email``, i.e. the model's word) may only narrow that list; with no list anyone
who may publish for the scope decides. A decision always carries the broker-validated ``user_id`` of its
decider, which the checkpoint records. Against the real database and the agent loop under a lease, and once
end to end through RabbitMQ with the test users the fixtures provide.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from intermission.fleet.worker import Worker as RunningWorker
from intermission.publishers.clients import HostClient, Received, Subscription, version_of
from intermission.schemas.commands import DecideCommand, Decision, ResumeCommand, ToolAnswer
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import Forbidden
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Notice, SuspendReason, Suspension
from intermission.store import Stores
from intermission.wire import COMMANDS_EXCHANGE, Command, command_message
from tests.support.amqp import Broker, ConnectionFactory, Vhost
from tests.support.fleet import Worker, fast_settings, outbox_bodies, start_command, worker
from tests.support.inspect import Inspector

WAIT = 20.0
EMAIL = {"to": "cfo@example.com", "subject": "Q3", "body": "numbers"}


@pytest.fixture
async def w(stores: Stores, database_url: str) -> AsyncIterator[Worker]:
    one = worker(stores, fast_settings(database_url))
    yield one
    await one.fleet.stop(grace=5)


def email(approvers: list[str] | None = None) -> dict[str, Any]:
    """A send_email call; ``approvers`` is the list the model puts in its arguments."""
    arguments: dict[str, Any] = dict(EMAIL)
    if approvers is not None:
        arguments["approvers"] = approvers
    return {"tool": "send_email", "arguments": arguments}


def hosts(approvers: dict[str, list[str]] | None) -> RunConfig:
    return RunConfig(approvers=approvers or {})


async def paused(stores: Stores, scope: Scope, run_id: str) -> tuple[Suspension, ClaimVersion]:
    s = await stores.at(scope).suspensions.get_suspension(run_id)
    run = await stores.at(scope).runs.get_run(run_id)
    assert run.state is RunState.PAUSED
    assert s.reason is SuspendReason.APPROVAL
    return s, ClaimVersion(run_id=run_id, suspension_id=s.id, run_revision=run.revision)


def approve(scope: Scope, s: Suspension, pin: ClaimVersion) -> DecideCommand:
    assert s.checkpoint_id is not None
    return DecideCommand(scope=scope, version=pin, checkpoint_id=s.checkpoint_id, decision=Decision.APPROVE)


async def decided(db: Inspector, checkpoint_id: int | None) -> tuple[str, str | None]:
    row = await db.con.fetchrow("SELECT state, decided_by FROM checkpoints WHERE id = $1", checkpoint_id)
    assert row is not None
    return row["state"], row["decided_by"]


async def refused_and_nothing_written(
    w: Worker, db: Inspector, decision: DecideCommand, principals: list[str | None]
) -> None:
    """Each of ``principals`` is refused ``forbidden``, and the run stays paused exactly as it was."""
    before = await db.snapshot()
    for who in principals:
        with pytest.raises(Forbidden):
            await w.control.decide(decision, principal=who)
    assert await db.snapshot() == before


@pytest.mark.parametrize(
    ("host_list", "model_list", "deciders", "outsiders", "decider"),
    [
        # The host names alice; the model names only an outsider: the host's list stands.
        (["alice"], ["mallory"], ["alice"], ["mallory", "bob"], "alice"),
        # The model narrows the host's list to one of its names.
        (["alice", "bob"], ["bob"], ["bob"], ["alice", "mallory"], "bob"),
        # No host list: the model's list stands.
        (None, ["carol"], ["carol"], ["alice", "bob"], "carol"),
        # Nobody named anybody: any identity in scope decides.
        (None, None, [], [], "zed"),
    ],
    ids=["host-only", "model-narrows", "model-only", "anyone"],
)
async def test_the_host_names_who_decides_and_the_model_can_only_narrow_it(
    stores: Stores,
    scope: Scope,
    w: Worker,
    db: Inspector,
    host_list: list[str] | None,
    model_list: list[str] | None,
    deciders: list[str],
    outsiders: list[str],
    decider: str,
) -> None:
    config = hosts({"send_email": host_list} if host_list is not None else None)
    cmd = start_command(scope, [{"call": [email(model_list)]}], config=config)
    await w.control.start(cmd)
    await w.drain()
    s, pin = await paused(stores, scope, cmd.run_id)
    assert s.approvers == deciders
    (notice,) = await outbox_bodies(stores, scope, cmd.run_id)
    assert notice["approvers"] == deciders  # what the host is told is what the store enforces

    decision = approve(scope, s, pin)
    # An outsider, and a decision that names nobody: forbidden, the run paused at the same revision.
    await refused_and_nothing_written(w, db, decision, [*outsiders, None, ""])
    assert (await paused(stores, scope, cmd.run_id))[1] == pin

    await w.control.decide(decision, principal=decider)
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "sent")
    assert await decided(db, s.checkpoint_id) == ("approved", decider)


async def test_a_denial_is_a_decision_too_and_needs_a_decider_the_pause_accepts(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    cmd = start_command(scope, [{"call": [email(["mallory"])]}], config=hosts({"send_email": ["alice"]}))
    await w.control.start(cmd)
    await w.drain()
    s, pin = await paused(stores, scope, cmd.run_id)
    deny = approve(scope, s, pin).model_copy(update={"decision": Decision.DENY, "reason": "not now"})
    await refused_and_nothing_written(w, db, deny, ["mallory", None])
    await w.control.decide(deny, principal="alice")
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.error) == (RunState.FAILED, "not now")
    assert await decided(db, s.checkpoint_id) == ("denied", "alice")


async def test_calls_of_one_turn_pause_together_only_under_a_decider_every_one_of_them_accepts(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    # The first two calls share bob; the third shares nobody with them and pauses on its own afterwards,
    # so that neither bob decides it nor dave the first two.
    turn = {"call": [email(["alice", "bob"]), email(["bob", "carol"]), email(["dave"])]}
    cmd = start_command(scope, [turn, {"say": "all sent"}])
    await w.control.start(cmd)
    await w.drain()
    first, pin = await paused(stores, scope, cmd.run_id)
    assert [p.id for p in first.pending] == ["call-0-0", "call-0-1"]
    assert first.approvers == ["bob"]
    # alice and carol are each acceptable to one call only: one decision answers both calls.
    await refused_and_nothing_written(w, db, approve(scope, first, pin), ["alice", "carol", "dave"])
    await w.control.decide(approve(scope, first, pin), principal="bob")
    await w.drain()

    second, pin2 = await paused(stores, scope, cmd.run_id)
    assert [p.id for p in second.pending] == ["call-0-2"]
    assert second.approvers == ["dave"]
    await refused_and_nothing_written(w, db, approve(scope, second, pin2), ["bob", "alice"])
    await w.control.decide(approve(scope, second, pin2), principal="dave")
    await w.drain()

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "all sent")
    assert await decided(db, first.checkpoint_id) == ("approved", "bob")
    assert await decided(db, second.checkpoint_id) == ("approved", "dave")
    sent = await db.con.fetchval(
        "SELECT count(*) FROM session_messages WHERE run_id = $1 AND message->>'role' = 'tool'"
        " AND message->>'content' = 'sent'",
        cmd.run_id,
    )
    assert sent == 3  # every call ran once, each approved by someone it accepted


async def test_a_host_list_keeps_calls_that_name_different_hosts_apart(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    # Each call narrows the host's list to a different name: no one decision may answer both.
    turn = {"call": [email(["alice"]), email(["bob"]), email(["mallory"])]}
    cmd = start_command(scope, [turn], config=hosts({"send_email": ["alice", "bob"]}))
    await w.control.start(cmd)
    await w.drain()
    first, pin = await paused(stores, scope, cmd.run_id)
    # The third call names only an outsider, so it gets the host's list, which alice is on.
    assert ([p.id for p in first.pending], first.approvers) == (["call-0-0", "call-0-2"], ["alice"])
    await refused_and_nothing_written(w, db, approve(scope, first, pin), ["bob", "mallory"])
    await w.control.decide(approve(scope, first, pin), principal="alice")
    await w.drain()
    second, pin2 = await paused(stores, scope, cmd.run_id)
    assert ([p.id for p in second.pending], second.approvers) == (["call-0-1"], ["bob"])
    await refused_and_nothing_written(w, db, approve(scope, second, pin2), ["alice", "mallory"])
    await w.control.decide(approve(scope, second, pin2), principal="bob")
    await w.drain()
    assert (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.COMPLETED


async def test_a_resumed_run_pauses_for_approval_under_the_host_list_it_started_with(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    """Invariant 12: the list travels in the continuation, so the pause after a resume is restricted too."""
    script = [{"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}, {"call": [email(["mallory"])]}]
    cmd = start_command(scope, script, config=hosts({"send_email": ["alice"]}))
    await w.control.start(cmd)
    await w.drain()
    lookup = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
    assert lookup.continuation.config.approvers == {"send_email": ["alice"]}
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    version = ClaimVersion(run_id=run.id, suspension_id=lookup.id, run_revision=run.revision)
    await w.control.resume(ResumeCommand(scope=scope, version=version, results=[ToolAnswer(call_id="call-0-0")]))
    await w.drain()

    s, pin = await paused(stores, scope, cmd.run_id)
    assert s.approvers == ["alice"]
    await refused_and_nothing_written(w, db, approve(scope, s, pin), ["mallory"])
    await w.control.decide(approve(scope, s, pin), principal="alice")
    await w.drain()
    assert (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.COMPLETED


# --- end to end, through RabbitMQ ------------------------------------------------------------------------


async def next_event(events: Subscription[Any], wanted: Callable[[Received[Any]], bool]) -> Received[Any]:
    async with asyncio.timeout(WAIT):
        async for received in events:
            if wanted(received):
                return received
    raise AssertionError("the subscription ended")


def rejection_of(message_id: str) -> Callable[[Received[Any]], bool]:
    return lambda r: isinstance(r.event, CommandRejected) and r.event.message_id == message_id


async def test_through_rabbitmq_only_a_host_named_approver_decides_and_is_recorded_as_the_decider(
    stores: Stores,
    scope: Scope,
    worker: RunningWorker,
    host: HostClient,
    rabbit: Broker,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
) -> None:
    # The host names its own user; the model names guest, who may publish here but was not named.
    config = hosts({"send_email": [rabbit.host.name]})
    cmd = start_command(scope, [{"call": [email(["guest"])]}], config=config)
    async with (
        host.subscribe(scope) as events,
        await HostClient.connect(amqp_vhost.url(), name="test guest") as guest,
    ):
        await host.start(cmd)
        notice = (
            await next_event(events, lambda r: isinstance(r.event, Notice) and r.event.run_id == cmd.run_id)
        ).event
        assert isinstance(notice, Notice)
        assert notice.approvers == [rabbit.host.name]
        assert notice.checkpoint_id is not None
        decision = DecideCommand(
            scope=scope, version=version_of(notice), checkpoint_id=notice.checkpoint_id, decision=Decision.APPROVE
        )

        # guest's decision: its user_id is vouched for by the broker, and it is not on the host's list.
        by_guest = await guest.decide(decision)
        refused = (await next_event(events, rejection_of(by_guest))).event
        assert isinstance(refused, CommandRejected)
        assert refused.code == Forbidden.code
        # A decision that carries no user_id at all names nobody the broker vouched for.
        connection = await amqp_connect(amqp_vhost.url(), "anonymous decider")
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
        anonymous = str(uuid.uuid4())
        message = command_message(Command.DECIDE, decision, message_id=anonymous)
        assert message.user_id is None
        await exchange.publish(message, routing_key=Command.DECIDE.value)
        refused = (await next_event(events, rejection_of(anonymous))).event
        assert isinstance(refused, CommandRejected)
        assert refused.code == Forbidden.code
        run = await stores.at(scope).runs.get_run(cmd.run_id)
        assert (run.state, run.revision) == (RunState.PAUSED, notice.run_revision)

        await host.decide(decision)
        completed = await next_event(
            events,
            lambda r: (
                isinstance(r.event, RunEvent)
                and r.event.run_id == cmd.run_id
                and r.event.kind is RunEventKind.COMPLETED
            ),
        )
    assert isinstance(completed.event, RunEvent)
    assert completed.event.output == "sent"
    async with stores.db.connection() as con:
        row = await con.raw.fetchrow("SELECT state, decided_by FROM checkpoints WHERE id = $1", notice.checkpoint_id)
    assert row is not None
    assert (row["state"], row["decided_by"]) == ("approved", rabbit.host.name)
