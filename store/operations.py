"""Operational reads across scopes, for the fleet's drain and the CLI. Never used to act on a run: acting
always goes through a scoped method with the run's own scope."""

from __future__ import annotations

from dataclasses import dataclass

from intermission.schemas.errors import InvalidArgument
from intermission.schemas.run import Run, RunState
from intermission.store import rows
from intermission.store.db import Database


@dataclass(frozen=True)
class RunningCount:
    running: int
    leased: int


class OperationsStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def count_running(self) -> RunningCount:
        async with self.db.connection() as con:
            row = await con.fetchrow("count_running")
        assert row is not None
        return RunningCount(running=row["running"], leased=row["leased"])

    async def list_runs(self, state: RunState | None, limit: int) -> list[Run]:
        if not 1 <= limit <= 1000:
            raise InvalidArgument("limit must be between 1 and 1000")
        async with self.db.connection() as con:
            found = await con.fetch("list_runs", state.value if state else None, limit)
        return [rows.run_from_row(r) for r in found]
