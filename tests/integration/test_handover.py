"""Events published from memory after their commit (the engine's ``EventSink``, publishers/relay.py
``hand_over``, migrations 0009 and 0016): a pause's Notice, a claim's run.resumed and an end's run.* event
go to their worker's sink, their rows are held from the relays meanwhile, and are marked sent once
confirmed; rows of an engine that hands nothing over are not held."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta

from intermission.engine.commands import Resume
from intermission.engine.core import Engine
from intermission.engine.events import OutboxEvent
from intermission.engine.runs import EndRun
from intermission.fleet.worker import Worker
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Notice
from intermission.store import Stores
from intermission.store.inbox import Receipt
from intermission.wire import Command
from tests.support.factories import lease, paused_run

WAIT = 20.0
HOLD = 30.0


class Commits:
    """An event sink that keeps each commit's events apart, holding their rows ``hold`` seconds."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.commits: list[list[OutboxEvent]] = []

    @property
    def hold_seconds(self) -> float | None:
        return self.hold

    def committed(self, events: Sequence[OutboxEvent]) -> None:
        self.commits.append(list(events))


async def test_a_pause_a_claim_and_an_end_hand_their_events_over_and_hold_their_rows_from_the_relays(
    stores: Stores, scope: Scope
) -> None:
    sink = Commits(HOLD)
    engine = Engine.over(stores)
    stop = engine.hand_events_to(sink)
    try:
        p = await paused_run(stores, scope, through=engine)
        cmd = ResumeCommand(
            scope=scope,
            version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
            results=[ToolAnswer(call_id="c1", content="42")],
        )
        claimed = await engine.under(lease=lease()).apply(
            Resume(cmd, receipt=Receipt.of("m-1", Command.RESUME.value, cmd), correlation_id="m-1")
        )
        ended = await engine.apply(
            EndRun(
                scope,
                p.run.id,
                claimed.run.lease_owner or "",
                claimed.run.revision,
                RunEventKind.COMPLETED,
                output="done",
                correlation_id="m-1",
            )
        )
    finally:
        stop()
    # A statement of the same pool once the hand-over stopped: its row is not held.
    other = await paused_run(stores, scope, through=engine)
    assert claimed.run.id == p.run.id
    # One commit, one event each: the pause's Notice, the claim's run.resumed, the end's run.completed.
    ((notice,), (resumed,), (completed,)) = sink.commits
    assert notice.routing_key == f"notice.external_tool.{scope.app}.{scope.tenant}"
    assert Notice.model_validate_json(notice.body).suspension_id == p.suspension.id  # completed by its commit
    assert resumed.routing_key == f"run.resumed.{scope.app}.{scope.tenant}"
    body = RunEvent.model_validate_json(resumed.body)
    assert (body.kind, body.run_id, body.revision) == (RunEventKind.RESUMED, p.run.id, p.revision + 1)
    assert completed.routing_key == f"run.completed.{scope.app}.{scope.tenant}"
    assert RunEvent.model_validate_json(completed.body) == ended  # the revision its transaction gave it

    async with stores.db.connection() as con:
        rows = {
            r["message_id"]: r
            for r in await con.raw.fetch(
                "SELECT message_id, body, correlation_id, sent_at, next_attempt_at - created_at AS held"
                " FROM outbox WHERE run_id = $1",
                p.run.id,
            )
        }
        unheld = await con.raw.fetchrow(
            "SELECT next_attempt_at FROM outbox WHERE run_id = $1 AND routing_key LIKE 'notice.%'", other.run.id
        )
    assert rows.keys() == {notice.message_id, resumed.message_id, completed.message_id}
    for event in (notice, resumed, completed):
        row = rows[event.message_id]
        assert row["body"] == event.body  # what the relay would publish is what was handed over
        assert row["sent_at"] is None
        assert row["held"] == timedelta(seconds=HOLD)
    assert rows[resumed.message_id]["correlation_id"] == "m-1"
    assert unheld is not None
    assert unheld["next_attempt_at"] is None  # due at once

    # The relays pass over the held rows, and take the other Notice.
    async with stores.across_scopes.claim_outbox(100) as batch:
        claimable = {r.message_id for r in batch.rows}
    assert not claimable & {str(e.message_id) for e in (notice, resumed, completed)}
    assert claimable  # the other pause's Notice

    await stores.across_scopes.mark_handed_sent([resumed.message_id])
    async with stores.db.connection() as con:
        marked = await con.raw.fetchrow(
            "SELECT sent_at, next_attempt_at FROM outbox WHERE message_id = $1", resumed.message_id
        )
    assert marked is not None
    assert marked["sent_at"] is not None
    assert marked["next_attempt_at"] is None


async def test_a_workers_events_are_published_from_memory_and_marked_sent(
    stores: Stores, scope: Scope, worker: Worker, host: HostClient
) -> None:
    before = worker.relay.handed
    # Through the worker's engine: its Notice is handed over too.
    p = await paused_run(stores, scope, through=worker.fleet.engine)
    heard: list[str | None] = []
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
                event = received.event
                if isinstance(event, RunEvent | Notice) and event.run_id == p.run.id:
                    heard.append(received.message_id)
                    # Where the run stops for now: its end, or its next pause.
                    if isinstance(event, Notice) or event.kind is not RunEventKind.RESUMED:
                        break
    await worker.relay.handed_settled()
    async with stores.db.connection() as con:
        written = await con.raw.fetch(
            "SELECT message_id::text, sent_at, next_attempt_at, routing_key FROM outbox WHERE run_id = $1", p.run.id
        )
    # Everything written for the run (the Notice, its run.resumed, what it did next) was handed over, heard
    # (but for the Notice, sent before the subscription) and marked sent, with no hold left on it.
    assert {r["message_id"] for r in written if not r["routing_key"].startswith("notice.")} == set(heard)
    assert worker.relay.handed == before + len(written)
    assert all(r["sent_at"] is not None and r["next_attempt_at"] is None for r in written)
