"""Events published from memory after their commit (store/db.py ``hand_over_to``, publishers/relay.py
``hand_over``, migration 0009): a claim's run.resumed goes to its worker's hand-over, its row is held
from the relays meanwhile, and is marked sent once confirmed; nothing else is held."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from intermission.fleet.worker import Worker
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion
from intermission.store import Stores
from intermission.store.inbox import Receipt
from intermission.store.outbox import OutboxEvent
from intermission.wire import Command
from tests.support.factories import lease, paused_run

WAIT = 20.0
HOLD = 30.0


async def test_a_claim_hands_its_resumed_event_over_and_holds_its_row_from_the_relays(
    stores: Stores, scope: Scope
) -> None:
    handed: list[list[OutboxEvent]] = []
    stop = stores.db.hand_over_to(handed.append, hold_seconds=HOLD)
    try:
        p = await paused_run(stores, scope)
        cmd = ResumeCommand(
            scope=scope,
            version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
            results=[ToolAnswer(call_id="c1", content="42")],
        )
        claimed = await stores.commands.resume(
            cmd, lease(), receipt=Receipt.of("m-1", Command.RESUME.value, cmd), correlation_id="m-1"
        )
        # Another statement of the same pool, which hands nothing over: its rows are not held.
        other = await paused_run(stores, scope)
    finally:
        stop()
    assert claimed.run.id == p.run.id
    ((event,),) = handed  # one commit, one event: the claim's run.resumed
    assert event.routing_key == f"run.resumed.{scope.app}.{scope.tenant}"
    body = RunEvent.model_validate_json(event.body)
    assert (body.kind, body.run_id, body.revision) == (RunEventKind.RESUMED, p.run.id, p.revision + 1)

    async with stores.db.connection() as con:
        row = await con.raw.fetchrow(
            "SELECT body, correlation_id, sent_at, next_attempt_at - created_at AS held"
            " FROM outbox WHERE message_id = $1",
            event.message_id,
        )
        notice = await con.raw.fetchrow(
            "SELECT next_attempt_at FROM outbox WHERE run_id = $1 AND routing_key LIKE 'notice.%'", other.run.id
        )
    assert row is not None
    assert notice is not None
    assert row["body"] == event.body  # what the relay would publish is what was handed over
    assert row["correlation_id"] == "m-1"
    assert row["sent_at"] is None
    assert row["held"] == timedelta(seconds=HOLD)
    assert notice["next_attempt_at"] is None  # the pause's Notice was not handed over: due at once

    # The relays pass over the held row, and take the Notice.
    async with stores.across_scopes.claim_outbox(100) as batch:
        claimable = {r.message_id for r in batch.rows}
    assert str(event.message_id) not in claimable
    assert claimable  # the Notices of the two pauses

    await stores.across_scopes.mark_handed_sent([event.message_id])
    async with stores.db.connection() as con:
        marked = await con.raw.fetchrow(
            "SELECT sent_at, next_attempt_at FROM outbox WHERE message_id = $1", event.message_id
        )
    assert marked is not None
    assert marked["sent_at"] is not None
    assert marked["next_attempt_at"] is None


async def test_a_workers_resumed_event_is_published_from_memory_and_marked_sent(
    stores: Stores, scope: Scope, worker: Worker, host: HostClient
) -> None:
    p = await paused_run(stores, scope)
    before = worker.relay.handed
    async with host.subscribe(scope) as events:
        await host.resume(
            ResumeCommand(
                scope=scope,
                version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
                results=[ToolAnswer(call_id="c1", content="42")],
            )
        )
        async with asyncio.timeout(WAIT):
            async for received in events:
                if isinstance(received.event, RunEvent) and received.event.kind is RunEventKind.RESUMED:
                    resumed = received
                    break
    await worker.relay.handed_settled()
    assert worker.relay.handed == before + 1
    async with stores.db.connection() as con:
        row = await con.raw.fetchrow(
            "SELECT sent_at, next_attempt_at FROM outbox WHERE message_id = $1::uuid", resumed.message_id
        )
    assert row is not None
    assert row["sent_at"] is not None
    assert row["next_attempt_at"] is None
