"""The seed's ProgressStore: a running run's last durable boundary, written only by its lease owner."""

from __future__ import annotations

from intermission.schemas.errors import ProgressNotFound, RunLeaseLost
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import Progress
from intermission.store import rows
from intermission.store.db import Conn, Database


async def save_progress_in(con: Conn, scope: Scope, p: Progress) -> Progress:
    """``save_progress`` inside a transaction the caller already holds."""
    if not p.owner:
        raise RunLeaseLost("an empty owner never holds a lease")
    updated_at = await con.fetchval(
        "save_progress", p.run_id, scope.app, scope.tenant, p.owner, *rows.progress_columns(p)
    )
    if updated_at is None:
        raise RunLeaseLost(f"{p.owner} does not hold a live lease on run {p.run_id} at scope {scope}")
    return p.model_copy(update={"scope": scope, "updated_at": updated_at})


class ProgressStore:
    """Progress snapshots at the caller's exact scope."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def save_progress(self, scope: Scope, p: Progress) -> Progress:
        """Upsert the run's snapshot, only while the run is running under ``p.owner``'s live lease;
        RunLeaseLost otherwise, and nothing is written. An empty owner never matches, not even a run that
        holds no lease. Returns the snapshot with the scope and time the store gave it."""
        require_scope(scope)
        if not p.owner:  # refused before any I/O, like a half lease
            raise RunLeaseLost("an empty owner never holds a lease")
        # One statement is its own transaction: BEGIN and COMMIT around it would be two more round trips.
        async with self.db.connection() as con:
            return await save_progress_in(con, scope, p)

    async def get_progress(self, scope: Scope, run_id: str) -> Progress:
        require_scope(scope)
        async with self.db.connection() as con:
            row = await con.fetchrow("get_progress", run_id, scope.app, scope.tenant)
        if row is None:
            raise ProgressNotFound(f"no progress for run {run_id} at scope {scope}")
        return rows.progress_from_row(row)

    async def delete_progress(self, scope: Scope, run_id: str) -> None:
        """Remove the run's snapshot; nothing to remove is not an error."""
        require_scope(scope)
        async with self.db.connection() as con:
            await con.execute("delete_progress", run_id, scope.app, scope.tenant)
