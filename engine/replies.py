"""Agent-reply resumes: admission, the single grant of execution, the expiry of an admission that never
started, and the closure of a start whose outcome is uncertain.

How the exactly-once guarantees are made:

- An ADMISSION is one transition (``intermission_admit_resume_v1``): the claim of the pinned
  ``agent_reply`` pause (the one claim every claimer uses, contending on the run's row lock), then the
  admission row. A caller that loses the claim reads the admission the winner committed and gets it back
  (``fresh`` false) when its request is identical, or a conflict when it is not; it never claims.
- START (``intermission_start_resume_v1``), EXPIRY (``intermission_expire_admission_v1``) and CLOSURE
  (``intermission_close_resume_v1``) each begin by locking the run's row FOR UPDATE. Every run writer
  updates that row, so these serialise with all of them, and start and expiry (which each refuse when the
  other exists) cannot both commit for one admission: the second to get the lock sees the first's row.
- Idempotency is by content: each write's request is digested with the one canonical digest, and an
  identical retry returns the stored record before any other check runs, so a retry after a lost
  acknowledgement succeeds even when the world has moved on (the run re-paused, the proof expired).

Errors return nothing and grant nothing, an ambiguous commit included: a caller that does not hold a fresh
ResumeStart does not execute. It retries the identical request and learns what happened.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, NamedTuple

from intermission.engine.claims import check_first, check_lease, refusal
from intermission.engine.columns import event_fields, grant_columns, maybe_event_fields
from intermission.engine.events import OutboxEvent, run_event
from intermission.engine.transition import Family, OfRun, Operation, RunKey, Steps, Transition, only
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
    SuspensionExpired,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.resume import (
    RESUME_SCHEMA_VERSION,
    ResumeAdmission,
    ResumeAdmissionRequest,
    ResumeClosure,
    ResumeClosureRequest,
    ResumeExpiry,
    ResumeStart,
)
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import Progress, Suspension
from intermission.store import rows
from intermission.store.inbox import Receipt, inbox_arguments
from intermission.store.resume import (
    admission_from_row,
    check_key,
    closure_from_row,
    expiry_from_row,
    start_from_row,
)
from intermission.store.rows import Out
from intermission.tracing import current_traceparent

# The error a closed run carries. There is no 'incomplete' run state (the state enum is the original's), so a
# closure ends the run 'failed' and says incomplete in words; the resume_closed event is the typed record.
INCOMPLETE_ERROR = "incomplete: resume of suspension {suspension_id} closed under host proof {proof_ref}"


# --- the evidence of one pause ----------------------------------------------------------------------


class PauseKeyRow(NamedTuple):
    """``intermission_pause_key_v1``."""

    run_id: str
    app: str
    tenant: str
    suspension_id: int


READ_EVIDENCE = Family("read_evidence", "read_evidence", PauseKeyRow, reads=True)


@dataclass(frozen=True)
class Evidence:
    """An agent-reply pause's admission, the run's latest admission, and the pause's start (None: none)."""

    admission: ResumeAdmission | None
    latest: ResumeAdmission | None
    start: ResumeStart | None


@dataclass(frozen=True)
class ReadEvidence(OfRun[Evidence]):
    family: ClassVar[Family] = READ_EVIDENCE

    suspension_id: int

    def row(self) -> PauseKeyRow:
        return PauseKeyRow(self.run_id, self.scope.app, self.scope.tenant, self.suspension_id)

    def result(self, outs: Sequence[Out]) -> Evidence:
        out = only(outs)
        return Evidence(
            admission=admission_from_row(out["admission"]) if out["admission"] is not None else None,
            latest=admission_from_row(out["latest"]) if out["latest"] is not None else None,
            start=start_from_row(out["start"]) if out["start"] is not None else None,
        )


def admission_named(outcome: str, scope: Scope, run_id: str, suspension_id: int) -> str:
    """What a start and an expiry of an admission say of it (``suspension 7 of run r1``), once the refusals
    they share are raised: the admission they name is not there, or its request is another."""
    where = f"suspension {suspension_id} of run {run_id}"
    if outcome == "no_admission":
        raise ResumeAdmissionNotFound(f"no admission for {where} at scope {scope}")
    if outcome == "digest_conflict":
        raise ResumeAdmissionConflict(f"the admission of {where} has another request digest")
    return where


# --- admission ---------------------------------------------------------------------------------------


class AdmissionRow(NamedTuple):
    """``intermission_admission_v2``."""

    run_id: str
    app: str
    tenant: str
    suspension_id: int
    revision: int
    lease_owner: str | None
    lease_ttl: float | None
    first_continuation: str | None
    first_done: str | None
    schema_version: int
    input: bytes
    request_digest: str
    suspension_digest: str | None
    message_id: str | None
    routing_key: str | None
    digest: str | None
    event_message_id: uuid.UUID | None
    event_routing_key: str | None
    event_body: str | None
    event_correlation_id: str | None
    event_headers: str | None


ADMIT = Family("admit", "admit_resumes_v2", AdmissionRow, held=True, success=frozenset({"admitted"}))


@dataclass(frozen=True)
class AdmitResume(Transition[ResumeAdmission]):
    """Claim the pinned agent_reply pause and retain the reply, in one transaction (see the module
    docstring); with ``lease`` it also takes the run's lease and writes ``first``, so an admitter that dies
    before it starts leaves a lease that lapses and the reply in the snapshot. ``pause`` is the pinned pause
    as read (its digest binds the admission to it); ``receipt`` the delivering command's inbox record."""

    family: ClassVar[Family] = ADMIT

    request: ResumeAdmissionRequest
    pause: Suspension | None
    lease: Lease | None = None
    first: Progress | None = None
    correlation_id: str | None = None
    receipt: Receipt | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request, ResumeAdmissionRequest):
            raise InvalidArgument("an admission request is required")
        self.request.check(self.request.scope)
        if self.lease is not None:
            check_lease(self.lease)
            if self.first is not None:
                check_first(self.first, self.lease.owner, self.request.version.run_id)
        self.event  # noqa: B018 - built now, in the caller's context (its trace), not in the committer's

    @property
    def scope(self) -> Scope:
        return self.request.scope

    @cached_property
    def event(self) -> OutboxEvent:
        # Built once, so that the row written and the event handed to the sink share one message_id.
        version = self.request.version
        resumed = RunEvent(
            kind=RunEventKind.RESUMED, run_id=version.run_id, revision=version.run_revision + 1, scope=self.scope
        )
        # In the run's trace: the one its pause recorded, else the command's (intermission/tracing.py).
        recorded = self.pause.continuation.traceparent if self.pause is not None else None
        return run_event(resumed, self.correlation_id, traceparent=recorded or current_traceparent())

    def key(self) -> RunKey:
        return (self.scope.app, self.scope.tenant, self.request.version.run_id)

    def row(self) -> AdmissionRow:
        version, lease, first = self.request.version, self.lease, self.first
        inbox = inbox_arguments(self.receipt, self.scope)
        return AdmissionRow(
            version.run_id,
            self.scope.app,
            self.scope.tenant,
            version.suspension_id,
            version.run_revision,
            *grant_columns(lease, first),
            RESUME_SCHEMA_VERSION,
            self.request.input,
            self.request.digest(),
            # The pause as read, its transient fields left out: this binds the stored pause and nothing else.
            canonical_digest(self.pause) if self.pause is not None else None,
            inbox["message_id"],
            inbox["routing_key"],
            inbox["digest"],
            **maybe_event_fields(self.event),
        )

    def events(self) -> Sequence[OutboxEvent]:
        return (self.event,)

    def result(self, outs: Sequence[Out]) -> ResumeAdmission:
        out = only(outs)
        outcome, version = out["outcome"], self.request.version
        if outcome == "message_id_conflict":
            assert self.receipt is not None
            raise MessageIdConflict(f"message_id {self.receipt.message_id} was used for a different command")
        if outcome in ("admitted", "admitted_before"):
            return admission_from_row(out["admission"], fresh=outcome == "admitted")
        if outcome == "resume_admission_conflict":
            raise ResumeAdmissionConflict(
                f"suspension {version.suspension_id} of run {version.run_id} was admitted with a different request"
            )
        if outcome == "wrong_reason":
            raise NotAgentReplyResumable(f"the pause of run {version.run_id} does not wait on an agent reply")
        raise refusal(outcome, out, self.scope, version.run_id, version=version)


# --- start -------------------------------------------------------------------------------------------


class ResumeStartRow(NamedTuple):
    """``intermission_resume_start_v2``."""

    run_id: str
    app: str
    tenant: str
    suspension_id: int
    digest: str
    lease_owner: str | None
    lease_ttl: float | None
    first_continuation: str | None
    first_done: str | None
    schema_version: int


START_RESUME = Family("start_resume", "start_resumes_v2", ResumeStartRow, success=frozenset({"started"}))


@dataclass(frozen=True)
class StartResume(OfRun[ResumeStart]):
    """The single grant of execution for an admission whose request digest is ``digest``; with ``lease`` it
    takes the run's lease, whoever held it, and writes ``first`` in the granting transaction.

    Only the fresh start carries the suspension (read in the granting transaction, and decoded before it
    commits: a pause that cannot be read rolls the grant back, rather than leaving a committed start whose
    suspension nobody got). A retry or a read returns the record without it. A digest that does not match
    the admission is ResumeAdmissionConflict; no admission is ResumeAdmissionNotFound; an admission that
    was expired is SuspensionExpired (the expiry proved the continuation must not run)."""

    family: ClassVar[Family] = START_RESUME
    atomic: ClassVar[bool] = True

    suspension_id: int
    digest: str
    lease: Lease | None = None
    first: Progress | None = None

    def __post_init__(self) -> None:
        require_scope(self.scope)
        check_key(self.run_id, self.suspension_id, self.digest)
        if self.lease is not None:
            check_lease(self.lease)
            if self.first is not None:
                check_first(self.first, self.lease.owner, self.run_id)

    def row(self) -> ResumeStartRow:
        lease, first = self.lease, self.first
        return ResumeStartRow(
            self.run_id,
            self.scope.app,
            self.scope.tenant,
            self.suspension_id,
            self.digest,
            *grant_columns(lease, first),
            RESUME_SCHEMA_VERSION,
        )

    def result(self, outs: Sequence[Out]) -> ResumeStart:
        out = only(outs)
        outcome = out["outcome"]
        where = admission_named(outcome, self.scope, self.run_id, self.suspension_id)
        if outcome == "expired":
            raise SuspensionExpired(
                f"the admission of {where} expired at {out['expired_at'].isoformat()}; it can never start"
            )
        if outcome == "run_conflict":
            run = out["run"]
            now = "gone" if run is None or run["id"] is None else f"{run['state']} at revision {run['revision']}"
            raise RunConflict(f"run {self.run_id} is {now}; its admission claimed it at another revision")
        if outcome == "pause_gone":
            # The continuation to execute is gone, so there is nothing this grant could hand over.
            raise NotSuspended(f"the admitted pause {self.suspension_id} of run {self.run_id} is gone")
        record = start_from_row(out["start"])
        if outcome == "started_before":
            return record
        return record.model_copy(
            update={
                "fresh": True,
                "suspension": rows.suspension_from_row(out["pause"]),
                "run": rows.run_from_row(out["run"]),
            }
        )


# --- expiry ------------------------------------------------------------------------------------------


class ExpiryRow(NamedTuple):
    """``intermission_admission_expiry_v1``."""

    run_id: str
    app: str
    tenant: str
    suspension_id: int
    digest: str
    schema_version: int
    event_id: uuid.UUID


EXPIRE_ADMISSION = Family("expire_admission", "expire_admissions_v1", ExpiryRow, success=frozenset({"expired"}))


@dataclass(frozen=True)
class ExpireAdmission(OfRun[ResumeExpiry]):
    """Record that the admission expired before it started, with its run_events row, under the run's lock
    that start shares. An existing start is ResumeAlreadyStarted (it may have executed: only a closure can end
    that). The identical retry returns the stored expiry with ``fresh`` false.

    It does not change the run: expiry is evidence that forbids the start, not an end. It grants no execution
    and releases nothing; ending the run (failed, expired) is the lease holder's end, so expiry never needs
    the lease and never races the holder's own end."""

    family: ClassVar[Family] = EXPIRE_ADMISSION

    suspension_id: int
    digest: str

    def __post_init__(self) -> None:
        require_scope(self.scope)
        check_key(self.run_id, self.suspension_id, self.digest)

    def row(self) -> ExpiryRow:
        return ExpiryRow(
            self.run_id,
            self.scope.app,
            self.scope.tenant,
            self.suspension_id,
            self.digest,
            RESUME_SCHEMA_VERSION,
            uuid.uuid4(),
        )

    def result(self, outs: Sequence[Out]) -> ResumeExpiry:
        out = only(outs)
        outcome = out["outcome"]
        where = admission_named(outcome, self.scope, self.run_id, self.suspension_id)
        if outcome == "started":
            raise ResumeAlreadyStarted(f"{where} was started; its execution may have begun")
        if outcome == "no_run":
            # The admission names the run at this scope and runs are never deleted; a missing row is not a
            # state to record evidence against.
            raise ResumeAdmissionNotFound(f"no run {self.run_id} at scope {self.scope}")
        return expiry_from_row(out["expiry"], fresh=outcome == "expired")


# --- closure -----------------------------------------------------------------------------------------


class ClosureRow(NamedTuple):
    """``intermission_closure_v1``."""

    run_id: str
    app: str
    tenant: str
    suspension_id: int
    schema_version: int
    request: str
    request_digest: str
    pinned_revision: int
    admission_digest: str
    start_started_at: Any
    start_matches: bool
    run_revision: int
    proof_expires_at: Any
    error: str
    run_event_id: uuid.UUID
    run_event_data: str
    event_message_id: uuid.UUID
    event_routing_key: str
    event_body: str
    event_correlation_id: str | None
    event_headers: str


CLOSE = Family("close", "close_resumes_v1", ClosureRow, held=True, success=frozenset({"closed"}))


@dataclass(frozen=True)
class CloseWritten(Transition[ResumeClosure | None]):
    """The closure transition itself, given what the worker read and checked of the start (``CloseResume``
    reads it). Its result is None when the start moved since that read (read again)."""

    family: ClassVar[Family] = CLOSE

    request: ResumeClosureRequest
    wanted: str
    start: ResumeStart | None
    event_id: uuid.UUID

    @property
    def scope(self) -> Scope:
        return self.request.scope

    @property
    def error(self) -> str:
        return INCOMPLETE_ERROR.format(
            suspension_id=self.request.version.suspension_id, proof_ref=self.request.proof_ref
        )

    def __post_init__(self) -> None:
        self.event  # noqa: B018 - built now, in the caller's context (its trace), not in the committer's

    @cached_property
    def event(self) -> OutboxEvent:
        # Built once, so that the row written and the event handed to the sink share one message_id.
        failed = RunEvent(
            kind=RunEventKind.FAILED,
            run_id=self.request.version.run_id,
            revision=self.request.run_revision + 1,
            scope=self.scope,
            error=self.error,
        )
        # In the trace of whoever closes it, when one is current.
        return run_event(failed, None, traceparent=current_traceparent())

    def key(self) -> RunKey:
        return (self.scope.app, self.scope.tenant, self.request.version.run_id)

    def row(self) -> ClosureRow:
        request, version = self.request, self.request.version
        data = {
            "outcome": "incomplete",
            "suspension_id": version.suspension_id,
            "request_digest": self.wanted,
            "admission_digest": request.admission_digest,
            "start_digest": request.start_digest,
            "actor": request.actor,
            "issuer": request.issuer,
            "issuer_revision": request.issuer_revision,
            "proof_ref": request.proof_ref,
            "proof_digest": request.proof_digest,
        }
        return ClosureRow(
            version.run_id,
            self.scope.app,
            self.scope.tenant,
            version.suspension_id,
            RESUME_SCHEMA_VERSION,
            request.model_dump_json(),
            self.wanted,
            version.run_revision,
            request.admission_digest,
            self.start.started_at if self.start is not None else None,
            self.start is not None and self.start.digest() == request.start_digest,
            request.run_revision,
            request.expires_at,
            self.error,
            self.event_id,
            json.dumps(data),
            **event_fields(self.event),
        )

    def events(self) -> Sequence[OutboxEvent]:
        return (self.event,)

    def result(self, outs: Sequence[Out]) -> ResumeClosure | None:
        out = only(outs)
        outcome = out["outcome"]
        version = self.request.version
        run_id, suspension_id = version.run_id, version.suspension_id
        if outcome in ("closed", "closed_before"):
            return closure_from_row(out["closure"], fresh=outcome == "closed")
        if outcome == "start_moved":
            return None
        if outcome == "closure_conflict":
            raise ResumeAdmissionConflict(
                f"suspension {suspension_id} of run {run_id} was closed with a different request"
            )
        if outcome == "no_run":
            raise ResumeAdmissionNotFound(f"no run {run_id} at scope {self.scope}")
        if outcome == "proof_expired":
            raise Forbidden(f"the closure proof expired at {self.request.expires_at.isoformat()}")
        if outcome == "no_admission":
            raise ResumeAdmissionNotFound(f"no admission for run {run_id} at scope {self.scope}")
        if outcome == "not_latest":
            raise RunConflict(
                f"the latest admission of run {run_id} is for suspension {out['revision']}, not {suspension_id}"
            )
        if outcome == "admission_conflict":
            raise ResumeAdmissionConflict("the closure does not bind the latest admission as recorded")
        if outcome == "no_start":
            # Nothing started, so nothing is uncertain: an unstarted admission is expired, not closed.
            raise ResumeAdmissionNotFound(f"suspension {suspension_id} of run {run_id} has no start to close")
        if outcome == "start_conflict":
            raise ResumeAdmissionConflict("the closure does not bind the recorded start")
        if outcome == "stale":
            raise RunConflict(
                f"run {run_id} is at revision {out['revision']}, not {self.request.run_revision}: the closure is stale"
            )
        raise InvalidState(f"run {run_id} is not running; only running execution is closed")


# How often a closure reads the start again because it appeared between its read and its write.
CLOSE_ATTEMPTS = 4


@dataclass(frozen=True)
class CloseResume(Operation[ResumeClosure]):
    """End an uncertain start as incomplete, with its receipt and run_events row, in one transaction.

    Apply it through ``ResumeCloser`` (``engine/closer.py``): the engine checks evidence, not authority. Under
    the run's row lock (serialised with every run writer) the request must bind the run's LATEST admission,
    that admission's start, and the run's CURRENT revision, and the proof must not have expired by the
    database clock. The run then ends failed with an error that says incomplete (there is no 'incomplete'
    state): revision + 1, lease, progress and pause removed, and a ``run.failed`` event in the outbox. The
    identical request again returns the original receipt with ``fresh`` false, whatever happened since (the
    proof expiring included); a changed request is ResumeAdmissionConflict."""

    scope: Scope
    request: ResumeClosureRequest

    async def apply_in(self, steps: Steps) -> ResumeClosure:
        if not isinstance(self.request, ResumeClosureRequest):
            raise InvalidArgument("a closure request is required")
        frozen, wanted = self.request.freeze()
        if frozen.scope != require_scope(self.scope):
            raise InvalidArgument(f"the request is bound to scope {frozen.scope}, not the caller's {self.scope}")
        version = frozen.version
        event_id = uuid.uuid4()
        for _ in range(CLOSE_ATTEMPTS):
            # A start row never changes once written: what is checked of it here is what the closure binds,
            # as long as the closure finds the same row under the lock.
            evidence = await steps.commit(ReadEvidence(self.scope, version.run_id, version.suspension_id))
            closed = await steps.commit(CloseWritten(frozen, wanted, evidence.start, event_id))
            if closed is not None:
                return closed
        raise RunConflict(f"the start of run {version.run_id} kept changing under the closure; try again")
