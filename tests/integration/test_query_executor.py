"""The store's executor runs only the named statements of store/queries, on the real database."""

from __future__ import annotations

import asyncpg
import pytest

from intermission.store.db import Conn


async def test_the_executor_runs_only_names_it_knows(database_url: str) -> None:
    raw = await asyncpg.connect(database_url)
    try:
        con = Conn(raw)
        for not_a_name in ("SELECT 1", "DROP TABLE runs", "get_run; DROP TABLE runs", "GET_RUN", ""):
            with pytest.raises(KeyError):
                await con.fetch(not_a_name)
            with pytest.raises(KeyError):
                await con.fetchrow(not_a_name)
            with pytest.raises(KeyError):
                await con.fetchval(not_a_name)
            with pytest.raises(KeyError):
                await con.execute(not_a_name)
        assert await raw.fetchval("SELECT to_regclass('runs') IS NOT NULL") is True
        # A known name does run.
        assert await con.fetchrow("get_run", "no-such-run", "acme", "t1") is None
    finally:
        await raw.close()
