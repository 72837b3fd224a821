"""Retention: pruning removes exactly what is past its time, and nothing a live run or the idempotency
window still needs; any number of pruners at once delete each row once and never block a claim.

Ages are made by moving a row's timestamps back in the database (its clock judges every retention), never
by waiting.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
import pytest

from intermission.agent.loop import default_executor
from intermission.fleet.metrics import SweeperMetrics
from intermission.fleet.pruning import PruneLoop
from intermission.fleet.settings import Settings
from intermission.fleet.worker import Worker, running_worker
from intermission.publishers.clients import HostClient, Received, Subscription, version_of
from intermission.publishers.dead_queue import dead_stats
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.llm import Message, Role
from intermission.schemas.run import NewRun
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from intermission.store.retention import RUN_TABLES, Kept, Pruner, Retention
from intermission.wire import declare
from tests.support.amqp import DELIVERY_LIMIT, Broker, Vhost
from tests.support.factories import lease, paused_run, running_run, writes
from tests.support.fleet import fast_settings, start_command
from tests.support.inspect import Inspector, pin
from tests.support.worker_process import cli

HOUR = 3600.0
WAIT = 20.0
RETENTION = Retention(runs=HOUR, inbox=HOUR, outbox=HOUR, sessions=HOUR)


async def ended_run(stores: Stores, scope: Scope, *, session_id: str | None = None) -> str:
    """A run that ran and completed, with its session messages, run events and outbox rows."""
    held = lease()
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    await writes(stores, scope).runs.create_run(
        NewRun(run_id=run_id, agent_id="demo", input="hi", session_id=session_id or ""), held
    )
    await writes(stores, scope).runs.end_run(
        run_id,
        held.owner,
        RunEventKind.COMPLETED,
        output="done",
        own_messages=[Message(role=Role.USER, content="hi"), Message(role=Role.ASSISTANT, content="done")],
    )
    return run_id


async def next_of(events: Subscription[Any], wanted: Callable[[Any], bool]) -> Any:
    async with asyncio.timeout(WAIT):
        received: Received[Any]
        async for received in events:
            if wanted(received.event):
                return received.event
    raise AssertionError("the subscription ended")


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


async def test_a_run_resumed_through_an_admission_is_pruned_with_its_admission_start_expiry_and_closure(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    # run.reply admits, then starts, the resume (0002): rows that reference each other, which the prune must
    # delete referencing first or the whole batch fails on a foreign key (intermission_prune_runs_v1).
    run_id = await ended_run(stores, scope)
    for suspension_id in (1, 2):
        await db.con.execute(
            "INSERT INTO resume_admissions (run_id, suspension_id, app, tenant, pinned_revision, input,"
            " request_digest, suspension_digest, claimed_revision) VALUES ($1, $2, $3, $4, 1, '\\x7b7d', 'r', 's', 2)",
            run_id,
            suspension_id,
            scope.app,
            scope.tenant,
        )
    await db.con.execute(
        "INSERT INTO resume_starts (run_id, suspension_id, app, tenant, pinned_revision, request_digest)"
        " VALUES ($1, 1, $2, $3, 1, 'r')",
        run_id,
        scope.app,
        scope.tenant,
    )
    await db.con.execute(
        "INSERT INTO resume_closures (run_id, suspension_id, app, tenant, request, request_digest, event_id,"
        " run_revision) VALUES ($1, 1, $2, $3, '{}', 'r', gen_random_uuid(), 3)",
        run_id,
        scope.app,
        scope.tenant,
    )
    await db.con.execute(
        "INSERT INTO resume_expiries (run_id, suspension_id, app, tenant, pinned_revision, request_digest,"
        " event_id, run_revision) VALUES ($1, 2, $2, $3, 1, 'r', gen_random_uuid(), 2)",
        run_id,
        scope.app,
        scope.tenant,
    )
    await age(db, "runs", "ended_at", HOUR + 60, "id = $2", run_id)
    before = await rows_of(db, run_id)

    removed = await Pruner(stores.db, RETENTION, batch=10).prune((Kept.RUNS,))

    assert removed == {t: n for t, n in before.items() if n}
    assert {"resume_admissions": 2, "resume_starts": 1, "resume_expiries": 1, "resume_closures": 1}.items() <= (
        removed.items()
    )
    assert await rows_of(db, run_id) == dict.fromkeys(RUN_TABLES, 0)


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
            await writes(claimant, scope).suspensions.claim_suspension_version(pin(p))
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


async def test_a_command_re_sent_inside_the_idempotency_window_is_a_duplicate_and_after_it_a_new_command(
    worker: Worker, stores: Stores, db: Inspector, host: HostClient, scope: Scope
) -> None:
    cmd = start_command(scope, [{"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}, {"say": "done"}])
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        notice = await next_of(events, lambda e: isinstance(e, Notice) and e.run_id == cmd.run_id)
        assert isinstance(notice, Notice)
        resume = ResumeCommand(
            scope=scope, version=version_of(notice), results=[ToolAnswer(call_id=notice.pending[0].id, content="42")]
        )
        first = await host.resume(resume)
        await next_of(events, lambda e: isinstance(e, RunEvent) and e.kind is RunEventKind.COMPLETED)

        # Inside the window: the same message_id is the same command, acknowledged with no second effect.
        await host.resume(resume, message_id=first)
        # Past it (the record aged beyond the window and pruned): the same message_id is a new command,
        # judged afresh; the pause it answered is gone, so it is refused.
        await age(db, "inbox", "recorded_at", HOUR + 60, "message_id = $2", first)
        assert await Pruner(stores.db, RETENTION).prune((Kept.INBOX,)) == {"inbox": 1}
        await host.resume(resume, message_id=first)
        refused = await next_of(events, lambda e: isinstance(e, CommandRejected) and e.message_id == first)
    assert isinstance(refused, CommandRejected)
    assert refused.code in {"not_suspended", "run_conflict"}
    # Exactly one refusal: the re-send inside the window was a duplicate, not refused.
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id = $1 AND state = 'completed'", cmd.run_id) == 1


async def test_a_run_loads_only_the_most_recent_messages_of_a_long_session(
    stores: Stores, database_url: str, amqp_url: str, rabbit: Broker, host: HostClient, scope: Scope
) -> None:
    session = f"long-{uuid.uuid4().hex[:8]}"
    for _ in range(40):
        await ended_run(stores, scope, session_id=session)  # 80 messages, user and assistant in turn
    settings = fast_settings(
        database_url,
        amqp_url=amqp_url,
        bus_user=rabbit.bus.name,
        delivery_limit=DELIVERY_LIMIT,
        session_history_messages=5,
    )
    cmd = start_command(scope, [{"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}], session_id=session)
    async with running_worker(settings, executor=default_executor(), stores=stores), host.subscribe(scope) as events:
        await host.start(cmd)
        await next_of(events, lambda e: isinstance(e, Notice) and e.run_id == cmd.run_id)
    pause = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
    loaded = pause.continuation.messages[: pause.continuation.new_messages_from]
    # At most five, the most recent ones, never opening on a tool result.
    assert 0 < len(loaded) <= 5
    assert loaded[-1].content == "done"
    assert loaded[0].role is not Role.TOOL


async def test_prune_dry_run_counts_without_removing(
    stores: Stores, db: Inspector, database_url: str, scope: Scope
) -> None:
    doomed = [await ended_run(stores, scope) for _ in range(3)]
    await age(db, "runs", "ended_at", 31 * 86400, "id = ANY($2)", doomed)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERMISSION_")}
    env["INTERMISSION_DATABASE_URL"] = database_url
    ran = await cli("prune", "--dry-run", env=env)
    assert ran.code == 0, ran.err
    said = dict(line.split(" would remove ") for line in ran.out.splitlines())
    assert int(said["runs".ljust(20)]) == 3
    assert int(said["run_events".ljust(20)]) == 3
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id = ANY($1)", doomed) == 3

    ran = await cli("prune", env=env)
    assert ran.code == 0, ran.err
    assert "runs                 removed 3" in ran.out
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id = ANY($1)", doomed) == 0


async def test_a_capped_dead_letter_queue_refuses_rather_than_drops(amqp_vhost: Vhost) -> None:
    connection = await aio_pika.connect_robust(amqp_vhost.url())
    try:
        channel = await connection.channel(publisher_confirms=True)
        topology = await declare(channel, delivery_limit=DELIVERY_LIMIT, dead_max_length=1)
        # A quorum queue applies its length limit as its log catches up, so it may take one more than the
        # limit before it refuses; it must refuse within a few.
        taken: list[str] = []

        async def fill() -> None:
            for n in range(5):
                await topology.dead.publish(aio_pika.Message(b"{}", message_id=f"kept-{n}"), routing_key="")
                taken.append(f"kept-{n}")

        with pytest.raises(aio_pika.exceptions.DeliveryError):
            await fill()
        stats = await dead_stats(connection)
        head = await topology.dead_queue.get(no_ack=False)
    finally:
        await connection.close()
    # The oldest are kept, not dropped for the newest.
    assert taken
    assert head.message_id == "kept-0"
    assert stats.depth == len(taken)


async def test_the_prune_loop_prunes_while_the_broker_is_away(
    stores: Stores, db: Inspector, scope: Scope, settings: Settings, amqp_url: str
) -> None:
    doomed = [await ended_run(stores, scope) for _ in range(3)]
    await age(db, "runs", "ended_at", 31 * 86400, "id = ANY($2)", doomed)
    connection = await aio_pika.connect_robust(amqp_url)
    await connection.close()  # what a sweeper's connection is while the broker restarts
    metrics = SweeperMetrics()
    loop = PruneLoop(stores.db, connection, settings, metrics)
    removed = await loop.once()
    assert removed["runs"] == 3
    assert metrics.pruned.labels("runs")._value.get() == 3
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id = ANY($1)", doomed) == 0
