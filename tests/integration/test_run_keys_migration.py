"""Migration 0015 keys runs by their scope and id, and keeps every row.

A database at the migration before it (0014) is filled through the real transitions until every table that
names a run holds rows; 0015 is applied; every row is still there, as it was, and reads back through the
store at its run's scope; the demo ledger's rows carry their run's scope. A run paused before the migration
is resumed (and another decided) after it by the worker that started them, whose pooled sessions lived
through the migration as a previous release's do during a rolling deploy. A row whose scope is not its
run's, or a demo charge without a run, stops the migration with what to mend, and nothing is changed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from intermission.engine.commands import Start
from intermission.engine.core import Engine
from intermission.engine.starts import RunDefaults
from intermission.schemas.commands import DecideCommand, Decision, ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion
from intermission.store import Stores, migrate
from intermission.store.inbox import Receipt
from intermission.store.migrate import MigrationError, ensure_database
from tests.support import pg
from tests.support.factories import lease, paused_run, writes
from tests.support.fleet import Worker, fast_settings, start_command, worker
from tests.support.resume import admission_request, agent_reply_pause, closure_request

THIS = "runs_keyed_by_scope"
A = Scope(app="acme", tenant="t1")
B = Scope(app="globex", tenant="t1")
C = Scope(app="acme", tenant="t2")
LOOKUP = {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}
EMAIL = {"call": [{"tool": "send_email", "arguments": {"to": "cfo@example.com", "subject": "Q3"}}]}
DEFAULTS = RunDefaults(pause_ttl_seconds=0, max_steps=8)

# Every table that names a run, and the order its rows are compared in.
TABLES = {
    "runs": "app, tenant, id",
    "suspensions": "id",
    "checkpoints": "id",
    "progress": "app, tenant, run_id",
    "run_events": "id",
    "outbox": "id",
    "inbox": "app, tenant, message_id",
    "resume_admissions": "app, tenant, run_id, suspension_id",
    "resume_starts": "app, tenant, run_id, suspension_id",
    "resume_expiries": "app, tenant, run_id, suspension_id",
    "resume_closures": "app, tenant, run_id, suspension_id",
    "session_messages": "id",
    "demo_charges": "id",
}


@dataclass
class Before:
    """A database at 0014, and how to take it to 0015 (the migrations this test did not apply yet)."""

    url: str
    migrate_rest: Callable[[], Awaitable[list[str]]]


@pytest.fixture
async def before(pg_server: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Before]:
    name = f"intermission_keys_{uuid.uuid4().hex[:16]}"
    url = pg.with_database(pg_server, name)
    await ensure_database(url)
    everything = migrate.migrations()
    # The migrations before 0015 (the database is built at 0014), whatever came after it. The ones after it
    # add new names only (0016: the batch functions and their row types, which today's engine writes with)
    # and touch nothing 0015 changes: they go in first, so that today's engine can write the rows the
    # previous release wrote, through the same per-row functions.
    at = [m.name for m in everything].index(THIS)
    assert everything[at].version == 15, "this test builds the database at the migration before 0015"
    monkeypatch.setattr(migrate, "migrations", lambda: everything[:at] + everything[at + 1 :])
    await migrate.migrate(url)

    async def migrate_rest() -> list[str]:
        monkeypatch.setattr(migrate, "migrations", lambda: everything)
        return [m.name for m in await migrate.migrate(url)]

    yield Before(url, migrate_rest)
    await pg.drop(pg_server, name)


async def every_row(con: asyncpg.Connection[Any]) -> dict[str, list[dict[str, Any]]]:
    return {
        # Fixed table and column names of this module, never input.
        table: [dict(r) for r in await con.fetch(f"SELECT * FROM {table} ORDER BY {order}")]
        for table, order in TABLES.items()
    }


async def constraint(con: asyncpg.Connection[Any], name: str) -> str:
    found: str = await con.fetchval("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = $1", name)
    return found


async def version_of_pause(stores: Stores, scope: Scope, run_id: str) -> tuple[ClaimVersion, int | None, str]:
    pause = await stores.at(scope).suspensions.get_suspension(run_id)
    run = await stores.at(scope).runs.get_run(run_id)
    assert run.state is RunState.PAUSED
    version = ClaimVersion(run_id=run_id, suspension_id=pause.id, run_revision=run.revision)
    return version, pause.checkpoint_id, pause.pending[0].id


async def fill(stores: Stores, w: Worker, con: asyncpg.Connection[Any]) -> None:
    """Rows in every table that names a run, each written by its own transition (the demo ledger's in the
    previous release's form: that release's ledger wrote no scope)."""
    # Paused on an external tool, and on an approval; an approval decided; a run that completed.
    await w.control.start(start_command(A, [LOOKUP, {"say": "resumed after the migration"}], run_id="r-paused"))
    await w.control.start(start_command(A, [EMAIL, {"say": "approved after the migration"}], run_id="r-approval"))
    await w.control.start(start_command(B, [EMAIL, {"say": "approved before"}], run_id="r-decided"))
    await w.control.start(start_command(B, [{"say": "hello"}], run_id="r-done"))
    await w.drain()
    version, checkpoint, _ = await version_of_pause(stores, B, "r-decided")
    assert checkpoint is not None
    await w.control.decide(
        DecideCommand(scope=B, version=version, checkpoint_id=checkpoint, decision=Decision.APPROVE), principal="bob"
    )
    await w.drain()
    # A start applied with its command's inbox record, running under a lease with its first snapshot.
    running = StartCommand(scope=B, run_id="r-running", agent_id="demo", input="held")
    await (
        Engine.over(stores)
        .under(lease=lease(), defaults=DEFAULTS)
        .apply(Start(running, Receipt.of("m-running", "run.start", running)))
    )
    # Agent replies: one admitted, started and closed; one admitted and expired before it started.
    closed = await agent_reply_pause(stores, C, run_id="r-closed")
    admitted = await writes(stores, C).resume.admit_resume(admission_request(closed, C))
    await writes(stores, C).resume.start_resume("r-closed", closed.suspension.id, admitted.request_digest)
    await writes(stores, C).resume.close_resume(await closure_request(stores, C, closed))
    expired = await agent_reply_pause(stores, C, run_id="r-expired")
    admitted = await writes(stores, C).resume.admit_resume(admission_request(expired, C))
    await writes(stores, C).resume.expire_resume_admission("r-expired", expired.suspension.id, admitted.request_digest)
    await con.executemany(
        "INSERT INTO demo_charges (run_id, call_id, amount) VALUES ($1, $2, $3)",
        [("r-done", "call-1", Decimal(5)), ("r-running", "call-2", Decimal(7)), ("r-done", "call-3", Decimal(1))],
    )


async def test_the_migration_keeps_every_row_readable_and_a_paused_run_resumes_after_it(before: Before) -> None:
    # The worker of "the previous release": its pool and its fleet stay up through the migration.
    stores = await Stores.connect(before.url, min_size=1, max_size=4, generic_plans=True)
    w = worker(stores, fast_settings(before.url))
    con = await asyncpg.connect(before.url)
    try:
        await fill(stores, w, con)
        was = await every_row(con)
        assert {table for table, rows in was.items() if not rows} == set(), "a table that names a run is empty"
        assert await constraint(con, "runs_pkey") == "PRIMARY KEY (id)"

        assert await before.migrate_rest() == [THIS]

        now = await every_row(con)
        # Every row is still there, as it was; the demo ledger's rows have gained their run's scope.
        for table, rows in was.items():
            kept = [{k: v for k, v in row.items() if k in rows[0]} for row in now[table]]
            assert kept == rows, table
        scopes = {r["id"]: (r["app"], r["tenant"]) for r in now["runs"]}
        assert [(r["app"], r["tenant"]) for r in now["demo_charges"]] == [
            scopes[r["run_id"]] for r in was["demo_charges"]
        ]
        assert await constraint(con, "runs_pkey") == "PRIMARY KEY (app, tenant, id)"
        assert await constraint(con, "progress_pkey") == "PRIMARY KEY (app, tenant, run_id)"
        assert await constraint(con, "resume_closures_start_fkey") == (
            "FOREIGN KEY (app, tenant, run_id, suspension_id) "
            "REFERENCES resume_starts(app, tenant, run_id, suspension_id)"
        )

        # Each run reads back at its scope, with what it holds, through the store.
        for row in now["runs"]:
            scope = Scope(app=row["app"], tenant=row["tenant"])
            assert (await stores.at(scope).runs.get_run(row["id"])).state.value == row["state"]
            events = await stores.at(scope).runs.list_run_events(row["id"])
            assert len(events) == sum(1 for e in was["run_events"] if e["run_id"] == row["id"])
            outbox = await stores.at(scope).runs.list_outbox(row["id"])
            assert [o.message_id for o in outbox] == [
                str(o["message_id"]) for o in was["outbox"] if o["run_id"] == row["id"]
            ]
        assert (await stores.at(A).suspensions.get_suspension("r-approval")).checkpoint_id is not None
        assert (await stores.at(B).progress.get_progress("r-running")).owner
        assert [m.content for m in await stores.at(B).sessions.load("r-done")][-1] == "hello"
        assert await stores.at(B).ledger.times_charged("r-done") == {"call-1": 1, "call-3": 1}
        assert await stores.at(B).ledger.times_charged("r-running") == {"call-2": 1}
        for run_id, has in (("r-closed", ("start", "closure")), ("r-expired", ("expiry",))):
            (state,) = await stores.at(C).resume.list_run_admissions(run_id)
            assert (state.started_at is not None, state.closed_at is not None, state.expired_at is not None) == (
                "start" in has,
                "closure" in has,
                "expiry" in has,
            )

        # The runs paused before the migration go on after it, through the sessions that lived through it.
        version, _, call = await version_of_pause(stores, A, "r-paused")
        await w.control.resume(ResumeCommand(scope=A, version=version, results=[ToolAnswer(call_id=call)]))
        version, checkpoint, _ = await version_of_pause(stores, A, "r-approval")
        assert checkpoint is not None
        await w.control.decide(
            DecideCommand(scope=A, version=version, checkpoint_id=checkpoint, decision=Decision.APPROVE),
            principal="alice",
        )
        await w.drain()
        for run_id, said in (
            ("r-paused", "resumed after the migration"),
            ("r-approval", "approved after the migration"),
        ):
            ended = await stores.at(A).runs.get_run(run_id)
            assert (ended.state, ended.output) == (RunState.COMPLETED, said)
        # And an id of before the migration is now only its scope's: another scope starts a run of its own.
        assert (await paused_run(stores, B, run_id="r-paused")).run.scope == B
        assert await con.fetchval("SELECT count(*) FROM runs WHERE id = 'r-paused'") == 2
    finally:
        await w.fleet.stop(grace=5)
        await stores.close()
        await con.close()


async def test_a_row_of_another_scope_than_its_runs_or_a_charge_without_a_run_stops_the_migration(
    before: Before,
) -> None:
    stores = await Stores.connect(before.url, min_size=1, max_size=2)
    con = await asyncpg.connect(before.url)
    try:
        p = await paused_run(stores, A)
        await con.execute("UPDATE suspensions SET tenant = 't9' WHERE run_id = $1", p.run.id)
        with pytest.raises(MigrationError) as refused:
            await before.migrate_rest()
        assert "migration 0015_runs_keyed_by_scope refused: 1 row(s) of suspensions name a run of another scope" in (
            refused.value.detail
        )
        assert "SELECT x.* FROM suspensions x" in refused.value.detail
        # Nothing of it stayed: the old key, no scope in the ledger, no record of the migration.
        assert await constraint(con, "runs_pkey") == "PRIMARY KEY (id)"
        assert (
            await con.fetchval(
                "SELECT count(*) FROM information_schema.columns WHERE table_name = 'demo_charges'"
                " AND column_name = 'app'"
            )
            == 0
        )
        assert await con.fetchval("SELECT count(*) FROM schema_migrations WHERE version = 15") == 0

        await con.execute("UPDATE suspensions SET tenant = $1 WHERE run_id = $2", A.tenant, p.run.id)
        await con.execute("INSERT INTO demo_charges (run_id, call_id, amount) VALUES ('no-such-run', 'c', 1)")
        with pytest.raises(MigrationError, match=r"1 demo charge\(s\) name no run"):
            await before.migrate_rest()
        assert await con.fetchval("SELECT count(*) FROM schema_migrations WHERE version = 15") == 0

        await con.execute("DELETE FROM demo_charges WHERE run_id = 'no-such-run'")
        assert await before.migrate_rest() == [THIS]
        assert (await stores.at(A).suspensions.get_suspension(p.run.id)).id == p.suspension.id
    finally:
        await stores.close()
        await con.close()
