"""A worker's statements probe keys whatever the planner thinks of the tables (migrations 0010 and 0013,
store/db.py ``generic_plans``): on tables that were never analysed, the plans a worker's session makes once
and keeps never walk a whole tenant or the whole outbox.

The plans are read off PostgreSQL itself: each session loads ``auto_explain`` (the tests' role is a
superuser), which sends the plan of every statement it runs, nested ones included, to the client as a log
message. The tables are filled first without ever being analysed, as a new deployment's are for its first
minute, and autovacuum is off for them so that nothing analyses them meanwhile."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from intermission.engine.commands import Resume
from intermission.engine.core import Engine
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.events import RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion
from intermission.store import Stores
from intermission.store.db import Database
from intermission.store.inbox import Receipt
from intermission.store.queries import QUERIES
from intermission.wire import Command
from tests.support.factories import PausedRun, lease, paused_run, writes
from tests.support.inspect import Inspector

PAUSED = 300
OUTBOX_ROWS = 3000
# Indexes a lookup by run id must never take: led by the scope alone, they walk the tenant.
NOT_KEYS = ("runs_by_session", "suspensions_by_reason")
# A probe of a run's rows by the run id alone: since a run id is unique only within its scope (migration
# 0015), it walks every scope's run of that id. Every probe names the whole key.
BY_ID_ALONE = re.compile(
    r"(?: on runs \w+[^\n]*\n\s*Index Cond: \(id = [^()]*\)$)|(?:Index Cond: \(run_id = [^()]*\)$)", re.MULTILINE
)
TABLES = ("runs", "suspensions", "progress", "outbox", "inbox", "run_events", "checkpoints")


class Plans:
    """The plans a session's statements were run with, as auto_explain sent them."""

    def __init__(self) -> None:
        self.logged: list[str] = []

    def heard(self, _con: Any, message: asyncpg.PostgresLogMessage) -> None:
        if "plan:" in str(message.message):
            self.logged.append(str(message.message))

    def walking(self) -> list[str]:
        """The plans that scan a whole table of Intermission's, or probe a run by the scope or the id alone."""
        return [
            plan
            for plan in self.logged
            if any(f"Seq Scan on {table} " in plan for table in TABLES)
            or any(index in plan for index in NOT_KEYS)
            or BY_ID_ALONE.search(plan)
        ]


async def explain(con: asyncpg.Connection[Any]) -> None:
    """Have the session send the plan of every statement it runs to the client."""
    await con.execute("LOAD 'auto_explain'")
    await con.execute("SET auto_explain.log_min_duration = 0")
    await con.execute("SET auto_explain.log_nested_statements = on")
    await con.execute("SET client_min_messages = log")


@pytest.fixture
async def unanalysed(database_url: str, db: Inspector) -> None:
    # Nothing may analyse the tables while the test fills them: the plans must be made without statistics.
    for table in TABLES:
        await db.con.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    analysed = await db.con.fetchval(
        "SELECT count(*) FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL"
    )
    assert analysed == 0


class ExplainedConnection(asyncpg.Connection):
    """A pooled connection whose plan listener goes with each release and comes back with each acquire
    (the pool's ``setup``): asyncpg drops listeners on release, and warns about one left on a connection."""

    def _on_release(self, stacklevel: int = 1) -> None:
        getattr(self, "_log_listeners").clear()  # noqa: B009 - asyncpg's own, undeclared in its stubs
        getattr(super(), "_on_release")(stacklevel + 1)  # noqa: B009


@pytest.fixture
async def worker_sessions(database_url: str, unanalysed: None) -> AsyncIterator[tuple[Stores, Plans]]:
    plans = Plans()

    async def init(con: asyncpg.Connection[Any]) -> None:
        await explain(con)

    async def setup(con: Any) -> None:
        con.add_log_listener(plans.heard)

    async def keep(_con: asyncpg.Connection[Any]) -> None:
        """No RESET ALL on release (as the store's own pools): it would take auto_explain's settings away."""

    pool = await asyncpg.create_pool(
        database_url,
        min_size=1,
        max_size=2,
        init=init,
        setup=setup,
        server_settings={"plan_cache_mode": "force_generic_plan"},
        connection_class=ExplainedConnection,
        reset=keep,
    )
    stores = Stores(Database(pool, dsn=database_url))
    yield stores, plans
    await stores.close()


async def resume_and_end(stores: Stores, p: PausedRun) -> None:
    cmd = ResumeCommand(
        scope=p.run.scope,
        version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
        results=[ToolAnswer(call_id="c1", content="42")],
    )
    receipt = Receipt.of(str(uuid.uuid4()), Command.RESUME.value, cmd)
    claimed = await Engine.over(stores, lease=lease()).apply(Resume(cmd, receipt=receipt))
    await writes(stores, p.run.scope).runs.end_run(p.run.id, claimed.run.lease_owner or "", RunEventKind.COMPLETED)


async def test_a_resume_and_an_end_probe_their_run_by_key_among_hundreds_of_the_same_tenant(
    worker_sessions: tuple[Stores, Plans], scope: Scope
) -> None:
    stores, plans = worker_sessions
    # The first resume and end plan their statements while the tables hold next to nothing, and the sessions
    # keep those plans; the next ones run them among hundreds of paused runs of the same tenant.
    await resume_and_end(stores, await paused_run(stores, scope))
    runs = [await paused_run(stores, scope) for _ in range(PAUSED)]
    plans.logged.clear()
    await resume_and_end(stores, runs[PAUSED // 2])

    assert plans.logged  # auto_explain spoke: the check below looked at real plans
    assert plans.walking() == []


async def test_a_resume_and_an_end_probe_their_run_by_key_among_hundreds_of_runs_of_the_same_id(
    worker_sessions: tuple[Stores, Plans],
) -> None:
    """A run id is unique only within its scope (migration 0015): hundreds of tenants may each have a run
    "r1", and a worker's statements still probe the one run by its whole key."""
    stores, plans = worker_sessions
    await resume_and_end(stores, await paused_run(stores, Scope(app="acme", tenant="first"), run_id="r1"))
    runs = [await paused_run(stores, Scope(app="acme", tenant=f"t{n:03d}"), run_id="r1") for n in range(PAUSED)]
    plans.logged.clear()
    await resume_and_end(stores, runs[PAUSED // 2])

    assert plans.logged
    assert plans.walking() == []


async def test_marking_outbox_rows_sent_probes_their_keys_in_an_outbox_of_thousands(
    database_url: str, unanalysed: None, db: Inspector
) -> None:
    plans = Plans()
    con = await asyncpg.connect(database_url, server_settings={"plan_cache_mode": "force_generic_plan"})
    try:
        await explain(con)
        con.add_log_listener(plans.heard)
        # Planned (and kept) on an empty outbox: keys it never had mark nothing.
        assert await con.fetchval(QUERIES["mark_outbox_sent"].sql, [1, 2]) == 0
        assert await con.fetchval(QUERIES["mark_handed_outbox_sent"].sql, [uuid.uuid4()]) == 0
        await db.con.execute(
            "INSERT INTO outbox (message_id, routing_key, body, app, tenant)"
            " SELECT gen_random_uuid(), 'run.completed.a.t', '{}', 'a', 't' FROM generate_series(1, $1)",
            OUTBOX_ROWS,
        )
        rows = await db.con.fetch("SELECT id, message_id FROM outbox ORDER BY id DESC LIMIT 10")
        plans.logged.clear()
        assert await con.fetchval(QUERIES["mark_outbox_sent"].sql, [r["id"] for r in rows[:5]]) == 5
        assert await con.fetchval(QUERIES["mark_handed_outbox_sent"].sql, [r["message_id"] for r in rows[5:]]) == 5
        # A key marked already, and one the outbox never had, mark nothing.
        assert await con.fetchval(QUERIES["mark_handed_outbox_sent"].sql, [rows[5]["message_id"], uuid.uuid4()]) == 0
        con.remove_log_listener(plans.heard)
    finally:
        await con.close()
    assert await db.con.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL") == 10
    assert plans.logged
    assert plans.walking() == []
