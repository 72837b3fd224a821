"""Retention: removing what is past its time, in bounded batches that any number of processes may run at
once (migration 0008 says what each table keeps and why).

Each batch is one statement, and so one transaction: a batch of ended runs takes everything about those
runs with it (``intermission_prune_runs_v1``), so a pruner killed at any instant leaves no run half
removed. Rows are taken oldest first with ``FOR UPDATE SKIP LOCKED``: two pruners never delete one row
twice and never wait for each other, and a pruner never waits for a claim (ended runs, old inbox records,
sent events and old session messages are rows no claim touches).

Pacing is the caller's: ``Pruner.prune`` sleeps between batches so that it deletes at most
``max_rows_per_second`` rows (the sweeper's schedule, bench/storage.py measures what it costs the claims).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from intermission.store.db import Database

# The tables a batch of ended runs removes rows from, in the order the function deletes them.
RUN_TABLES: Final = (
    "suspensions",
    "checkpoints",
    "progress",
    "resume_closures",
    "resume_expiries",
    "resume_starts",
    "resume_admissions",
    "run_events",
    "demo_charges",
    "runs",
)


class Kept(StrEnum):
    """What is pruned, each by its own retention."""

    RUNS = "runs"
    INBOX = "inbox"
    OUTBOX = "outbox"
    SESSIONS = "session_messages"


@dataclass(frozen=True)
class Retention:
    """How long each kind of row is kept (seconds)."""

    runs: float
    inbox: float
    outbox: float
    sessions: float

    def of(self, kept: Kept) -> float:
        return {Kept.RUNS: self.runs, Kept.INBOX: self.inbox, Kept.OUTBOX: self.outbox, Kept.SESSIONS: self.sessions}[
            kept
        ]


@dataclass(frozen=True)
class TableStorage:
    name: str
    live_rows: int
    dead_rows: int
    bytes: int


# A batch's rows removed per table.
Counts = dict[str, int]
OnBatch = Callable[[Kept, Counts], None]

_QUERIES: Final = {
    Kept.INBOX: "prune_inbox",
    Kept.OUTBOX: "prune_outbox",
    Kept.SESSIONS: "prune_sessions",
}


class Pruner:
    def __init__(self, db: Database, retention: Retention, *, batch: int = 500, max_rows_per_second: float = 5000.0):
        self.db = db
        self.retention = retention
        self.batch = batch
        self.max_rows_per_second = max_rows_per_second

    async def prune_batch(self, kept: Kept) -> Counts:
        """One batch of ``kept`` past its retention: the rows removed per table (empty: nothing was due)."""
        async with self.db.connection() as con:
            if kept is Kept.RUNS:
                raw = await con.fetchval("prune_runs", self.retention.runs, self.batch)
                counts = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
                return {table: int(n) for table, n in counts.items() if n}
            pruned = await con.fetchval(_QUERIES[kept], self.retention.of(kept), self.batch)
        return {kept.value: int(pruned)} if pruned else {}

    async def prune(self, kinds: tuple[Kept, ...] = tuple(Kept), on_batch: OnBatch | None = None) -> Counts:
        """Everything due now, batch after batch until a batch comes back short, paced: the rows removed per
        table. Rows that become due while it runs are left for the next prune."""
        total: Counts = {}
        for kept in kinds:
            while True:
                counts = await self.prune_batch(kept)
                for table, n in counts.items():
                    total[table] = total.get(table, 0) + n
                if on_batch is not None and counts:
                    on_batch(kept, counts)
                taken = counts.get(kept.value, 0)
                if taken < self.batch:
                    break
                # A batch of runs removes several rows per run; the pace counts what the batch took.
                await asyncio.sleep(sum(counts.values()) / self.max_rows_per_second)
        return total

    async def prunable(self) -> Counts:
        """What a prune would remove now, per table, removing nothing."""
        r = self.retention
        async with self.db.connection() as con:
            row = await con.fetchrow("prunable", r.runs, r.inbox, r.outbox, r.sessions)
        assert row is not None
        return {table: int(n) for table, n in dict(row).items()}

    async def storage(self) -> list[TableStorage]:
        async with self.db.connection() as con:
            rows = await con.fetch("storage")
        return [TableStorage(r["name"], int(r["live_rows"]), int(r["dead_rows"]), int(r["bytes"])) for r in rows]

    async def oldest_kept(self) -> tuple[float | None, float | None]:
        """Seconds since the oldest ended run still kept ended, and since the oldest inbox record was
        written (None when there is none)."""
        async with self.db.connection() as con:
            row = await con.fetchrow("oldest_kept")
        assert row is not None
        return row["ended_run_seconds"], row["inbox_seconds"]
