"""A running run's last durable boundary, as it is read (its holder writes it through the engine)."""

from __future__ import annotations

from intermission.schemas.errors import ProgressNotFound
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Progress
from intermission.store import rows
from intermission.store.db import Database


class ProgressStore:
    """Progress snapshots at one exact scope."""

    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def get_progress(self, run_id: str) -> Progress:
        async with self.db.connection() as con:
            row = await con.fetchrow("get_progress", run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise ProgressNotFound(f"no progress for run {run_id} at scope {self.scope}")
        return rows.progress_from_row(row)
