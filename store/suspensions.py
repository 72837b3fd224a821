"""Pauses at one exact scope, as they are read: a run's live pause, and the pauses past their deadline.

Every claim, creation, removal or move of a pause is a transition of the engine (``engine/claims.py``,
``engine/pauses.py``); a read followed by a separate write is exactly the race a claim exists to close.
"""

from __future__ import annotations

from datetime import datetime

from intermission.schemas.errors import NotSuspended
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Suspension
from intermission.store import rows
from intermission.store.db import Database


class SuspensionStore:
    """Suspensions at one exact scope."""

    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def get_suspension(self, run_id: str) -> Suspension:
        """Read a run's pause without changing anything. To resume, claim instead: a read followed by a
        separate write is the race the claims exist to close."""
        async with self.db.connection() as con:
            row = await con.fetchrow("get_suspension", run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise NotSuspended(f"no suspension for run {run_id} at scope {self.scope}")
        return rows.suspension_from_row(row)

    async def list_expired(self, now: datetime, limit: int | None) -> list[Suspension]:
        """Pauses at this scope whose deadline is at or before ``now`` (and the database clock)."""
        bounded = rows.optional_limit(limit)
        async with self.db.connection() as con:
            found = await con.fetch("list_expired", self.scope.app, self.scope.tenant, now, bounded)
        return [rows.suspension_from_row(r) for r in found]
