"""Helpers the store tests share (this module holds no tests).

``Inspector`` reads the database behind the store's back, over a raw connection of its own, so a test can
assert the rows a store call left (or did not leave) without trusting the store to report them. Waits are
on conditions judged by the DATABASE clock, polled in a bounded loop; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import asyncpg

from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, LeasedClaim, Progress, ProgressResult
from intermission.store import Stores
from tests.support.factories import PausedRun, continuation, lease

# Far enough ahead that LEAST(expired_by, now()) is the database clock: "expired as of now".
FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)
# How long a test may wait for the database clock to pass a deadline or a lease expiry it set itself
# a millisecond ahead. Generous: it bounds a hang, it is not a measurement.
WAIT_LIMIT_SECONDS = 10.0

# Tables whose every row a "nothing was written" assertion compares (all of them but the migration log).
_TABLES_SQL = """
SELECT table_name FROM information_schema.tables
 WHERE table_schema = 'public' AND table_type = 'BASE TABLE' AND table_name <> 'schema_migrations'
 ORDER BY table_name
"""


class Inspector:
    """A raw connection for looking at rows, and for the few faults a test injects on purpose."""

    def __init__(self, con: asyncpg.Connection[Any]) -> None:
        self.con = con

    async def tables(self) -> list[str]:
        return [r["table_name"] for r in await self.con.fetch(_TABLES_SQL)]

    async def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table, in a stable order: equal snapshots mean nothing was written."""
        found: dict[str, list[tuple[Any, ...]]] = {}
        for table in await self.tables():
            quoted = await self.con.fetchval("SELECT quote_ident($1)", table)
            rows = await self.con.fetch(f"SELECT * FROM {quoted}")
            found[table] = sorted((tuple(r.values()) for r in rows), key=repr)
        return found

    async def count(self, table: str, run_id: str | None = None) -> int:
        quoted = await self.con.fetchval("SELECT quote_ident($1)", table)
        if run_id is None:
            return int(await self.con.fetchval(f"SELECT count(*) FROM {quoted}"))
        return int(await self.con.fetchval(f"SELECT count(*) FROM {quoted} WHERE run_id = $1", run_id))

    async def run(self, run_id: str) -> asyncpg.Record:
        row: asyncpg.Record | None = await self.con.fetchrow(
            "SELECT id, app, tenant, state::text AS state, revision, lease_owner, lease_expires_at, updated_at"
            "  FROM runs WHERE id = $1",
            run_id,
        )
        assert row is not None, f"no run {run_id}"
        return row

    async def suspension(self, run_id: str) -> asyncpg.Record | None:
        return await self.con.fetchrow(
            "SELECT id, run_id, app, tenant, reason::text AS reason, expires_at FROM suspensions WHERE run_id = $1",
            run_id,
        )

    async def progress(self, run_id: str) -> asyncpg.Record | None:
        return await self.con.fetchrow("SELECT run_id, app, tenant, owner FROM progress WHERE run_id = $1", run_id)

    async def now(self) -> datetime:
        value: datetime = await self.con.fetchval("SELECT clock_timestamp()")
        return value

    async def wait_until(self, condition_sql: str, *args: Any) -> None:
        """Poll ``condition_sql`` (one boolean, judged by the database) until it holds; bounded.

        Inside a transaction PostgreSQL answers every read of pg_stat_activity from the snapshot its first
        read took; each poll clears it, so a condition on other sessions is seen as it becomes true."""
        async with asyncio.timeout(WAIT_LIMIT_SECONDS):
            while not await self.con.fetchval(condition_sql, *args):
                await self.con.execute("SELECT pg_stat_clear_snapshot(), pg_sleep(0.001)")

    async def wait_lease_lapsed(self, run_id: str) -> None:
        await self.wait_until("SELECT lease_expires_at <= now() FROM runs WHERE id = $1", run_id)

    async def wait_pause_expired(self, run_id: str) -> None:
        await self.wait_until("SELECT expires_at <= now() FROM suspensions WHERE run_id = $1", run_id)

    async def fail_inserts_into(self, table: str) -> None:
        """Make every later INSERT into ``table`` raise inside the writing transaction (a test fault)."""
        quoted = await self.con.fetchval("SELECT quote_ident($1)", table)
        await self.con.execute(
            "CREATE OR REPLACE FUNCTION test_fault() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'injected fault'; END $$"
        )
        await self.con.execute(
            f"CREATE TRIGGER test_fault BEFORE INSERT ON {quoted} FOR EACH ROW EXECUTE FUNCTION test_fault()"
        )


@asynccontextmanager
async def inspector(database_url: str) -> AsyncIterator[Inspector]:
    con = await asyncpg.connect(database_url)
    try:
        yield Inspector(con)
    finally:
        await con.close()


async def closed_stores(database_url: str) -> Stores:
    """Stores over a pool that is already closed: any statement they tried to send would fail with
    StoreUnavailable, so a call that raises something else provably sent none."""
    s = await Stores.connect(database_url, min_size=1, max_size=1)
    await s.close()
    return s


def unvalidated_scope(**fields: Any) -> Any:
    """A Scope built WITHOUT validation (``model_construct``), as a careless or hostile caller could."""
    return Scope.model_construct(**fields)


def pin(p: PausedRun) -> ClaimVersion:
    return ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision)


def snapshot_for(run_id: str, who: str, *, step: int = 2) -> Progress:
    return Progress(
        run_id=run_id,
        owner=who,
        continuation=continuation(step),
        done=[ProgressResult(call_id="c1", content=f"answer seen by {who}")],
    )


def leased(
    p: PausedRun,
    holder: Lease | None = None,
    *,
    expired_by: datetime | None = None,
    with_first: bool = True,
    version: ClaimVersion | None = None,
) -> LeasedClaim:
    held = holder or lease()
    return LeasedClaim(
        version=version or pin(p),
        expired_by=expired_by,
        lease=held,
        first=snapshot_for(p.run.id, held.owner) if with_first else None,
    )


def winners(results: list[Any]) -> list[int]:
    """Indexes of contenders that returned a value rather than raising."""
    return [i for i, r in enumerate(results) if not isinstance(r, BaseException)]


def unexpected(results: list[Any], allowed: tuple[type[BaseException], ...]) -> list[BaseException]:
    """Exceptions among ``results`` that are not of the ``allowed`` kinds (a bug, whatever the race)."""
    return [r for r in results if isinstance(r, BaseException) and not isinstance(r, allowed)]
