"""The seed's Store, VersionedStore and the pause half of LeasedClaimStore.

Every claim is ONE conditional statement: the paused -> running move and the suspension read (and, for a
leased claim, the lease and the first progress snapshot) cannot be split by another claimer, because they
all contend on the run's row lock and re-check ``state = 'paused'`` after the winner commits. A read
followed by a separate write is exactly the race these methods exist to close.
"""

from __future__ import annotations

import math
from datetime import datetime

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
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import ClaimVersion, LeasedClaim, Suspension
from intermission.store import rows
from intermission.store.db import Conn, Database


def _limit(limit: int | None) -> int | None:
    """A limit of None or 0 means no limit (the seed's ``<= 0``); a negative limit is refused."""
    if limit is None or limit == 0:
        return None
    if limit < 0:
        raise InvalidArgument("limit must not be negative")
    return limit


def _claimed(row: asyncpg.Record) -> Suspension:
    suspension = rows.suspension_from_row(row)
    suspension.claimed_run = rows.run_from_row(row, prefix="r_")
    return suspension


class SuspensionStore:
    """Suspensions and the claims that resume them, at the caller's exact scope."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def create_suspension(self, scope: Scope, s: Suspension, *, ttl_seconds: float | None = None) -> Suspension:
        """Write a new pause for a run at ``scope``. The stored scope is the caller's, whatever ``s`` says.

        With ``ttl_seconds`` the deadline is the database clock plus it; otherwise ``s.expires_at``.
        """
        require_scope(scope)
        if ttl_seconds is not None and not (math.isfinite(ttl_seconds) and ttl_seconds >= 0):
            raise InvalidArgument("ttl_seconds must be a finite, non-negative number of seconds")
        async with self.db.transaction() as con:
            try:
                row = await con.fetchrow(
                    "create_suspension",
                    s.run_id,
                    scope.app,
                    scope.tenant,
                    s.reason.value,
                    rows.dump_list(rows.PENDING, s.pending),
                    rows.dump(s.continuation),
                    s.expires_at,
                    ttl_seconds,
                    s.checkpoint_id,
                    s.approvers,
                )
            except asyncpg.UniqueViolationError as exc:
                raise SuspensionExists(f"run {s.run_id} already has a live suspension") from exc
        if row is None:
            raise RunNotFound(f"no run {s.run_id} at scope {scope}")
        return s.model_copy(
            update={
                "id": row["id"],
                "scope": scope,
                "expires_at": row["expires_at"],
                "created_at": row["created_at"],
            }
        )

    async def get_suspension(self, scope: Scope, run_id: str) -> Suspension:
        """Read a run's pause without changing anything. To resume, claim instead: a read followed by a
        separate write is the race the claims exist to close."""
        require_scope(scope)
        async with self.db.connection() as con:
            row = await con.fetchrow("get_suspension", run_id, scope.app, scope.tenant)
        if row is None:
            raise NotSuspended(f"no suspension for run {run_id} at scope {scope}")
        return rows.suspension_from_row(row)

    async def delete_suspension(self, scope: Scope, run_id: str) -> None:
        require_scope(scope)
        async with self.db.connection() as con:
            row = await con.fetchrow("delete_suspension", run_id, scope.app, scope.tenant)
        if row is None:
            raise NotSuspended(f"no suspension for run {run_id} at scope {scope}")

    async def list_expired(self, scope: Scope, now: datetime, limit: int | None) -> list[Suspension]:
        """Pauses at ``scope`` whose deadline is at or before ``now`` (and the database clock)."""
        require_scope(scope)
        bounded = _limit(limit)
        async with self.db.connection() as con:
            found = await con.fetch("list_expired", scope.app, scope.tenant, now, bounded)
        return [rows.suspension_from_row(r) for r in found]

    async def list_expired_across_scopes(self, now: datetime, limit: int | None) -> list[Suspension]:
        """``list_expired`` with the scope filter DELIBERATELY bypassed: the one cross-scope read here.

        It exists for the expiry sweeper, which is process infrastructure with no request scope. A second
        method rather than a flag, so a cross-scope read is visible as one at the call site and no handler
        can reach it by passing a zero value. Finding work across scopes does not license doing it
        unscoped: act on each row under its own ``scope``.
        """
        bounded = _limit(limit)
        async with self.db.connection() as con:
            found = await con.fetch("list_expired_across_scopes", now, bounded)
        return [rows.suspension_from_row(r) for r in found]

    async def claim_suspension(self, scope: Scope, run_id: str) -> Suspension:
        """The concurrency primitive for resume: paused -> running and the suspension read, atomically.

        The loser of a race gets NotSuspended, never the suspension it lost. An expired pause is
        SuspensionExpired and nothing moves. The row is not deleted: the fleet deletes it before it
        re-enters the loop.
        """
        require_scope(scope)
        async with self.db.transaction() as con:
            row = await con.fetchrow("claim_suspension", run_id, scope.app, scope.tenant, None)
            if row is None:
                await refuse_claim(con, scope, run_id, None)
            assert row is not None
            # Decoded INSIDE the transaction: a pause that cannot be read rolls its claim back rather than
            # leaving the run running with nobody holding it.
            return _claimed(row)

    async def claim_expired_suspension(self, scope: Scope, run_id: str, now: datetime) -> Suspension:
        """``claim_suspension``'s mirror for the expiry sweep: the same move, conditioned on the deadline
        having PASSED (by ``now`` and by the database clock).

        The two predicates partition the same stored ``expires_at``, so a resume and a sweep are exclusive,
        not merely unlikely to collide. Zero rows means somebody else got there first: NotSuspended.
        """
        require_scope(scope)
        async with self.db.transaction() as con:
            row = await con.fetchrow("claim_suspension", run_id, scope.app, scope.tenant, now)
            if row is None:
                raise NotSuspended(f"run {run_id} has no expired pause to claim at scope {scope}")
            return _claimed(row)  # inside the transaction, as in claim_suspension

    async def claim_suspension_version(self, scope: Scope, version: ClaimVersion) -> Suspension:
        """The claim fenced on (run, suspension, revision): a later pause of the same run never satisfies
        it. Failed or ambiguous commits return no suspension."""
        require_scope(scope)
        async with self.db.transaction() as con:
            return await claim_pinned_in(con, scope, version, None, None)

    async def claim_suspension_leased(self, scope: Scope, claim: LeasedClaim) -> Suspension:
        """The pinned claim plus the run's lease and its first progress snapshot, in one transaction, so no
        worker that claimed a pause can die holding a running run nobody owns."""
        require_scope(scope)
        check_leased_claim(claim)
        async with self.db.transaction() as con:
            return await claim_pinned_in(con, scope, claim.version, claim, claim.expired_by)


async def claim_pinned_in(
    con: Conn,
    scope: Scope,
    version: ClaimVersion,
    claim: LeasedClaim | None,
    expired_by: datetime | None,
) -> Suspension:
    """The pinned claim inside a transaction the caller holds, so a command can add its own writes
    (a checkpoint decision, an inbox row, an outbox event) to the claiming transaction."""
    first = claim.first if claim is not None else None
    first_cols = rows.progress_columns(first) if first is not None else (None, None, None, None, None)
    row = await con.fetchrow(
        "claim_suspension_leased",
        version.run_id,
        scope.app,
        scope.tenant,
        version.suspension_id,
        version.run_revision,
        claim.lease.owner if claim is not None else None,
        claim.lease.ttl_seconds if claim is not None else None,
        expired_by,
        *first_cols,
    )
    if row is None:
        await refuse_claim(con, scope, version.run_id, version, expired_by)
    assert row is not None
    return _claimed(row)


async def refuse_claim(
    con: Conn,
    scope: Scope,
    run_id: str,
    version: ClaimVersion | None,
    expired_by: datetime | None = None,
) -> None:
    """Say why a claim matched nothing. Only the failure path pays for this read."""
    state = await con.fetchrow("classify_claim_failure", run_id, scope.app, scope.tenant)
    if state is None or state["suspension_id"] is None or state["state"] != RunState.PAUSED.value:
        raise NotSuspended(f"run {run_id} has no live pause at scope {scope}")
    if version is not None and (
        state["suspension_id"] != version.suspension_id or state["revision"] != version.run_revision
    ):
        raise RunConflict(
            f"run {run_id} is paused on suspension {state['suspension_id']} at revision "
            f"{state['revision']}, not {version.suspension_id} at {version.run_revision}"
        )
    if expired_by is None and state["expired"]:
        raise SuspensionExpired(f"the pause of run {run_id} expired at {state['expires_at'].isoformat()}")
    if expired_by is not None:
        raise NotSuspended(f"the pause of run {run_id} had not expired by {expired_by.isoformat()}")
    # Paused on the pinned pause and not expired, yet unmatched: the state moved between the claim and
    # this read. Somebody else won.
    raise NotSuspended(f"run {run_id} was claimed by another caller")


def check_leased_claim(claim: LeasedClaim) -> None:
    """Refuse a half lease, a missing lease, or a first snapshot owned by someone else, before any I/O."""
    if not claim.lease.is_set:
        raise RunLeaseLost("a leased claim needs a lease with both an owner and a ttl")
    if claim.first is not None:
        if claim.first.owner != claim.lease.owner:
            raise RunLeaseLost("the first progress snapshot is owned by someone other than the lease owner")
        if claim.first.run_id != claim.version.run_id:
            raise InvalidArgument("the first progress snapshot is for another run")
