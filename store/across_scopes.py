"""Every read that crosses scopes, in one place.

Scope is exact everywhere else: every other store method works at one scope, the one its handle was made
for (``Stores.at``). The readers here are process infrastructure that has no request scope and must find
work in all of them: the expiry sweeper, the reclaim sweep, the outbox relay, and operators' overviews.
Finding work across scopes does not license doing it unscoped: callers act on each row they find only
under that row's own scope (a sweeper sends each expired pause a command naming it; the reclaim sweep
continues each run under its stored scope; the relay publishes each event to its own scope's key).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from intermission.schemas.errors import InvalidArgument
from intermission.schemas.run import Run, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, SuspendReason, Suspension
from intermission.store import rows
from intermission.store.db import Conn, Database
from intermission.store.rows import header_table, stored
from intermission.wire import HeaderValue

# A pause named by its run's scope and id and its own id.
PauseKey = tuple[Scope, str, int]

# The keyset cursor's start: before every deadline the database can hold.
_BEFORE_EVERY_DEADLINE: Final = datetime(1, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class ExpiredPause:
    """A pause whose deadline passed while its run is paused, found by the expiry sweep."""

    scope: Scope
    run_id: str
    suspension_id: int
    run_revision: int
    expires_at: datetime

    @property
    def version(self) -> ClaimVersion:
        return ClaimVersion(run_id=self.run_id, suspension_id=self.suspension_id, run_revision=self.run_revision)

    @property
    def cursor(self) -> tuple[datetime, int]:
        return (self.expires_at, self.suspension_id)

    @property
    def key(self) -> PauseKey:
        """The pause by its run's key (scope and run id) and its own id."""
        return (self.scope, self.run_id, self.suspension_id)


@dataclass(frozen=True)
class OutboxRow:
    """One event to publish, exactly as its writer stored it."""

    id: int
    message_id: str
    routing_key: str
    body: str
    correlation_id: str | None
    headers: dict[str, HeaderValue]


# How much of the broker's reason a row keeps: enough for any reason RabbitMQ gives (a size, a user, a
# queue), bounded so that a foreign error text cannot bloat the table.
LAST_ERROR_CHARS: Final = 500


@dataclass(frozen=True)
class RefusalPolicy:
    """How the relay treats a row the broker refused: quarantined at its ``max_attempts``-th refusal, and
    until then tried again after ``first_wait_seconds``, doubled per refusal, at most ``longest_wait_seconds``."""

    max_attempts: int = 5
    first_wait_seconds: float = 1.0
    longest_wait_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidArgument("max_attempts must be at least 1")
        if self.first_wait_seconds < 0 or self.longest_wait_seconds < 0:
            raise InvalidArgument("waits must not be negative")


@dataclass(frozen=True)
class Refused:
    """A row the broker refused, as recorded: its attempts so far, and whether that set it aside."""

    id: int
    message_id: str
    routing_key: str
    attempts: int
    reason: str
    quarantined: bool
    # Seconds until it may be claimed again (None once quarantined).
    retry_in: float | None


class OutboxBatch:
    """Rows locked by the current relay transaction."""

    def __init__(self, con: Conn, found: list[OutboxRow]) -> None:
        self._con = con
        self.rows = found

    async def mark_sent(self, ids: Sequence[int]) -> None:
        """Mark rows sent: call only with the ids whose publisher confirm arrived."""
        if ids:
            await self._con.execute("mark_outbox_sent", list(ids))

    async def mark_refused(self, reasons: Mapping[int, str], policy: RefusalPolicy) -> list[Refused]:
        """Count one broker refusal for each row of ``reasons`` (id to the broker's reason, kept truncated),
        quarantining those that reached ``policy.max_attempts``. Call only for refusals of that very row (a
        nack, a return, a channel closed over it), never for an outage, which would count against every row."""
        if not reasons:
            return []
        ids = list(reasons)
        found = await self._con.fetch(
            "refuse_outbox",
            ids,
            [reasons[i][:LAST_ERROR_CHARS] for i in ids],
            policy.max_attempts,
            policy.first_wait_seconds,
            policy.longest_wait_seconds,
        )
        return [stored(Refused, r, reason=r["last_error"]) for r in found]


@dataclass(frozen=True)
class OutboxEntry:
    """An unsent outbox row as operators see it: where it goes and what the broker said of it, not its body."""

    id: int
    message_id: str
    routing_key: str
    # As stored, not parsed into a Scope: a listing must show whatever a foreign writer put there.
    app: str
    tenant: str
    run_id: str | None
    created_at: datetime
    attempts: int
    next_attempt_at: datetime | None
    quarantined_at: datetime | None
    last_error: str | None


@dataclass(frozen=True)
class RunningCount:
    running: int
    leased: int


class AcrossScopes:
    """The cross-scope readers over one pool."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # --- the expiry sweeper ------------------------------------------------------------------------

    async def list_expired_across_scopes(self, now: datetime, limit: int | None) -> list[Suspension]:
        """The original's ListExpiredAcrossScopes: ``list_expired`` with the scope filter DELIBERATELY bypassed.

        It exists for the expiry sweeper, which is process infrastructure with no request scope. A method
        of its own rather than a flag, so a cross-scope read is visible as one at the call site and no
        handler can reach it by passing a zero value.
        """
        bounded = rows.optional_limit(limit)
        async with self.db.connection() as con:
            found = await con.fetch("list_expired_across_scopes", now, bounded)
        return [rows.suspension_from_row(r) for r in found]

    async def database_now(self) -> datetime:
        """The database clock: every deadline is judged by it, never by this process's clock."""
        async with self.db.connection() as con:
            now: datetime = await con.fetchval("database_now")
        return now

    async def list_expired_paused(
        self, cutoff: datetime, after: tuple[datetime, int] | None, limit: int
    ) -> list[ExpiredPause]:
        """Up to ``limit`` pauses of paused runs, in every scope, whose deadline passed at or before
        ``cutoff`` (and the database clock), in (expires_at, id) order after the keyset cursor ``after``
        (None: from the first)."""
        after_expires, after_id = after if after is not None else (_BEFORE_EVERY_DEADLINE, 0)
        async with self.db.connection() as con:
            found = await con.fetch("list_expired_paused_across_scopes", cutoff, after_expires, after_id, limit)
        return [stored(ExpiredPause, r, scope=Scope(app=r["app"], tenant=r["tenant"])) for r in found]

    # --- the outbox relay --------------------------------------------------------------------------

    @asynccontextmanager
    async def claim_outbox(self, limit: int) -> AsyncIterator[OutboxBatch]:
        """Lock up to ``limit`` unsent rows, oldest first, for the length of the block, skipping rows another
        relay holds. The block's ``mark_sent`` commits with it; an error in the block rolls it back and
        leaves every row unsent."""
        async with self.db.transaction() as con:
            found = await con.fetch("claim_unsent_outbox", limit)
            yield OutboxBatch(
                con,
                [
                    stored(OutboxRow, r, message_id=str(r["message_id"]), headers=header_table(r["headers"]))
                    for r in found
                ],
            )

    async def count_unsent_outbox(self) -> int:
        """Rows the relay has yet to publish (quarantined ones are not among them)."""
        async with self.db.connection() as con:
            return int(await con.fetchval("count_unsent_outbox"))

    async def mark_handed_sent(self, message_ids: Sequence[uuid.UUID]) -> None:
        """Mark sent the rows of events published from memory whose publisher confirm arrived (one
        statement for all of them)."""
        if message_ids:
            async with self.db.connection() as con:
                await con.execute("mark_handed_outbox_sent", list(message_ids))

    async def count_quarantined_outbox(self) -> int:
        async with self.db.connection() as con:
            return int(await con.fetchval("count_quarantined_outbox"))

    async def list_outbox(self, *, quarantined: bool, limit: int) -> list[OutboxEntry]:
        """Operators: the quarantined rows, or (``quarantined`` false) the rows the relay still tries, oldest
        first, at most ``limit``."""
        if not 1 <= limit <= 10_000:
            raise InvalidArgument("limit must be between 1 and 10000")
        async with self.db.connection() as con:
            found = await con.fetch("list_quarantined_outbox" if quarantined else "list_unsent_outbox", limit)
        return [stored(OutboxEntry, r) for r in found]

    # --- operators ---------------------------------------------------------------------------------

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

    # --- operators' figures (the CLI, `intermission doctor`, the sweeper's metrics) ------------------

    async def find_run_scopes(self, run_id: str) -> list[Scope]:
        """The scopes a run id is found in: a run id is unique only within its scope, so there may be several
        (the caller then asks which one is meant)."""
        async with self.db.connection() as con:
            found = await con.fetch("find_run_scopes", run_id)
        return [Scope.model_construct(app=r["app"], tenant=r["tenant"]) for r in found]

    async def list_run_summaries(self, runs: RunFilter, limit: int, after: RunCursor | None = None) -> list[RunSummary]:
        """Operators: runs newest change first, filtered, after the keyset cursor ``after``."""
        if not 1 <= limit <= 1000:
            raise InvalidArgument("limit must be between 1 and 1000")
        for name, seconds in (
            ("older_than", runs.older_than_seconds),
            ("deadline_within", runs.deadline_within_seconds),
        ):
            if seconds is not None and not (math.isfinite(seconds) and seconds >= 0):
                raise InvalidArgument(f"{name} must be a finite, non-negative number of seconds")
        async with self.db.connection() as con:
            found = await con.fetch(
                "list_run_summaries",
                runs.app,
                runs.tenant,
                runs.state.value if runs.state is not None else None,
                runs.reason.value if runs.reason is not None else None,
                runs.older_than_seconds,
                runs.deadline_within_seconds,
                limit,
                after.updated_at if after is not None else None,
                after.run_id if after is not None else None,
                after.app if after is not None else None,
                after.tenant if after is not None else None,
            )
        return [stored(RunSummary, r) for r in found]

    async def pause_figures(self) -> PauseFigures:
        """Live pauses by reason and age, and their deadlines, by the database clock."""
        async with self.db.connection() as con:
            by_age = await con.fetch("open_pauses")
            deadlines = await con.fetchrow("pause_deadlines")
        assert deadlines is not None
        return PauseFigures(
            open={(r["reason"], r["age"]): int(r["pauses"]) for r in by_age},
            earliest_deadline=deadlines["earliest"],
            earliest_passed=deadlines["earliest_passed"],
            passed=int(deadlines["passed"]),
            now=deadlines["now"],
        )

    async def outbox_lag(self) -> OutboxLag:
        async with self.db.connection() as con:
            row = await con.fetchrow("outbox_lag")
        assert row is not None
        return OutboxLag(
            pending=int(row["pending"]), oldest_seconds=row["oldest_seconds"], quarantined=int(row["quarantined"])
        )

    async def stale_leases(self, grace_seconds: float, limit: int = 10) -> tuple[int, list[StaleLease]]:
        """Running runs whose lease lapsed more than ``grace_seconds`` ago: how many, and the ``limit``
        oldest."""
        async with self.db.connection() as con:
            found = await con.fetch("stale_leases", grace_seconds, limit)
        total = int(found[0]["total"]) if found else 0
        return total, [stored(StaleLease, r, run_id=r["id"]) for r in found]

    async def replication(self) -> Replication:
        """Whether this server is a standby, and the standbys streaming from it (a primary's view)."""
        async with self.db.connection() as con:
            found = await con.fetch("replication_status")
        return Replication(
            in_recovery=bool(found[0]["in_recovery"]) if found else False,
            standbys=[
                stored(Standby, r, name=r["application_name"], address=r["client_addr"])
                for r in found
                if r["application_name"] is not None or r["state"] is not None
            ],
        )


@dataclass(frozen=True)
class RunFilter:
    """What ``list_run_summaries`` keeps; None: any."""

    app: str | None = None
    tenant: str | None = None
    state: RunState | None = None
    # The live pause's reason (a paused run's).
    reason: SuspendReason | None = None
    # Unchanged for at least this long (a paused run: paused that long).
    older_than_seconds: float | None = None
    # A live pause whose deadline is at most this far ahead (passed ones included).
    deadline_within_seconds: float | None = None


@dataclass(frozen=True)
class RunCursor:
    """Where a listing of runs stopped: the last run's last change and key (an id is unique only within its
    scope, so two runs of one id may have changed at the same moment)."""

    updated_at: datetime
    run_id: str
    app: str
    tenant: str


@dataclass(frozen=True)
class RunSummary:
    """A run as a listing shows it, read as stored (nothing decoded, so one malformed row cannot fail a list)."""

    id: str
    app: str
    tenant: str
    agent_id: str
    state: str
    revision: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    step_count: int
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    # The live pause of a paused run.
    suspension_id: int | None
    reason: str | None
    expires_at: datetime | None

    @property
    def cursor(self) -> RunCursor:
        return RunCursor(self.updated_at, self.id, self.app, self.tenant)


# The age buckets of open pauses, youngest first (``open_pauses``).
PAUSE_AGES: Final = ("under_1m", "1m_to_1h", "1h_to_1d", "1d_to_7d", "over_7d")


@dataclass(frozen=True)
class PauseFigures:
    # (reason, age bucket) to how many live pauses; a pair with none is absent.
    open: dict[tuple[str, str], int]
    earliest_deadline: datetime | None
    # The earliest deadline that passed while its run is still paused: what the sweepers have yet to expire.
    earliest_passed: datetime | None
    passed: int
    # The database clock when they were read.
    now: datetime

    @property
    def sweeper_lag_seconds(self) -> float:
        """How long ago the oldest pause the sweepers have yet to expire passed its deadline (0: none)."""
        if self.earliest_passed is None:
            return 0.0
        return max(0.0, (self.now - self.earliest_passed).total_seconds())


@dataclass(frozen=True)
class OutboxLag:
    pending: int
    # How long ago the oldest pending row was written (None: none is pending).
    oldest_seconds: float | None
    quarantined: int


@dataclass(frozen=True)
class StaleLease:
    run_id: str
    app: str
    tenant: str
    lease_owner: str | None
    lapsed_seconds: float


@dataclass(frozen=True)
class Standby:
    name: str | None
    address: str | None
    state: str | None
    sync_state: str | None
    lag_bytes: float | None
    lag_seconds: float | None


@dataclass(frozen=True)
class Replication:
    in_recovery: bool
    standbys: list[Standby]
