"""The original package's answers to commands, against the real database: a decision on an agent-reply
pause, a decision on a checkpoint that is no longer pending, a reply that reuses a message_id, and a cancel
that races a re-pause (docs/seed.md, "Resume paths"; docs/scenarios.md 20, 30-31)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from intermission.schemas.commands import CancelCommand, DecideCommand, Decision, ReplyCommand
from intermission.schemas.errors import InvalidState, MessageIdConflict, NotAgentReplyResumable
from intermission.schemas.llm import Role
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, SuspendReason, Suspension
from intermission.store import Stores
from intermission.store.commands import Claimed
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.wire import Command
from tests.conftest import MakeStores, race
from tests.support.fleet import Worker, fast_settings, start_command, worker
from tests.support.inspect import Inspector


@pytest.fixture
async def w(stores: Stores, database_url: str) -> AsyncIterator[Worker]:
    one = worker(stores, fast_settings(database_url))
    yield one
    await one.fleet.stop(grace=5)


async def paused_on(stores: Stores, scope: Scope, w: Worker, tool: str) -> tuple[Suspension, ClaimVersion]:
    cmd = start_command(scope, [{"call": [{"tool": tool, "arguments": {"to": "x@example.com"}}]}, {"say": "ok"}])
    await w.control.start(cmd)
    await w.drain()
    s = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.PAUSED
    return s, ClaimVersion(run_id=s.run_id, suspension_id=s.id, run_revision=run.revision)


async def test_a_decision_on_an_agent_reply_pause_is_not_agent_reply_resumable_and_writes_nothing(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    s, pin = await paused_on(stores, scope, w, "ask_agent")
    assert s.reason is SuspendReason.AGENT_REPLY
    before = await db.snapshot()
    with pytest.raises(NotAgentReplyResumable):
        await w.control.decide(
            DecideCommand(scope=scope, version=pin, checkpoint_id=1, decision=Decision.APPROVE), principal="host"
        )
    assert await db.snapshot() == before


async def test_a_decision_on_a_checkpoint_no_longer_pending_is_invalid_state(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    s, pin = await paused_on(stores, scope, w, "send_email")
    assert s.checkpoint_id is not None
    approve = DecideCommand(scope=scope, version=pin, checkpoint_id=s.checkpoint_id, decision=Decision.APPROVE)
    await w.control.decide(approve, principal="alice")
    await w.drain()
    before = await db.snapshot()
    # Another decision on the checkpoint just decided (its pause is gone too: that alone said not_suspended).
    deny = approve.model_copy(update={"decision": Decision.DENY, "reason": "too late"})
    with pytest.raises(InvalidState):
        await w.control.decide(deny, principal="bob")
    assert await db.snapshot() == before

    # A checkpoint a cancel closed is no longer pending either.
    s2, pin2 = await paused_on(stores, scope, w, "send_email")
    assert s2.checkpoint_id is not None
    await w.control.cancel(CancelCommand(scope=scope, run_id=s2.run_id))
    await w.drain()
    assert await db.con.fetchval("SELECT state FROM checkpoints WHERE id = $1", s2.checkpoint_id) == "rejected"
    with pytest.raises(InvalidState):
        await w.control.decide(
            DecideCommand(scope=scope, version=pin2, checkpoint_id=s2.checkpoint_id, decision=Decision.APPROVE),
            principal="alice",
        )


async def agent_reply_pause(stores: Stores, scope: Scope, w: Worker) -> tuple[Suspension, ClaimVersion]:
    s, pin = await paused_on(stores, scope, w, "ask_agent")
    assert s.reason is SuspendReason.AGENT_REPLY
    return s, pin


def reply_receipt(message_id: str, cmd: ReplyCommand) -> Receipt:
    return Receipt.of(message_id, Command.REPLY.value, cmd)


async def test_a_reply_reusing_a_message_id_with_another_body_is_message_id_conflict(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    s, pin = await agent_reply_pause(stores, scope, w)
    reply = ReplyCommand(scope=scope, version=pin, reply_with=s.pending[0].reply_with, input='"forty-two"')
    lease = w.fleet.lease()
    claimed = await stores.commands.reply(reply, lease, receipt=reply_receipt("m-1", reply), correlation_id="m-1")
    assert claimed is not None
    w.fleet.submit(claimed)
    await w.drain()
    assert await db.con.fetchval("SELECT routing_key FROM inbox WHERE message_id = 'm-1'") == Command.REPLY.value
    before = await db.snapshot()

    # The same message_id for a different reply to the same pause: not a second admission's conflict, a
    # reused idempotency key.
    other = reply.model_copy(update={"input": '"forty-three"'})
    with pytest.raises(MessageIdConflict):
        await stores.commands.reply(other, lease, receipt=reply_receipt("m-1", other), correlation_id="m-1")
    # The very same reply again is the idempotent duplicate: acknowledged, no second execution, no refusal.
    with pytest.raises(AlreadyApplied):
        await stores.commands.reply(reply, lease, receipt=reply_receipt("m-1", reply), correlation_id="m-1")
    assert await db.snapshot() == before

    # A message_id some other command used first is taken too.
    s2, pin2 = await agent_reply_pause(stores, scope, w)
    third = ReplyCommand(scope=scope, version=pin2, reply_with=s2.pending[0].reply_with, input='"x"')
    await db.con.execute(
        "INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant, run_id)"
        " VALUES ('m-3', 'run.resume', 'another-digest', 'applied', $1, $2, $3)",
        scope.app,
        scope.tenant,
        s2.run_id,
    )
    before = await db.snapshot()
    with pytest.raises(MessageIdConflict):
        await stores.commands.reply(third, lease, receipt=reply_receipt("m-3", third), correlation_id="m-3")
    assert await db.snapshot() == before


async def test_race_replies_sharing_a_message_id_admit_once_and_the_other_body_is_message_id_conflict(
    stores: Stores, scope: Scope, w: Worker, make_stores: MakeStores
) -> None:
    s, pin = await agent_reply_pause(stores, scope, w)
    bodies = [
        ReplyCommand(scope=scope, version=pin, reply_with=s.pending[0].reply_with, input=f'"answer {i % 2}"')
        for i in range(16)
    ]
    contenders = await make_stores(len(bodies))
    lease = w.fleet.lease()

    async def one(i: int) -> Claimed | None:
        return await contenders[i].commands.reply(
            bodies[i], lease, receipt=reply_receipt("m-shared", bodies[i]), correlation_id="m-shared"
        )

    results = await race(len(bodies), one)
    granted = [i for i, r in enumerate(results) if isinstance(r, Claimed)]
    assert len(granted) == 1, results  # one execution, whichever body won
    (winner,) = granted
    for i, r in enumerate(results):
        if i == winner:
            continue
        if bodies[i].input == bodies[winner].input:
            assert r is None or isinstance(r, AlreadyApplied), r  # the same request: a duplicate
        else:
            assert isinstance(r, MessageIdConflict), r  # never resume_admission_conflict
    w.fleet.submit(results[winner])
    await w.drain()
    assert (await stores.at(scope).runs.get_run(s.run_id)).state is RunState.COMPLETED
    tool_messages = [m for m in await stores.at(scope).sessions.load(s.run_id) if m.role is Role.TOOL]
    assert [m.content for m in tool_messages] == [bodies[winner].input]  # the winner's reply, once
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM resume_admissions WHERE run_id = $1", s.run_id) == 1
