"""Retention: pruning removes exactly what is past its time, and nothing a live run or the idempotency
window still needs; any number of pruners at once delete each row once and never block a claim.

Ages are made by moving a row's timestamps back in the database (its clock judges every retention), never
by waiting.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from intermission.schemas.events import RunEventKind
from intermission.schemas.llm import Message, Role
from intermission.schemas.run import NewRun
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.store.retention import RUN_TABLES, Kept, Pruner, Retention
from tests.support.factories import lease, paused_run, running_run
from tests.support.inspect import Inspector, pin

HOUR = 3600.0
RETENTION = Retention(runs=HOUR, inbox=HOUR, outbox=HOUR, sessions=HOUR)


async def ended_run(stores: Stores, scope: Scope, *, session_id: str | None = None) -> str:
    """A run that ran and completed, with its session messages, run events and outbox rows."""
    held = lease()
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    await stores.at(scope).runs.create_run(
        NewRun(run_id=run_id, agent_id="demo", input="hi", session_id=session_id or ""), held
    )
    await stores.at(scope).runs.end_run(
        run_id,
        held.owner,
        RunEventKind.COMPLETED,
        output="done",
        own_messages=[Message(role=Role.USER, content="hi"), Message(role=Role.ASSISTANT, content="done")],
    )
    return run_id


async def age(db: Inspector, table: str, column: str, seconds: float, where: str, *args: Any) -> None:
    """Move ``column`` of the matching rows ``seconds`` into the past (test-only SQL, fixed text)."""
    await db.con.execute(
        f"UPDATE {table} SET {column} = {column} - make_interval(secs => $1) WHERE {where}",
        seconds,
        *args,
    )


async def rows_of(db: Inspector, run_id: str) -> dict[str, int]:
    counts = {}
    for table in RUN_TABLES:
        column = "id" if table == "runs" else "run_id"
        counts[table] = await db.con.fetchval(f"SELECT count(*) FROM {table} WHERE {column} = $1", run_id)
    return counts


async def test_prune_removes_exactly_the_ended_runs_past_retention_and_everything_about_them(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope
) -> None:
    old = await ended_run(stores, scope)
    just_inside = await ended_run(stores, other_scope)
    recent = await ended_run(stores, scope)
    paused = await paused_run(stores, scope)
    running, _ = await running_run(stores, scope)
    await db.con.execute(
        "INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision)"
        " SELECT gen_random_uuid(), id, app, tenant, 'note', revision FROM runs"
    )
    await age(db, "runs", "ended_at", HOUR + 60, "id = $2", old)
    await age(db, "runs", "ended_at", HOUR - 60, "id = $2", just_inside)
    # Live runs are never pruned, however old: their evidence may still be needed.
    for live in (paused.run.id, running.id):
        await age(db, "runs", "created_at", 365 * 86400, "id = $2", live)
        await age(db, "runs", "updated_at", 365 * 86400, "id = $2", live)
    before = {run: await rows_of(db, run) for run in (old, just_inside, recent, paused.run.id, running.id)}
    assert before[old]["runs"] == 1
    assert before[old]["run_events"] >= 1
    assert before[paused.run.id]["suspensions"] == 1

    pruner = Pruner(stores.db, RETENTION, batch=10)
    assert (await pruner.prunable())["runs"] == 1
    removed = await pruner.prune((Kept.RUNS,))

    assert removed == {t: n for t, n in before[old].items() if n}
    assert await rows_of(db, old) == dict.fromkeys(RUN_TABLES, 0)
    for kept in (just_inside, recent, paused.run.id, running.id):
        assert await rows_of(db, kept) == before[kept], kept
    assert await pruner.prune((Kept.RUNS,)) == {}


async def test_inbox_outbox_and_sessions_keep_what_is_inside_their_window_or_still_needed(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    # Sessions: one only ended runs used, one a live (paused) run still uses.
    done_session, live_session = f"s-{uuid.uuid4().hex[:8]}", f"s-{uuid.uuid4().hex[:8]}"
    await ended_run(stores, scope, session_id=done_session)
    await ended_run(stores, scope, session_id=live_session)
    await ended_run(stores, scope, session_id=done_session)  # (one more event in the outbox)
    live = await paused_run(stores, scope)
    await db.con.execute("UPDATE runs SET session_id = $1 WHERE id = $2", live_session, live.run.id)
    await age(db, "session_messages", "created_at", HOUR + 60, "true")

    # Inbox records: one past the window, one inside it.
    for message_id, seconds in (("m-old", HOUR + 60), ("m-new", HOUR - 60)):
        await db.con.execute(
            "INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant, run_id)"
            " VALUES ($1, 'run.cancel', 'd', 'applied', $2, $3, NULL)",
            message_id,
            scope.app,
            scope.tenant,
        )
        await age(db, "inbox", "recorded_at", seconds, "message_id = $2", message_id)

    # Outbox rows: sent long ago; sent recently; never sent though old; quarantined though old.
    ids = [r["id"] for r in await db.con.fetch("SELECT id FROM outbox ORDER BY id")]
    assert len(ids) >= 4
    sent_old, sent_new, unsent_old, quarantined_old = ids[:4]
    await db.con.execute(
        "UPDATE outbox SET sent_at = now() - make_interval(secs => $1) WHERE id = $2", HOUR + 60, sent_old
    )
    await db.con.execute(
        "UPDATE outbox SET sent_at = now() - make_interval(secs => $1) WHERE id = $2", HOUR - 60, sent_new
    )
    await db.con.execute("UPDATE outbox SET sent_at = NULL WHERE id = ANY($1)", [unsent_old, quarantined_old])
    await db.con.execute("UPDATE outbox SET quarantined_at = now() - interval '2 days' WHERE id = $1", quarantined_old)
    await age(db, "outbox", "created_at", 2 * 86400, "id = ANY($2)", [unsent_old, quarantined_old])
    outbox_before = await db.con.fetchval("SELECT count(*) FROM outbox")

    pruner = Pruner(stores.db, RETENTION, batch=2)
    due = await pruner.prunable()
    assert (due["inbox"], due["outbox"], due["session_messages"]) == (1, 1, 4)
    assert await pruner.prune((Kept.INBOX, Kept.OUTBOX, Kept.SESSIONS)) == {
        "inbox": 1,
        "outbox": 1,
        "session_messages": 4,
    }

    assert [r["message_id"] for r in await db.con.fetch("SELECT message_id FROM inbox ORDER BY 1")] == ["m-new"]
    left = {r["id"] for r in await db.con.fetch("SELECT id FROM outbox")}
    assert sent_old not in left
    assert {sent_new, unsent_old, quarantined_old} <= left
    assert len(left) == outbox_before - 1
    sessions = await db.con.fetch("SELECT DISTINCT session_id FROM session_messages")
    assert [r["session_id"] for r in sessions] == [live_session]


async def test_pruners_at_once_delete_each_run_once_and_never_wait_for_a_claim(
    make_stores: Any, db: Inspector, scope: Scope
) -> None:
    many = await make_stores(5)
    writer = many[0]
    doomed = [await ended_run(writer, scope) for _ in range(120)]
    await age(db, "runs", "ended_at", HOUR + 60, "id = ANY($2)", doomed)
    held = [await paused_run(writer, scope) for _ in range(8)]
    events_before = await db.con.fetchval("SELECT count(*) FROM run_events WHERE run_id = ANY($1)", doomed)

    pruners = [Pruner(s.db, RETENTION, batch=7, max_rows_per_second=1e9) for s in many[1:]]
    claimant = many[0]

    async def claim_all() -> int:
        # Claims of live runs go on while the pruners work: each is its own short transaction.
        claimed = 0
        for p in held:
            await claimant.at(scope).suspensions.claim_suspension_version(pin(p))
            claimed += 1
        return claimed

    claiming = asyncio.create_task(claim_all())
    counts = await asyncio.wait_for(asyncio.gather(*(p.prune((Kept.RUNS,)) for p in pruners)), 60)
    claimed = await asyncio.wait_for(claiming, 60)
    assert claimed == len(held)
    assert sum(c.get("runs", 0) for c in counts) == len(doomed)
    assert sum(c.get("run_events", 0) for c in counts) == events_before
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id = ANY($1)", doomed) == 0
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id = ANY($1)", [p.run.id for p in held]) == len(held)
