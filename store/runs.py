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
from intermission.schemas.scope import Scope
from intermission.store import rows
from intermission.store.db import Database


class RunStore:
    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def get_run(self, run_id: str) -> Run:
        async with self.db.connection() as con:
            row = await con.fetchrow("get_run", run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise RunNotFound(f"no run {run_id} at scope {self.scope}")
        return rows.run_from_row(row)

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
        async with self.db.connection() as con:
            found = await con.fetch("list_run_events", run_id, self.scope.app, self.scope.tenant)
        return [
            {
                "event_id": r["event_id"],
                "kind": r["kind"],
                "revision": r["revision"],
                "data": json.loads(r["data"]),
                "created_at": r["created_at"],
            }
            for r in found
        ]

    async def list_outbox(self, run_id: str) -> list[RunOutboxRow]:
        """Operators: the run's outbox rows in order, where each stands, never their bodies."""
        async with self.db.connection() as con:
            found = await con.fetch("list_run_outbox", run_id, self.scope.app, self.scope.tenant)
        return [
            RunOutboxRow(
                id=r["id"],
                message_id=r["message_id"],
                routing_key=r["routing_key"],
                correlation_id=r["correlation_id"],
                headers=_header_table(r["headers"]),
                created_at=r["created_at"],
                sent_at=r["sent_at"],
                attempts=r["attempts"],
                next_attempt_at=r["next_attempt_at"],
                quarantined_at=r["quarantined_at"],
                last_error=r["last_error"],
            )
            for r in found
        ]

    async def notice_of_pause(self, run_id: str, suspension_id: int) -> StoredEvent | None:
        """The outbox row that carried the Notice of pause ``suspension_id``, whole (None: there is none,
        or it was pruned)."""
        async with self.db.connection() as con:
            r = await con.fetchrow("notice_of_pause", run_id, self.scope.app, self.scope.tenant, suspension_id)
        if r is None:
            return None
        return StoredEvent(
            id=r["id"],
            message_id=r["message_id"],
            routing_key=r["routing_key"],
            body=r["body"],
            correlation_id=r["correlation_id"],
            headers=_header_table(r["headers"]),
        )


def _header_table(raw: str | None) -> dict[str, str | int | float | bool]:
    # The outbox only ever stores scalars (the schema version, a traceparent); anything else is left out.
    decoded: object = json.loads(raw) if raw else {}
    if not isinstance(decoded, dict):
        return {}
    return {str(k): v for k, v in decoded.items() if isinstance(v, str | int | float | bool)}


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
