"""Runs at one exact scope, as they are read: a run, its metadata events, its outbox rows, the Notice of a
pause; and the renewal of one run's lease (a worker renews all of its leases at once: ``store/leases.py``).

Every change of a run is a transition of the engine (``engine/``); nothing here writes a run's state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from intermission.schemas.errors import RunLeaseLost, RunNotFound
from intermission.schemas.run import Lease, Run
from intermission.store import rows
from intermission.store.rows import header_table, stored
from intermission.store.scoped import ScopedReader


class RunStore(ScopedReader):
    async def get_run(self, run_id: str) -> Run:
        return rows.run_from_row(await self._found("get_run", run_id, RunNotFound, f"run {run_id}"))

    async def renew_lease(self, run_id: str, lease: Lease) -> None:
        """Extend a live lease. A lease that lapsed or passed to someone else is RunLeaseLost: its holder
        must stop at once and write nothing more."""
        if not lease.is_set:
            raise RunLeaseLost("a lease needs both an owner and a ttl")
        async with self.db.connection() as con:
            expires = await con.fetchval(
                "renew_lease", run_id, self.scope.app, self.scope.tenant, lease.owner, lease.ttl_seconds
            )
        if expires is None:
            raise RunLeaseLost(f"{lease.owner} no longer holds run {run_id}")

    async def list_run_events(self, run_id: str) -> list[dict[str, object]]:
        return [{**r, "data": json.loads(r["data"])} for r in await self._run_rows("list_run_events", run_id)]

    async def list_outbox(self, run_id: str) -> list[RunOutboxRow]:
        """Operators: the run's outbox rows in order, where each stands, never their bodies."""
        found = await self._run_rows("list_run_outbox", run_id)
        return [stored(RunOutboxRow, r, headers=header_table(r["headers"])) for r in found]

    async def notice_of_pause(self, run_id: str, suspension_id: int) -> StoredEvent | None:
        """The outbox row that carried the Notice of pause ``suspension_id``, whole (None: there is none,
        or it was pruned)."""
        r = await self._run_row("notice_of_pause", run_id, suspension_id)
        return None if r is None else stored(StoredEvent, r, headers=header_table(r["headers"]))


@dataclass(frozen=True)
class RunOutboxRow:
    """One of a run's outbox rows as operators see it: where it goes and where it stands, not its body."""

    id: int
    message_id: str
    routing_key: str
    correlation_id: str | None
    headers: dict[str, str | int | float | bool]
    created_at: datetime
    sent_at: datetime | None
    attempts: int
    next_attempt_at: datetime | None
    quarantined_at: datetime | None
    last_error: str | None


@dataclass(frozen=True)
class StoredEvent:
    """An outbox row whole, to be published again exactly as it was written."""

    id: int
    message_id: str
    routing_key: str
    body: str
    correlation_id: str | None
    headers: dict[str, str | int | float | bool]
