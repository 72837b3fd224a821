"""The conformance suite (``tests/support/conformance.py``) against PostgreSQL: the same cases
``tests/unit/test_conformance_memory.py`` runs against the in-memory committer.

Each case runs here twice: over the real database, then over a fresh in-memory world, and the two are
compared row for row: the output rows of every transition, in commit order, and every table at the end (what
differs by nature, times and random ids, masked). So the fake is held to the database by what the database
hands back and keeps, not only by what the cases happen to assert.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from intermission.engine.core import Engine
from intermission.engine.memory import InMemoryCommitter
from intermission.engine.postgres import PostgresCommitter
from intermission.engine.sink import CollectedEvents
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.store.leases import LeaseLine
from tests.support.conformance import (
    CASES,
    TABLES,
    Case,
    MemoryWorld,
    Recording,
    Row,
    case_id,
    dump,
    first_difference,
    ordered,
)
from tests.support.inspect import Inspector


class PostgresWorld:
    """The world over the real database: the engine commits through ``committer``; the tables are read, and
    what no transition does is done, over the inspector's own connection."""

    def __init__(self, stores: Stores, con: asyncpg.Connection[Any], committer: Recording) -> None:
        self.stores = stores
        self.engine = Engine(committer, stores=stores)
        self.sink = CollectedEvents()
        self.engine.hand_events_to(self.sink)
        self.con = con

    async def table(self, name: str) -> list[Row]:
        assert name in TABLES  # a name of ours, never a caller's text
        return ordered(name, await self.con.fetch(f"SELECT * FROM {name}"))

    async def set_quota(self, scope: Scope, live_runs: int | None, starts_per_second: float | None) -> None:
        await self.con.execute(
            "INSERT INTO scope_quotas (app, tenant, live_runs, starts_per_second) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (app, tenant) DO UPDATE"
            " SET live_runs = EXCLUDED.live_runs, starts_per_second = EXCLUDED.starts_per_second",
            scope.app,
            scope.tenant,
            live_runs,
            starts_per_second,
        )

    async def quarantine(self, outbox_id: int) -> None:
        # What the relay does with a row the broker refused its last allowed time (publishers/relay.py).
        await self.con.execute(
            "UPDATE outbox SET attempts = attempts + 1, quarantined_at = now(), last_error = 'refused' WHERE id = $1",
            outbox_id,
        )

    async def later(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def lease_line(self) -> LeaseLine:
        return LeaseLine(self.stores.db, timeout=5.0, application_name="conformance-lease-line")

    async def spoil(self, table: str, scope: Scope, run_id: str, column: str, value: str) -> None:
        assert table in TABLES  # names of ours, never a caller's text
        assert column.isidentifier()
        key = "id" if table == "runs" else "run_id"
        await self.con.execute(
            f"UPDATE {table} SET {column} = $4::jsonb WHERE app = $1 AND tenant = $2 AND {key} = $3",
            scope.app,
            scope.tenant,
            run_id,
            value,
        )


@pytest.mark.parametrize("case", CASES, ids=case_id)
async def test_postgres_conforms_and_the_in_memory_committer_matches_it_row_for_row(
    case: Case, stores: Stores, db: Inspector
) -> None:
    real = Recording(PostgresCommitter(stores.db))
    postgres = PostgresWorld(stores, db.con, real)
    await case(postgres)

    memory = InMemoryCommitter()
    fake = Recording(memory)
    await case(MemoryWorld(fake, memory))

    assert [name for name, _ in fake.outs] == [name for name, _ in real.outs]
    difference = first_difference(fake.outs, real.outs, "outs")
    assert difference is None, difference
    tables, expected = await dump(MemoryWorld(memory=memory), fake.shape), await dump(postgres, real.shape)
    difference = first_difference(tables, expected, "tables")
    assert difference is None, difference
