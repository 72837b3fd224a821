"""A running run's last durable boundary, as it is read (its holder writes it through the engine)."""

from __future__ import annotations

from intermission.schemas.errors import ProgressNotFound
from intermission.schemas.suspension import Progress
from intermission.store import rows
from intermission.store.scoped import ScopedReader


class ProgressStore(ScopedReader):
    """Progress snapshots at one exact scope."""

    async def get_progress(self, run_id: str) -> Progress:
        found = await self._found("get_progress", run_id, ProgressNotFound, f"progress for run {run_id}")
        return rows.progress_from_row(found)
