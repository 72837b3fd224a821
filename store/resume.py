"""Agent-reply resumes: the original's ResumeAdmissionStore, ResumeRecoveryStore, ResumeClosureStore,
ReplyDiscoveryStore and the resume half of LeasedClaimStore, at the caller's exact scope.

How the exactly-once guarantees are made:

- An ADMISSION is one transition (``intermission_admit_resume_v1``): the claim of the pinned
  ``agent_reply`` pause (the one claim every claimer uses, contending on the run's row lock), then the
  admission row. A caller that loses the claim reads the admission the winner committed and gets it back
  (``fresh`` false) when its request is identical, or a conflict when it is not; it never claims.
- START (``intermission_start_resume_v1``), EXPIRY and CLOSURE each begin by locking the run's row FOR
  UPDATE. Every run writer updates that row, so these serialise with all of them, and start and expiry
  (which each refuse when the other exists) cannot both commit for one admission: the second to get the
  lock sees the first's row.
- Idempotency is by content: each write's request is digested with the one canonical digest, and an
  identical retry returns the stored record before any other check runs, so a retry after a lost
  acknowledgement succeeds even when the world has moved on (the run re-paused, the proof expired).

Errors return nothing and grant nothing, an ambiguous commit included: a caller that does not hold a fresh
ResumeStart does not execute. It retries the identical request and learns what happened.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from intermission.schemas.digest import digest as canonical_digest
from intermission.schemas.errors import (
    Forbidden,
    InvalidArgument,
    InvalidState,
    MessageIdConflict,
    NotAgentReplyResumable,
    NotSuspended,
    ResumeAdmissionConflict,
    ResumeAdmissionNotFound,
    ResumeAlreadyStarted,
    RunConflict,
    RunLeaseLost,
    SuspensionExpired,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.ids import RUN_ID_PATTERN
from intermission.schemas.resume import (
    DIGEST_PATTERN,
    LEGACY_SCHEMA_VERSION,
    RESUME_SCHEMA_VERSION,
    ResumeAdmission,
    ResumeAdmissionPage,
    ResumeAdmissionRequest,
    ResumeClosure,
    ResumeClosureRequest,
    ResumeExpiry,
    ResumeStart,
)
from intermission.schemas.run import Lease, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Progress, Suspension
from intermission.store import outbox, rows
from intermission.store.db import Conn, Database
from intermission.store.inbox import Receipt, inbox_arguments
from intermission.store.runs import end_arguments
from intermission.store.suspensions import refusal
from intermission.tracing import current_traceparent

# ListAgentReplyRuns returns run ids only, so a page of 256 is small.
MAX_DISCOVERY_PAGE = 256
# ListResumeAdmissions returns whole admissions, each holding up to 8 MiB of input: the page bound is what
# bounds a reader's memory (32 x 8 MiB = 256 MiB at worst), so it is deliberately smaller.
MAX_ADMISSION_PAGE = 32
# A cursor this store issues is a few hundred characters at most; anything longer is not one of ours.
MAX_CURSOR_CHARS = 512
_CURSOR_VERSION = 1

_RUN_ID = re.compile(RUN_ID_PATTERN)
_DIGEST = re.compile(DIGEST_PATTERN)

# The error a closed run carries. There is no 'incomplete' run state (the state enum is the original's), so a
# closure ends the run 'failed' and says incomplete in words; the resume_closed event is the typed record.
INCOMPLETE_ERROR = "incomplete: resume of suspension {suspension_id} closed under host proof {proof_ref}"


def _check_limit(limit: Any, most: int) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= most:
        raise InvalidArgument(f"limit must be between 1 and {most}, not {limit!r}")
    return limit


def _check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or _RUN_ID.match(run_id) is None:
        raise InvalidArgument(f"run_id must match {RUN_ID_PATTERN}")
    return run_id


def _check_suspension_id(suspension_id: Any) -> int:
    if not isinstance(suspension_id, int) or isinstance(suspension_id, bool) or suspension_id < 1:
        raise InvalidArgument("suspension_id must be a positive integer")
    return suspension_id


def _check_lease(lease: Lease, run_id: str, first: Progress | None) -> None:
    """A half lease, a missing one, or a first snapshot owned by someone else, refused before any I/O."""
    if not isinstance(lease, Lease) or not lease.is_set:
        raise RunLeaseLost("a leased resume needs a lease with both an owner and a ttl")
    if first is not None:
        if first.owner != lease.owner:
            raise RunLeaseLost("the first progress snapshot is owned by someone other than the lease owner")
        if first.run_id != run_id:
            raise InvalidArgument("the first progress snapshot is for another run")


def _check_admission_request(scope: Scope, req: Any) -> None:
    if not isinstance(req, ResumeAdmissionRequest):
        raise InvalidArgument("an admission request is required")
    req.check(scope)


# --- the opaque admission cursor -------------------------------------------------------------------


def encode_cursor(scope: Scope, run_id: str, suspension_id: int) -> str:
    """The position after (run_id, suspension_id), bound to the scope it was issued for.

    It is opaque to callers but not secret or signed: nothing it says grants anything (every page is read
    at the caller's exact scope anyway). Binding the scope makes a cursor carried to another scope a clear
    error instead of a silently wrong page.
    """
    payload = {"a": scope.app, "t": scope.tenant, "r": run_id, "s": suspension_id, "v": _CURSOR_VERSION}
    raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(scope: Scope, cursor: Any) -> tuple[str, int] | None:
    """The position a cursor names, or None for the empty cursor (the first page).

    Only a cursor this store would issue is accepted: the decoded position is re-encoded and must give back
    the very same text, so a tampered, truncated, re-padded or hand-made cursor is InvalidArgument.
    """
    if cursor is None or cursor == "":
        return None
    bad = InvalidArgument("cursor is not one this store issued (tampered, truncated or from another scope)")
    if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR_CHARS:
        raise bad
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
        payload = json.loads(raw.decode("utf-8"))
    except (binascii.Error, ValueError) as exc:
        raise bad from exc
    if not isinstance(payload, dict) or set(payload) != {"a", "t", "r", "s", "v"}:
        raise bad
    run_id, suspension_id = payload["r"], payload["s"]
    if payload["v"] != _CURSOR_VERSION or (payload["a"], payload["t"]) != (scope.app, scope.tenant):
        raise bad
    try:
        _check_run_id(run_id)
        _check_suspension_id(suspension_id)
    except InvalidArgument as exc:
        raise bad from exc
    if encode_cursor(scope, run_id, suspension_id) != cursor:
        raise bad
    return run_id, suspension_id


# --- rows to records -------------------------------------------------------------------------------


def _schema_version(row: asyncpg.Record) -> int:
    """A record's schema version; a row written before versions existed has none and is legacy 0."""
    version: int | None = row["schema_version"]
    return LEGACY_SCHEMA_VERSION if version is None else version


def _admission(row: asyncpg.Record, *, fresh: bool = False) -> ResumeAdmission:
    scope = Scope(app=row["app"], tenant=row["tenant"])
    return ResumeAdmission(
        schema_version=_schema_version(row),
        request=ResumeAdmissionRequest(
            scope=scope,
            version=ClaimVersion(
                run_id=row["run_id"], suspension_id=row["suspension_id"], run_revision=row["pinned_revision"]
            ),
            input=bytes(row["input"]),
        ),
        request_digest=row["request_digest"],
        suspension_digest=row["suspension_digest"],
        claimed_revision=row["claimed_revision"],
        admitted_at=row["admitted_at"],
        fresh=fresh,
    )


def _pinned(row: asyncpg.Record) -> dict[str, Any]:
    """What every evidence record of a pause says of it: its schema version, the pin and the scope."""
    return {
        "schema_version": _schema_version(row),
        "version": ClaimVersion(
            run_id=row["run_id"], suspension_id=row["suspension_id"], run_revision=row["pinned_revision"]
        ),
        "scope": Scope(app=row["app"], tenant=row["tenant"]),
        "request_digest": row["request_digest"],
    }


def _start_record(row: asyncpg.Record) -> ResumeStart:
    return ResumeStart(**_pinned(row), started_at=row["started_at"])


def _expiry(row: asyncpg.Record) -> ResumeExpiry:
    return ResumeExpiry(
        **_pinned(row), event_id=row["event_id"], run_revision=row["run_revision"], expired_at=row["expired_at"]
    )


def _closure(row: asyncpg.Record) -> ResumeClosure:
    return ResumeClosure(
        request=rows.load_model(ResumeClosureRequest, row["request"], "closure request"),
        request_digest=row["request_digest"],
        event_id=row["event_id"],
        run_revision=row["run_revision"],
        closed_at=row["closed_at"],
    )


@dataclass(frozen=True)
class AdmissionState:
    """An agent reply's admission as operators see it: which pause, and what became of it."""

    suspension_id: int
    pinned_revision: int
    claimed_revision: int
    admitted_at: datetime
    started_at: datetime | None
    expired_at: datetime | None
    closed_at: datetime | None


class ResumeStore:
    """Agent-reply resume evidence and the writes that make it, at one exact scope."""

    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    # --- admission ---------------------------------------------------------------------------------

    async def pause_for(self, version: ClaimVersion) -> Suspension:
        """The live pause ``version`` pins, read and decoded: NotSuspended when there is none, RunConflict
        when the run waits on another."""
        async with self.db.connection() as con:
            row = await con.fetchrow("get_suspension", version.run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise NotSuspended(f"no live pause for run {version.run_id} at scope {self.scope}")
        pause = rows.suspension_from_row(row)
        if pause.id != version.suspension_id:
            raise RunConflict(f"run {version.run_id} is paused on suspension {pause.id}, not {version.suspension_id}")
        return pause

    async def admit_resume(self, req: ResumeAdmissionRequest, *, correlation_id: str | None = None) -> ResumeAdmission:
        """Claim the pinned agent_reply pause and retain the reply, in one transaction.

        The claim's new revision is the admission's ``claimed_revision``. The identical request again
        returns the stored admission with ``fresh`` false and claims nothing; a changed request for the same
        pause is ResumeAdmissionConflict. An admission never grants execution: StartResume does.
        """
        _check_admission_request(self.scope, req)
        return await self._admit(req, None, None, correlation_id, None)

    async def admit_resume_leased(
        self,
        req: ResumeAdmissionRequest,
        lease: Lease,
        first: Progress | None = None,
        *,
        correlation_id: str | None = None,
        pause: Suspension | None = None,
        receipt: Receipt | None = None,
    ) -> ResumeAdmission:
        """``admit_resume`` that also takes the run's lease and writes ``first`` in the claiming
        transaction: an admitter that dies before it starts leaves a lease that lapses and the reply in the
        snapshot. An admission recorded before is returned as it is and takes nothing. ``pause`` is the
        pinned pause when the caller has just read it. ``receipt`` is the delivering command's inbox record,
        written with the claim: its message_id recorded for a different command is MessageIdConflict."""
        _check_admission_request(self.scope, req)
        _check_lease(lease, req.version.run_id, first)
        return await self._admit(req, lease, first, correlation_id, pause, receipt)

    async def _admit(
        self,
        req: ResumeAdmissionRequest,
        lease: Lease | None,
        first: Progress | None,
        correlation_id: str | None,
        pause: Suspension | None,
        receipt: Receipt | None = None,
    ) -> ResumeAdmission:
        version = req.version
        wanted = req.digest()
        if pause is None:
            # The digest binds the pause as claimed; a pause row never changes once written, so the one read
            # here is the one the transition claims (it is pinned to its id) or the claim fails.
            with contextlib.suppress(NotSuspended, RunConflict):
                pause = await self.pause_for(version)
        claimed_revision = version.run_revision + 1
        resumed = RunEvent(
            kind=RunEventKind.RESUMED, run_id=version.run_id, revision=claimed_revision, scope=self.scope
        )
        async with self.db.connection() as con:
            row = await con.fetchrow(
                "admit_resume",
                run_id=version.run_id,
                app=self.scope.app,
                tenant=self.scope.tenant,
                suspension_id=version.suspension_id,
                revision=version.run_revision,
                lease_owner=lease.owner if lease is not None else None,
                lease_ttl=lease.ttl_seconds if lease is not None else None,
                first_continuation=rows.dump(first.continuation) if first is not None else None,
                first_done=rows.dump_list(rows.DONE, first.done) if first is not None else None,
                schema_version=RESUME_SCHEMA_VERSION,
                input=req.input,
                request_digest=wanted,
                # The pause as read, its transient fields left out: this binds the stored pause and nothing else.
                suspension_digest=canonical_digest(pause) if pause is not None else None,
                **inbox_arguments(receipt, self.scope),
                # In the run's trace: the one its pause recorded, else the command's (intermission/tracing.py).
                **outbox.run_event(resumed, correlation_id, traceparent=_trace_of(pause)).arguments(),
            )
        assert row is not None  # the function always returns its one row
        outcome = row["outcome"]
        if outcome == "message_id_conflict":
            assert receipt is not None
            raise MessageIdConflict(f"message_id {receipt.message_id} was used for a different command")
        if outcome in ("admitted", "admitted_before"):
            return _admission(row["admission"], fresh=outcome == "admitted")
        if outcome == "resume_admission_conflict":
            raise ResumeAdmissionConflict(
                f"suspension {version.suspension_id} of run {version.run_id} was admitted with a different request"
            )
        if outcome == "wrong_reason":
            raise NotAgentReplyResumable(f"the pause of run {version.run_id} does not wait on an agent reply")
        raise refusal(outcome, row, self.scope, version.run_id, version=version)

    # --- start -------------------------------------------------------------------------------------

    async def start_resume(self, run_id: str, suspension_id: int, digest: str) -> ResumeStart:
        """The single grant of execution for an admission whose request digest is ``digest``.

        Only the fresh start carries the suspension (read in the granting transaction). A retry or a read
        returns the record without it. A digest that does not match the admission is
        ResumeAdmissionConflict; no admission is ResumeAdmissionNotFound; an admission that was expired is
        SuspensionExpired (the expiry proved the continuation must not run).
        """
        self._check_key(run_id, suspension_id, digest)
        return await self._start(run_id, suspension_id, digest, None, None)

    async def start_resume_leased(
        self, run_id: str, suspension_id: int, digest: str, lease: Lease, first: Progress | None = None
    ) -> ResumeStart:
        """``start_resume`` that takes the run's lease, whoever held it, and writes ``first`` in the
        granting transaction: the one worker allowed to execute holds the run from then on. The revision
        stays the admission's claimed_revision. A start recorded before is returned as it is and takes
        nothing."""
        self._check_key(run_id, suspension_id, digest)
        _check_lease(lease, run_id, first)
        return await self._start(run_id, suspension_id, digest, lease, first)

    @staticmethod
    def _check_key(run_id: str, suspension_id: int, digest: str) -> None:
        _check_run_id(run_id)
        _check_suspension_id(suspension_id)
        if not isinstance(digest, str) or _DIGEST.match(digest) is None:
            raise InvalidArgument("digest must be the admission's request digest (lowercase hex SHA-256)")

    async def _start(
        self, run_id: str, suspension_id: int, digest: str, lease: Lease | None, first: Progress | None
    ) -> ResumeStart:
        where = f"suspension {suspension_id} of run {run_id}"
        # The grant and the decoding of the pause it hands over share one transaction: a pause that cannot
        # be read rolls the grant back, rather than leaving a committed start whose suspension nobody got.
        async with self.db.transaction() as con:
            row = await con.fetchrow(
                "start_resume",
                run_id=run_id,
                app=self.scope.app,
                tenant=self.scope.tenant,
                suspension_id=suspension_id,
                digest=digest,
                lease_owner=lease.owner if lease is not None else None,
                lease_ttl=lease.ttl_seconds if lease is not None else None,
                first_continuation=rows.dump(first.continuation) if first is not None else None,
                first_done=rows.dump_list(rows.DONE, first.done) if first is not None else None,
                schema_version=RESUME_SCHEMA_VERSION,
            )
            assert row is not None  # the function always returns its one row
            outcome = row["outcome"]
            if outcome == "no_admission":
                raise ResumeAdmissionNotFound(f"no admission for {where} at scope {self.scope}")
            if outcome == "digest_conflict":
                raise ResumeAdmissionConflict(f"the admission of {where} has another request digest")
            if outcome == "expired":
                raise SuspensionExpired(
                    f"the admission of {where} expired at {row['expired_at'].isoformat()}; it can never start"
                )
            if outcome == "run_conflict":
                run = row["run"]
                now = "gone" if run is None else f"{run['state']} at revision {run['revision']}"
                raise RunConflict(f"run {run_id} is {now}; its admission claimed it at another revision")
            if outcome == "pause_gone":
                # The continuation to execute is gone, so there is nothing this grant could hand over.
                raise NotSuspended(f"the admitted pause {suspension_id} of run {run_id} is gone")
            record = _start_record(row["start"])
            if outcome == "started_before":
                return record
            return record.model_copy(
                update={
                    "fresh": True,
                    "suspension": rows.suspension_from_row(row["pause"]),
                    "run": rows.run_from_row(row["run"]),
                }
            )

    async def _admission_for(self, con: Conn, run_id: str, suspension_id: int, digest: str) -> ResumeAdmission:
        row = await con.fetchrow("resume_get_admission", run_id, suspension_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise ResumeAdmissionNotFound(
                f"no admission for suspension {suspension_id} of run {run_id} at scope {self.scope}"
            )
        if row["request_digest"] != digest:
            raise ResumeAdmissionConflict(
                f"the admission of suspension {suspension_id} of run {run_id} has another request digest"
            )
        return _admission(row)

    # --- reads -------------------------------------------------------------------------------------

    async def _evidence(self, query: str, what: str, run_id: str, suspension_id: int) -> asyncpg.Record:
        """One evidence row of a pause at this scope, by its named query; ResumeAdmissionNotFound naming
        ``what`` when there is none."""
        _check_run_id(run_id)
        _check_suspension_id(suspension_id)
        async with self.db.connection() as con:
            row = await con.fetchrow(query, run_id, suspension_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise ResumeAdmissionNotFound(
                f"no {what} for suspension {suspension_id} of run {run_id} at scope {self.scope}"
            )
        return row

    async def get_resume_admission(self, run_id: str, suspension_id: int) -> ResumeAdmission:
        return _admission(await self._evidence("resume_get_admission", "admission", run_id, suspension_id))

    async def latest_resume_admission(self, run_id: str) -> ResumeAdmission:
        """The run's admission with the highest suspension id: its latest admitted pause."""
        _check_run_id(run_id)
        async with self.db.connection() as con:
            row = await con.fetchrow("resume_latest_admission", run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise ResumeAdmissionNotFound(f"no admission for run {run_id} at scope {self.scope}")
        return _admission(row)

    async def list_resume_admissions(self, cursor: str, limit: int) -> ResumeAdmissionPage:
        """Exact-scope admission history in (run id, suspension id) order, ``limit`` (1 to
        MAX_ADMISSION_PAGE) at a time. ``cursor`` is "" for the first page, then the page's ``next``;
        ``next`` is "" on the last page."""
        bounded = _check_limit(limit, MAX_ADMISSION_PAGE)
        after = decode_cursor(self.scope, cursor)
        async with self.db.connection() as con:
            found = await con.fetch(
                "resume_list_admissions",
                self.scope.app,
                self.scope.tenant,
                after[0] if after is not None else None,
                after[1] if after is not None else None,
                # One more than asked says whether another page exists, so the last page never hands out a
                # cursor that leads to an empty one.
                bounded + 1,
            )
        page = [_admission(r) for r in found[:bounded]]
        more = len(found) > bounded
        last = page[-1].request.version if page else None
        next_cursor = encode_cursor(self.scope, last.run_id, last.suspension_id) if more and last else ""
        return ResumeAdmissionPage(admissions=page, next=next_cursor)

    async def list_run_admissions(self, run_id: str) -> list[AdmissionState]:
        """Operators: the run's admissions in pause order, each with whether it was started, expired or
        closed."""
        _check_run_id(run_id)
        async with self.db.connection() as con:
            found = await con.fetch("list_run_admissions", run_id, self.scope.app, self.scope.tenant)
        return [
            AdmissionState(
                suspension_id=r["suspension_id"],
                pinned_revision=r["pinned_revision"],
                claimed_revision=r["claimed_revision"],
                admitted_at=r["admitted_at"],
                started_at=r["started_at"],
                expired_at=r["expired_at"],
                closed_at=r["closed_at"],
            )
            for r in found
        ]

    async def get_resume_start(self, run_id: str, suspension_id: int) -> ResumeStart:
        """A recorded start, never with its suspension: reading a start grants nothing."""
        return _start_record(await self._evidence("resume_get_start", "start", run_id, suspension_id))

    async def get_resume_expiry(self, run_id: str, suspension_id: int) -> ResumeExpiry:
        return _expiry(await self._evidence("resume_get_expiry", "expiry", run_id, suspension_id))

    async def get_resume_closure(self, run_id: str, suspension_id: int) -> ResumeClosure:
        return _closure(await self._evidence("resume_get_closure", "closure", run_id, suspension_id))

    # --- expiry ------------------------------------------------------------------------------------

    async def expire_resume_admission(self, run_id: str, suspension_id: int, digest: str) -> ResumeExpiry:
        """Record that the admission expired before it started, with its run_events row, under the run's
        lock that start shares. An existing start is ResumeAlreadyStarted (it may have executed: only a
        closure can end that). The identical retry returns the stored expiry with ``fresh`` false.

        It does not change the run: expiry is evidence that forbids the start, not an end. It grants no
        execution and releases nothing; ending the run (failed, expired) is the lease holder's end_run,
        so expiry never needs the lease and never races the holder's own end.
        """
        self._check_key(run_id, suspension_id, digest)
        scope = self.scope
        async with self.db.transaction() as con:
            run = await con.fetchrow("resume_lock_run", run_id, scope.app, scope.tenant)
            admission = await self._admission_for(con, run_id, suspension_id, digest)
            existing = await con.fetchrow("resume_get_expiry", run_id, suspension_id, scope.app, scope.tenant)
            if existing is not None:
                return _expiry(existing)
            if await con.fetchrow("resume_get_start", run_id, suspension_id, scope.app, scope.tenant):
                raise ResumeAlreadyStarted(
                    f"suspension {suspension_id} of run {run_id} was started; its execution may have begun"
                )
            if run is None:
                # The admission names the run at this scope and runs are never deleted; a missing row is
                # not a state to record evidence against.
                raise ResumeAdmissionNotFound(f"no run {run_id} at scope {scope}")
            event_id = uuid.uuid4()
            revision: int = run["revision"]
            expired_at = await con.fetchval(
                "resume_insert_expiry",
                run_id,
                suspension_id,
                scope.app,
                scope.tenant,
                RESUME_SCHEMA_VERSION,
                admission.request.version.run_revision,
                admission.request_digest,
                event_id,
                revision,
                json.dumps({"suspension_id": suspension_id, "request_digest": admission.request_digest}),
            )
        return ResumeExpiry(
            schema_version=RESUME_SCHEMA_VERSION,
            version=admission.request.version,
            scope=scope,
            request_digest=admission.request_digest,
            event_id=event_id,
            run_revision=revision,
            expired_at=expired_at,
            fresh=True,
        )

    # --- closure -----------------------------------------------------------------------------------

    async def close_resume(self, request: ResumeClosureRequest) -> ResumeClosure:
        """End an uncertain start as incomplete, with its receipt and run_events row, in one transaction.

        Call it through ResumeCloser: the store checks evidence, not authority. Under the run's row lock
        (serialised with every run writer) the request must bind the run's LATEST admission, that
        admission's start, and the run's CURRENT revision, and the proof must not have expired by the
        database clock. The run then ends through the end transition, failed with an error that says
        incomplete (there is no 'incomplete' state): revision + 1, lease, progress and pause removed, and a
        ``run.failed`` event in the outbox. The identical request again returns the original receipt with
        ``fresh`` false, whatever happened since (the proof expiring included); a changed request is
        ResumeAdmissionConflict.
        """
        scope = self.scope
        if not isinstance(request, ResumeClosureRequest):
            raise InvalidArgument("a closure request is required")
        frozen, wanted = request.freeze()
        if frozen.scope != scope:
            raise InvalidArgument(f"the request is bound to scope {frozen.scope}, not the caller's {scope}")
        version = frozen.version
        run_id, suspension_id = version.run_id, version.suspension_id
        async with self.db.transaction() as con:
            run = await con.fetchrow("resume_lock_run", run_id, scope.app, scope.tenant)
            existing = await con.fetchrow("resume_get_closure", run_id, suspension_id, scope.app, scope.tenant)
            if existing is not None:
                if existing["request_digest"] != wanted:
                    raise ResumeAdmissionConflict(
                        f"suspension {suspension_id} of run {run_id} was closed with a different request"
                    )
                return _closure(existing)
            if run is None:
                raise ResumeAdmissionNotFound(f"no run {run_id} at scope {scope}")
            if frozen.expires_at <= run["db_now"]:
                raise Forbidden(f"the closure proof expired at {frozen.expires_at.isoformat()}")
            await self._check_binding(con, frozen, run)
            error = INCOMPLETE_ERROR.format(suspension_id=suspension_id, proof_ref=frozen.proof_ref)
            event_id = uuid.uuid4()
            # No lease: the closure holds the run's row lock and binds the revision it just checked.
            ended = await con.fetchrow(
                "end_run",
                owner=None,
                at_revision=frozen.run_revision,
                # Not handed over: the relays publish the closure's run.failed.
                outbox_hold=None,
                **end_arguments(
                    scope,
                    run_id,
                    RunEventKind.FAILED,
                    output=None,
                    error=error,
                    correlation_id=None,
                    own_messages=None,
                    # In the trace of whoever closes it, when one is current.
                    traceparent=current_traceparent(),
                    run_event_id=event_id,
                    run_event_kind="resume_closed",
                    run_event_data={
                        "outcome": "incomplete",
                        "suspension_id": suspension_id,
                        "request_digest": wanted,
                        "admission_digest": frozen.admission_digest,
                        "start_digest": frozen.start_digest,
                        "actor": frozen.actor,
                        "issuer": frozen.issuer,
                        "issuer_revision": frozen.issuer_revision,
                        "proof_ref": frozen.proof_ref,
                        "proof_digest": frozen.proof_digest,
                    },
                ),
            )
            assert ended is not None
            revision = ended["revision"]
            assert revision is not None  # locked, running, at the bound revision: checked above
            closed_at = await con.fetchval(
                "resume_insert_closure",
                run_id,
                suspension_id,
                scope.app,
                scope.tenant,
                RESUME_SCHEMA_VERSION,
                frozen.model_dump_json(),
                wanted,
                event_id,
                revision,
            )
        return ResumeClosure(
            request=frozen,
            request_digest=wanted,
            event_id=event_id,
            run_revision=revision,
            closed_at=closed_at,
            fresh=True,
        )

    async def _check_binding(self, con: Conn, req: ResumeClosureRequest, run: asyncpg.Record) -> None:
        """The request must describe the world as it is under the lock, or it closes something else."""
        scope = self.scope
        version = req.version
        latest = await con.fetchrow("resume_latest_admission", version.run_id, scope.app, scope.tenant)
        if latest is None:
            raise ResumeAdmissionNotFound(f"no admission for run {version.run_id} at scope {scope}")
        admission = _admission(latest)
        if admission.request.version.suspension_id != version.suspension_id:
            raise RunConflict(
                f"the latest admission of run {version.run_id} is for suspension "
                f"{admission.request.version.suspension_id}, not {version.suspension_id}"
            )
        if admission.request.version != version or admission.request_digest != req.admission_digest:
            raise ResumeAdmissionConflict("the closure does not bind the latest admission as recorded")
        start = await con.fetchrow("resume_get_start", version.run_id, version.suspension_id, scope.app, scope.tenant)
        if start is None:
            # Nothing started, so nothing is uncertain: an unstarted admission is expired, not closed.
            raise ResumeAdmissionNotFound(
                f"suspension {version.suspension_id} of run {version.run_id} has no start to close"
            )
        if _start_record(start).digest() != req.start_digest:
            raise ResumeAdmissionConflict("the closure does not bind the recorded start")
        if run["revision"] != req.run_revision:
            raise RunConflict(
                f"run {version.run_id} is at revision {run['revision']}, not {req.run_revision}: the closure is stale"
            )
        if run["state"] != RunState.RUNNING.value:
            raise InvalidState(f"run {version.run_id} is {run['state']}; only running execution is closed")

    # --- discovery ---------------------------------------------------------------------------------

    async def list_agent_reply_runs(self, after: str, limit: int) -> list[str]:
        """Run ids at this scope with a retained agent_reply pause (expired and already admitted ones
        included) or a running admission whose pause may be gone, ascending strictly after ``after``
        ("" for the start). ``limit`` must be 1 to 256. Hosts reconcile interrupted execution from here,
        with LatestResumeAdmission."""
        bounded = _check_limit(limit, MAX_DISCOVERY_PAGE)
        if after != "":
            try:
                _check_run_id(after)
            except InvalidArgument as exc:
                raise InvalidArgument("after must be a run id, or empty for the first page") from exc
        async with self.db.connection() as con:
            found = await con.fetch("resume_list_agent_reply_runs", self.scope.app, self.scope.tenant, after, bounded)
        return [r["run_id"] for r in found]


def _trace_of(pause: Suspension | None) -> str | None:
    """The trace a claim's run.resumed carries: the run's, as its pause recorded it; else the command's."""
    recorded = pause.continuation.traceparent if pause is not None else None
    return recorded or current_traceparent()
