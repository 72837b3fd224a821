"""Pauses: the original's Store, VersionedStore and the pause half of LeasedClaimStore, at one exact scope.

Every claim is ONE call of the claim transition (``intermission_claim_pause_v1``): the paused -> running
move and the suspension read (and, for a leased claim, the lease and the first progress snapshot) cannot be
split by another claimer, because they all contend on the run's row lock and re-check ``state = 'paused'``
and the revision after the winner commits. A read followed by a separate write is exactly the race these
methods exist to close. A claim that matches nothing comes back with why, classified under the same locks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from intermission.schemas.errors import (
    InvalidArgument,
    NotSuspended,
    RunConflict,
    RunLeaseLost,
    RunNotFound,
    SuspensionExists,
    SuspensionExpired,
)
from intermission.schemas.run import Lease, Run
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, LeasedClaim, Progress, Suspension
from intermission.store import rows
from intermission.store import rows as _rows
from intermission.store.db import Database
from intermission.store.inbox import Receipt, inbox_arguments
from intermission.store.outbox import OutboxEvent


@dataclass(frozen=True)
class ClaimedPause:
    """What a claim won: the pause it claimed, and the run as the claim left it (running, its revision
    bumped, under the claimer's lease if it took one)."""

    suspension: Suspension
    run: Run


@dataclass(frozen=True)
class MovedDeadline:
    """A live pause whose deadline an operator moved: the deadline before (None: it had none) and after."""

    run_id: str
    suspension_id: int
    run_revision: int
    previous: datetime | None
    expires_at: datetime


def refusal(
    outcome: str,
    row: asyncpg.Record | Mapping[str, Any],
    scope: Scope,
    run_id: str,
    *,
    version: ClaimVersion | None = None,
    expired_by: datetime | None = None,
) -> Exception:
    """The typed error for a claim that matched nothing, from the outcome and the run and pause as they
    stood when the claim function looked again (``r_revision``, ``s_id``, ``s_expires_at``)."""
    if outcome == "run_conflict":
        pinned = f"{version.suspension_id} at {version.run_revision}" if version is not None else "the pinned one"
        return RunConflict(
            f"run {run_id} is paused on suspension {row['s_id']} at revision {row['r_revision']}, not {pinned}"
        )
    if outcome == "suspension_expired":
        return SuspensionExpired(f"the pause of run {run_id} expired at {row['s_expires_at'].isoformat()}")
    if outcome == "not_expired" and expired_by is not None:
        return NotSuspended(f"the pause of run {run_id} had not expired by {expired_by.isoformat()}")
    if outcome == "lost":
        return NotSuspended(f"run {run_id} was claimed by another caller")
    return NotSuspended(f"run {run_id} has no live pause at scope {scope}")


def check_leased_claim(claim: LeasedClaim) -> None:
    """Refuse a half lease, a missing lease, or a first snapshot owned by someone else, before any I/O."""
    if not claim.lease.is_set:
        raise RunLeaseLost("a leased claim needs a lease with both an owner and a ttl")
    if claim.first is not None:
        check_first(claim.first, claim.lease.owner, claim.version.run_id)


def check_first(first: Progress, owner: str, run_id: str) -> None:
    if first.owner != owner:
        raise RunLeaseLost("the first progress snapshot is owned by someone other than the lease owner")
    if first.run_id != run_id:
        raise InvalidArgument("the first progress snapshot is for another run")


class SuspensionStore:
    """Suspensions and the claims that resume them, at one exact scope."""

    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def create_suspension(self, s: Suspension, *, ttl_seconds: float | None = None) -> Suspension:
        """Write a new pause for a run at this scope. The stored scope is this one, whatever ``s`` says.

        With ``ttl_seconds`` the deadline is the database clock plus it; otherwise ``s.expires_at``.
        """
        if ttl_seconds is not None and not (math.isfinite(ttl_seconds) and ttl_seconds >= 0):
            raise InvalidArgument("ttl_seconds must be a finite, non-negative number of seconds")
        async with self.db.connection() as con:
            try:
                row = await con.fetchrow(
                    "create_pause",
                    run_id=s.run_id,
                    app=self.scope.app,
                    tenant=self.scope.tenant,
                    reason=s.reason.value,
                    pending=rows.dump_list(rows.PENDING, s.pending),
                    continuation=rows.dump(s.continuation),
                    expires_at=s.expires_at,
                    ttl=ttl_seconds,
                    checkpoint_id=s.checkpoint_id,
                    approvers=s.approvers,
                )
            except asyncpg.UniqueViolationError as exc:
                raise SuspensionExists(f"run {s.run_id} already has a live suspension") from exc
        if row is None or row["id"] is None:
            raise RunNotFound(f"no run {s.run_id} at scope {self.scope}")
        return s.model_copy(
            update={
                "id": row["id"],
                "scope": self.scope,
                "expires_at": row["expires_at"],
                "created_at": row["created_at"],
            }
        )

    async def get_suspension(self, run_id: str) -> Suspension:
        """Read a run's pause without changing anything. To resume, claim instead: a read followed by a
        separate write is the race the claims exist to close."""
        async with self.db.connection() as con:
            row = await con.fetchrow("get_suspension", run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise NotSuspended(f"no suspension for run {run_id} at scope {self.scope}")
        return rows.suspension_from_row(row)

    async def delete_suspension(self, run_id: str) -> None:
        async with self.db.connection() as con:
            row = await con.fetchrow("delete_suspension", run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise NotSuspended(f"no suspension for run {run_id} at scope {self.scope}")

    async def list_expired(self, now: datetime, limit: int | None) -> list[Suspension]:
        """Pauses at this scope whose deadline is at or before ``now`` (and the database clock)."""
        bounded = rows.optional_limit(limit)
        async with self.db.connection() as con:
            found = await con.fetch("list_expired", self.scope.app, self.scope.tenant, now, bounded)
        return [rows.suspension_from_row(r) for r in found]

    async def move_deadline(
        self, run_id: str, suspension_id: int, *, extend_by: float | None, moved_by: str
    ) -> MovedDeadline:
        """An operator moves the live pause ``suspension_id`` of ``run_id``'s deadline: ``extend_by`` seconds
        later (from now when it passed already or there was none), or to now with ``extend_by`` None (a
        deadline that passed already stays). The run event ``deadline_moved`` records it, ``moved_by`` says
        who. NotSuspended when the run is not paused here; RunConflict when it is paused on another pause."""
        if extend_by is not None and not (math.isfinite(extend_by) and extend_by > 0):
            raise InvalidArgument("extend_by must be a positive, finite number of seconds")
        async with self.db.connection() as con:
            row = await con.fetchrow(
                "move_deadline", run_id, self.scope.app, self.scope.tenant, suspension_id, extend_by, moved_by
            )
        assert row is not None  # the function always returns its one row
        if row["outcome"] == "not_paused":
            raise NotSuspended(f"run {run_id} has no live pause at scope {self.scope}")
        if row["outcome"] == "pause_changed":
            raise RunConflict(f"run {run_id} is paused on suspension {row['suspension_id']}, not {suspension_id}")
        return MovedDeadline(
            run_id=run_id,
            suspension_id=row["suspension_id"],
            run_revision=row["run_revision"],
            previous=row["previous"],
            expires_at=row["expires_at"],
        )

    async def claim_suspension(self, run_id: str) -> ClaimedPause:
        """The concurrency primitive for resume: paused -> running and the suspension read, atomically.

        The loser of a race gets NotSuspended, never the suspension it lost. An expired pause is
        SuspensionExpired and nothing moves. The row is not deleted: the fleet deletes it before it
        re-enters the loop.
        """
        return await self._claim(run_id, None, None, None)

    async def claim_expired_suspension(self, run_id: str, now: datetime) -> ClaimedPause:
        """``claim_suspension``'s mirror for the expiry sweep: the same move, conditioned on the deadline
        having PASSED (by ``now`` and by the database clock).

        The two predicates partition the same stored ``expires_at``, so a resume and a sweep are exclusive,
        not merely unlikely to collide. Zero rows means somebody else got there first: NotSuspended.
        """
        try:
            return await self._claim(run_id, None, None, now)
        except SuspensionExpired as exc:  # pragma: no cover - an expired-by claim never reports expiry
            raise NotSuspended(exc.detail) from exc

    async def claim_suspension_version(self, version: ClaimVersion) -> ClaimedPause:
        """The claim fenced on (run, suspension, revision): a later pause of the same run never satisfies
        it. Failed or ambiguous commits return no suspension."""
        return await self._claim(version.run_id, version, None, None)

    async def claim_suspension_leased(self, claim: LeasedClaim) -> ClaimedPause:
        """The pinned claim plus the run's lease and its first progress snapshot, in one transaction, so no
        worker that claimed a pause can die holding a running run nobody owns."""
        check_leased_claim(claim)
        return await self._claim(claim.version.run_id, claim.version, claim, claim.expired_by)

    async def _claim(
        self, run_id: str, version: ClaimVersion | None, claim: LeasedClaim | None, expired_by: datetime | None
    ) -> ClaimedPause:
        # The claim and the decoding of what it claimed share one transaction: a pause that cannot be read
        # rolls its claim back rather than leaving the run running with nobody holding it.
        async with self.db.transaction() as con:
            row = await con.fetchrow(
                "claim_pause",
                **claim_arguments(
                    self.scope,
                    run_id,
                    version=version,
                    expired_by=expired_by,
                    lease=claim.lease if claim is not None else None,
                    first=claim.first if claim is not None else None,
                    rows=True,
                ),
            )
            assert row is not None  # the function always returns its one row
            if row["outcome"] != "claimed":
                raise refusal(row["outcome"], row, self.scope, run_id, version=version, expired_by=expired_by)
            return ClaimedPause(suspension=rows.suspension_from_row(row["pause"]), run=rows.run_from_row(row["run"]))


def claim_arguments(
    scope: Scope,
    run_id: str,
    *,
    version: ClaimVersion | None,
    expired_by: datetime | None = None,
    lease: Lease | None = None,
    first: Progress | None = None,
    answers_only: bool = False,
    drop_pause: bool = False,
    receipt: Receipt | None = None,
    decision: Decided | None = None,
    event: OutboxEvent | None = None,
    rows: bool = False,
) -> dict[str, Any]:
    """The claim transition's named arguments. ``first`` is the first snapshot; with ``answers_only`` its
    continuation is not sent, and the transition takes the claimed pause's own (a command's answers are
    all it adds). With ``rows`` the transition hands back the whole run and pause rows too."""
    snapshot = _rows.progress_arguments(first, "first_", continuation=not answers_only) if first is not None else {}
    return {
        "run_id": run_id,
        "app": scope.app,
        "tenant": scope.tenant,
        "suspension_id": version.suspension_id if version is not None else None,
        "revision": version.run_revision if version is not None else None,
        "expired_by": expired_by,
        "reason": None,
        "lease_owner": lease.owner if lease is not None else None,
        "lease_ttl": lease.ttl_seconds if lease is not None else None,
        "first": first is not None,
        "first_continuation": snapshot.get("first_continuation"),
        "first_started": snapshot.get("first_started"),
        "first_done": snapshot.get("first_done"),
        "first_ending": snapshot.get("first_ending"),
        "first_approved": snapshot.get("first_approved"),
        "drop_pause": drop_pause,
        **inbox_arguments(receipt, scope),
        "checkpoint_id": decision.checkpoint_id if decision is not None else None,
        "checkpoint_state": decision.state if decision is not None else None,
        "decided_by": decision.decided_by if decision is not None else None,
        "decision_reason": decision.reason if decision is not None else None,
        **(event.arguments() if event is not None else NO_EVENT),
        "rows": rows,
        # Set by a writer that publishes the claim's event from memory (store/commands.py).
        "outbox_hold": None,
    }


@dataclass(frozen=True)
class Decided:
    """An approval decision recorded on the pause's checkpoint, with the claim it answers."""

    checkpoint_id: int
    state: str
    decided_by: str | None
    reason: str


NO_EVENT: dict[str, object] = {
    "event_message_id": None,
    "event_routing_key": None,
    "event_body": None,
    "event_correlation_id": None,
    "event_headers": None,
}
