"""The original package's answers to commands, against the real database: a decision on an agent-reply
pause, a decision on a checkpoint that is no longer pending, a reply that reuses a message_id, and a cancel
that races a re-pause (docs/seed.md, "Resume paths"; docs/scenarios.md 20, 30-31)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from intermission.schemas.commands import CancelCommand, DecideCommand, Decision
from intermission.schemas.errors import InvalidState, NotAgentReplyResumable
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, SuspendReason, Suspension
from intermission.store import Stores
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
