"""A worker's database sessions plan each statement once and keep the plan (store/db.py, Database.connect):
its pool and the connection its lease keeper opens beside it; the sweeper's sessions, whose scans range over
deadlines, keep PostgreSQL's default. The claims and ends of the rest of the suite run under the worker's
mode (tests/conftest.py), so a transition that a generic plan got wrong would fail there."""

from __future__ import annotations

from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.store import Stores


async def test_a_workers_sessions_plan_generically_and_others_keep_the_default(settings: Settings) -> None:
    async with running_worker(settings) as w:
        async with w.stores.db.connection() as con:
            assert await con.raw.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
        beside = await w.stores.db.connect_dedicated("test lease keeper", command_timeout=10)
        try:
            assert await beside.raw.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
        finally:
            await beside.raw.close()
    other = await Stores.connect(settings.database_url, min_size=1, max_size=1)
    try:
        async with other.db.connection() as con:
            assert await con.raw.fetchval("SHOW plan_cache_mode") == "auto"
    finally:
        await other.close()
