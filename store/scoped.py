"""What the store's scoped read models share: a reader bound to one exact scope, which adds the scope to
every statement about one run."""

from __future__ import annotations

import asyncpg

from intermission.schemas.errors import IntermissionError
from intermission.schemas.scope import Scope
from intermission.store.db import Database


class ScopedReader:
    """A reader bound to one exact scope. Every statement about one run takes that run's key first (``$1``
    run id, ``$2`` app, ``$3`` tenant), so the scope is added here and nowhere else."""

    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def _run_rows(self, query: str, run_id: str, *more: object) -> list[asyncpg.Record]:
        async with self.db.connection() as con:
            return await con.fetch(query, run_id, self.scope.app, self.scope.tenant, *more)

    async def _run_row(self, query: str, run_id: str, *more: object) -> asyncpg.Record | None:
        async with self.db.connection() as con:
            return await con.fetchrow(query, run_id, self.scope.app, self.scope.tenant, *more)

    async def _found(self, query: str, run_id: str, missing: type[IntermissionError], what: str) -> asyncpg.Record:
        """The run's row by ``query``; ``missing`` saying there is no ``what`` at this scope when there is none."""
        row = await self._run_row(query, run_id)
        if row is None:
            raise missing(f"no {what} at scope {self.scope}")
        return row
