"""The original package's answers to commands, against the real database: a decision on an agent-reply
pause, a decision on a checkpoint that is no longer pending, a reply that reuses a message_id, and a cancel
that races a re-pause (docs/seed.md, "Resume paths"; docs/scenarios.md 20, 30-31)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from intermission.engine.commands import Cancel, Claimed, Reply
from intermission.engine.core import Engine
from intermission.engine.runs import EndingRequested, Pause
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ReplyCommand,
    ResumeCommand,
    ToolAnswer,
)
from intermission.schemas.errors import (
    InvalidState,
    MessageIdConflict,
    NotAgentReplyResumable,
    NotSuspended,
    RunConflict,
)
from intermission.schemas.events import RunEventKind
from intermission.schemas.llm import Role
from intermission.schemas.run import Lease, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Ending, EndingKind, PendingCall, SuspendReason, Suspension
from intermission.store import Stores
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.wire import Command
from tests.conftest import MakeStores, race
from tests.support.factories import continuation, lease, paused_run, running_run, writes
from tests.support.fleet import Worker, fast_settings, outbox_keys, start_command, worker
from tests.support.inspect import Inspector, snapshot_for


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


def handler(stores: Stores, held: Lease) -> Engine:
    """An engine of its own over ``stores``, applying commands under ``held`` as a worker's handler does."""
    return Engine.over(stores).under(lease=held)


async def test_a_reply_reusing_a_message_id_with_another_body_is_message_id_conflict(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    s, pin = await agent_reply_pause(stores, scope, w)
    reply = ReplyCommand(scope=scope, version=pin, reply_with=s.pending[0].reply_with, input='"forty-two"')
    lease = w.fleet.lease()
    claimed = await handler(stores, lease).apply(
        Reply(reply, receipt=reply_receipt("m-1", reply), correlation_id="m-1")
    )
    assert claimed is not None
    w.fleet.submit(claimed)
    await w.drain()
    assert await db.con.fetchval("SELECT routing_key FROM inbox WHERE message_id = 'm-1'") == Command.REPLY.value
    before = await db.snapshot()

    # The same message_id for a different reply to the same pause: not a second admission's conflict, a
    # reused idempotency key.
    other = reply.model_copy(update={"input": '"forty-three"'})
    with pytest.raises(MessageIdConflict):
        await handler(stores, lease).apply(Reply(other, receipt=reply_receipt("m-1", other), correlation_id="m-1"))
    # The very same reply again is the idempotent duplicate: acknowledged, no second execution, no refusal.
    with pytest.raises(AlreadyApplied):
        await handler(stores, lease).apply(Reply(reply, receipt=reply_receipt("m-1", reply), correlation_id="m-1"))
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
        await handler(stores, lease).apply(Reply(third, receipt=reply_receipt("m-3", third), correlation_id="m-3"))
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
        return await handler(contenders[i], lease).apply(
            Reply(bodies[i], receipt=reply_receipt("m-shared", bodies[i]), correlation_id="m-shared")
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


async def test_a_reply_queued_behind_a_rival_with_its_message_id_is_message_id_conflict(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    """Two replies with one message_id and different bodies both pass the admission's inbox check before
    either commits; the first's claim holds the inbox key while it waits on the run's row lock, the second
    waits on that key. The first admits; the second's refusal is message_id_conflict (the message_id is what
    was reused), never resume_admission_conflict. (The other window, a rival committing between the inbox
    check and the admission lookup, has no point to stop at: the race test above meets it.)"""
    s, pin = await agent_reply_pause(stores, scope, w)
    bodies = [
        ReplyCommand(scope=scope, version=pin, reply_with=s.pending[0].reply_with, input=f'"answer {i}"')
        for i in range(2)
    ]
    lease = w.fleet.lease()

    async def reply(body: ReplyCommand) -> Claimed | None:
        # An engine of its own for each reply: each meets the row lock in a statement of its own.
        return await handler(stores, lease).apply(
            Reply(body, receipt=reply_receipt("m-shared", body), correlation_id="m")
        )

    waiting_on_the_row = (
        "SELECT count(*) = $1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    holder = db.con.transaction()
    await holder.start()
    try:
        await db.con.execute("SELECT 1 FROM runs WHERE id = $1 FOR UPDATE", s.run_id)
        first = asyncio.create_task(reply(bodies[0]))
        await db.wait_until(waiting_on_the_row, 1)
        second = asyncio.create_task(reply(bodies[1]))
        await db.wait_until(waiting_on_the_row, 2)
        await holder.commit()
    except BaseException:
        await holder.rollback()
        raise
    assert isinstance(await first, Claimed)
    with pytest.raises(MessageIdConflict):
        await second
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM resume_admissions WHERE run_id = $1", s.run_id) == 1


# --- cancel ---------------------------------------------------------------------------------------------

LOOKUPS = [{"call": [{"tool": "lookup", "arguments": {"n": i}}]} for i in range(40)]


async def test_a_cancel_racing_a_repause_is_retried_against_the_new_pause(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    """The cancel reads pause S1, then waits on the run's row lock while the run is resumed and paused again
    on S2 (revision + 2). Its claim pinned to S1 finds the run moved: it reads again and claims S2, never
    refusing run_conflict."""
    cmd = start_command(scope, LOOKUPS)
    await w.control.start(cmd)
    await w.drain()
    first = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
    revision = (await stores.at(scope).runs.get_run(cmd.run_id)).revision
    holder = db.con.transaction()
    await holder.start()
    try:
        await db.con.execute("SELECT 1 FROM runs WHERE id = $1 FOR UPDATE", cmd.run_id)
        cancelling = asyncio.create_task(
            handler(stores, w.fleet.lease()).apply(Cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="stop")))
        )
        # The cancel's claim (store/queries/engine.sql, claim_pauses_v2) waits on the row lock: it has read S1.
        await db.wait_until(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%intermission_claim_pauses_v2%')"
        )
        # Meanwhile the run is claimed and paused again, on a new pause.
        await db.con.execute("UPDATE suspensions SET id = nextval('suspension_ids') WHERE run_id = $1", cmd.run_id)
        await db.con.execute("UPDATE runs SET revision = revision + 2 WHERE id = $1", cmd.run_id)
        await holder.commit()
    except BaseException:
        await holder.rollback()
        raise
    claimed = await cancelling  # not RunConflict
    assert claimed is not None
    assert claimed.suspension is not None
    assert claimed.suspension.id != first.id  # the new pause
    assert claimed.run.revision == revision + 3
    w.fleet.submit(claimed)
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.error) == (RunState.CANCELLED, "stop")
    assert await db.count("suspensions", cmd.run_id) == 0


async def test_race_cancels_against_resumes_and_repauses_all_end_cancelled_and_none_is_refused(
    stores: Stores, scope: Scope, w: Worker, db: Inspector
) -> None:
    """Real concurrency: each run is resumed again and again (every resume pauses it again at once) while a
    cancel arrives at a moment of its own: between a read and a claim, during the resume's claim, while the
    run runs, or while it pauses. Every cancel is accepted, every run ends cancelled, and nothing runs on."""
    commands = [start_command(scope, LOOKUPS) for _ in range(16)]
    for c in commands:
        await w.control.start(c)
    await w.drain()

    ready = {c.run_id: asyncio.Event() for c in commands}

    async def resume_until_over(i: int, run_id: str) -> int:
        resumed = 0
        while not (run := await stores.at(scope).runs.get_run(run_id)).state.is_terminal:
            try:
                s = await stores.at(scope).suspensions.get_suspension(run_id)
                version = ClaimVersion(run_id=run_id, suspension_id=s.id, run_revision=run.revision)
                answer = ResumeCommand(scope=scope, version=version, results=[ToolAnswer(call_id=s.pending[0].id)])
                await w.control.resume(answer)
                resumed += 1
                if resumed >= 1 + i % 4:
                    ready[run_id].set()
            except (NotSuspended, RunConflict):
                await asyncio.sleep(0)  # it moved: look again
        ready[run_id].set()
        return resumed

    async def cancel_in_the_middle(i: int, run_id: str) -> Claimed | None:
        await ready[run_id].wait()
        for _ in range(i % 5):  # a few turns of the loop more: a different moment of the resume for each
            await asyncio.sleep(0)
        return await w.control.cancel(CancelCommand(scope=scope, run_id=run_id, reason="raced"))

    results = await asyncio.gather(
        *(resume_until_over(i, c.run_id) for i, c in enumerate(commands)),
        *(cancel_in_the_middle(i, c.run_id) for i, c in enumerate(commands)),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, BaseException)]
    assert refused == []
    await w.drain()
    for c in commands:
        run = await stores.at(scope).runs.get_run(c.run_id)
        assert (run.state, run.error) == (RunState.CANCELLED, "raced"), c.run_id
        assert await db.count("suspensions", c.run_id) == 0
        assert await db.count("progress", c.run_id) == 0
        keys = await outbox_keys(stores, scope, c.run_id)
        assert keys.count(f"run.cancelled.{scope.app}.{scope.tenant}") == 1
        assert keys[-1] == f"run.cancelled.{scope.app}.{scope.tenant}"
    # The resumes did get in between: each run was resumed (and paused again) before its cancel came.
    assert all(isinstance(r, int) and r >= 1 + i % 4 for i, r in enumerate(results[: len(commands)])), results


async def test_a_cancel_of_a_run_held_by_a_plain_claim_is_not_suspended_and_touches_nothing(
    stores: Stores, scope: Scope, db: Inspector
) -> None:
    """Scenario 31: the original's plain claim holds no lease, so nobody here could end the run; the run is
    its claimer's."""
    p = await paused_run(stores, scope)
    await writes(stores, scope).suspensions.claim_suspension(p.run.id)
    before = await db.snapshot()
    with pytest.raises(NotSuspended):
        await handler(stores, lease()).apply(Cancel(CancelCommand(scope=scope, run_id=p.run.id)))
    assert await db.snapshot() == before


async def test_a_cancel_of_a_running_run_is_recorded_once_and_a_second_is_acknowledged(
    stores: Stores, scope: Scope, db: Inspector
) -> None:
    run, held = await running_run(stores, scope)
    await writes(stores, scope).progress.save_progress(snapshot_for(run.id, held.owner))
    cancel = CancelCommand(scope=scope, run_id=run.id, reason="first")
    receipt = Receipt.of("c-1", Command.CANCEL.value, cancel)
    assert await handler(stores, lease()).apply(Cancel(cancel, receipt=receipt)) is None
    # Kept on the run (the fence every writer of it meets) and in its snapshot (what a takeover finishes).
    assert json.loads(await db.con.fetchval("SELECT ending FROM runs WHERE id = $1", run.id)) == {
        "kind": "cancel",
        "reason": "first",
    }
    assert (await stores.at(scope).progress.get_progress(run.id)).ending == Ending(
        kind=EndingKind.CANCEL, reason="first"
    )
    # The holder, not knowing yet, saves: its snapshot cannot take the request back, and it is told.
    saved = await writes(stores, scope).progress.save_progress(snapshot_for(run.id, held.owner, step=3))
    assert saved.ending == Ending(kind=EndingKind.CANCEL, reason="first")
    assert (await stores.at(scope).progress.get_progress(run.id)).ending == saved.ending
    # Nor can it pause or complete now: it must end the run cancelled.
    with pytest.raises(EndingRequested):
        await writes(stores, scope).runs.pause_run(
            run.id, held.owner, Pause(SuspendReason.EXTERNAL_TOOL, [PendingCall(id="c", name="lookup")], continuation())
        )
    with pytest.raises(EndingRequested):
        await writes(stores, scope).runs.end_run(run.id, held.owner, RunEventKind.COMPLETED, output="done anyway")
    # The same command again is a duplicate; another cancel is acknowledged with nothing more to ask.
    before = await db.snapshot()
    with pytest.raises(AlreadyApplied):
        await handler(stores, lease()).apply(Cancel(cancel, receipt=receipt))
    second = cancel.model_copy(update={"reason": "second"})
    assert (
        await handler(stores, lease()).apply(Cancel(second, receipt=Receipt.of("c-2", Command.CANCEL.value, second)))
        is None
    )
    after = await db.snapshot()
    assert {k: v for k, v in after.items() if k != "inbox"} == {k: v for k, v in before.items() if k != "inbox"}
    await writes(stores, scope).runs.end_run(run.id, held.owner, RunEventKind.CANCELLED, error="first")
    ended = await stores.at(scope).runs.get_run(run.id)
    assert (ended.state, ended.ending) == (RunState.CANCELLED, None)
