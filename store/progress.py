"""The original's ProgressStore: a running run's last durable boundary, written only by its lease owner."""

from __future__ import annotations

from intermission.schemas.errors import ProgressNotFound, RunLeaseLost
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Ending, Progress
from intermission.store import rows
from intermission.store.db import Database


class ProgressStore:
    """Progress snapshots at one exact scope."""

    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def save_progress(self, p: Progress) -> Progress:
        """Upsert the run's snapshot, only while the run is running under ``p.owner``'s live lease;
        RunLeaseLost otherwise, and nothing is written. An empty owner never matches, not even a run that
        holds no lease. The run row takes the snapshot's step and token counts in the same statement.

        Returns the snapshot as stored: with the scope and time the store gave it, and with the end asked of
        the run while it ran (a cancel), which no snapshot can take back, as its ``ending``."""
        if not p.owner:  # refused before any I/O, like a half lease
            raise RunLeaseLost("an empty owner never holds a lease")
        row = await self.db.progress_saves.fetchrow(
            run_id=p.run_id,
            app=self.scope.app,
            tenant=self.scope.tenant,
            owner=p.owner,
            **rows.progress_arguments(p),
            step_count=p.continuation.step_index,
            tokens_used=p.continuation.tokens_used,
        )
        if row is None or row["saved_at"] is None:
            raise RunLeaseLost(f"{p.owner} does not hold a live lease on run {p.run_id} at scope {self.scope}")
        asked = None if row["ending"] is None else rows.load_model(Ending, row["ending"], "run ending")
        return p.model_copy(update={"scope": self.scope, "updated_at": row["saved_at"], "ending": asked or p.ending})

    async def get_progress(self, run_id: str) -> Progress:
        async with self.db.connection() as con:
            row = await con.fetchrow("get_progress", run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise ProgressNotFound(f"no progress for run {run_id} at scope {self.scope}")
        return rows.progress_from_row(row)

    async def delete_progress(self, run_id: str) -> None:
        """Remove the run's snapshot; nothing to remove is not an error."""
        async with self.db.connection() as con:
            await con.execute("delete_progress", run_id, self.scope.app, self.scope.tenant)
