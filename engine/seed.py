"""The original package's store API at one exact scope, over the engine.

The package Intermission reimplements exposes its stores as interfaces (Store, VersionedStore,
LeasedClaimStore, ProgressStore, ResumeAdmissionStore, ...: ``docs/seed.md``). Hosts that use the library
directly, and the tests that prove each guarantee where the original states it, call those methods. Each is
here as a thin adapter: its reads are the store's read models (``store/``), its writes build the
transition and ``apply`` it, so they go through the one committer like everything else. No rule is written
here: a rule lives in its transition.
"""

from __future__ import annotations

from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING

from intermission.engine.claims import ClaimedPause, ClaimWhole, check_lease
from intermission.engine.holding import ReleaseLease, TakeOverRun
from intermission.engine.pauses import CreatePause, DeletePause, DeleteProgress, MovedDeadline, MoveDeadline
from intermission.engine.replies import AdmitResume, CloseResume, ExpireAdmission, StartResume
from intermission.engine.runs import EndRun, Pause, Paused, PauseRun, SaveProgress
from intermission.engine.starts import CreatedRun, StartRun
from intermission.schemas.errors import (
    InvalidArgument,
    NotSuspended,
    RunConflict,
    RunLeaseLost,
    RunNotFound,
    RunNotReclaimable,
    SuspensionExpired,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Message
from intermission.schemas.resume import (
    ResumeAdmission,
    ResumeAdmissionRequest,
    ResumeClosure,
    ResumeClosureRequest,
    ResumeExpiry,
    ResumeStart,
)
from intermission.schemas.run import Lease, NewRun, Run
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import ClaimVersion, Continuation, LeasedClaim, Progress, Suspension
from intermission.store import ScopedStores
from intermission.store.ledger import DemoLedger
from intermission.store.progress import ProgressStore
from intermission.store.resume import ResumeStore
from intermission.store.runs import RunStore
from intermission.store.sessions import SessionStore
from intermission.store.suspensions import SuspensionStore

if TYPE_CHECKING:
    from intermission.engine.core import Engine


def _stores_of(engine: Engine, scope: Scope) -> ScopedStores:
    if engine.stores is None:
        raise InvalidArgument("this engine has no store to read from (it was built over another committer)")
    return engine.stores.at(scope)


class Runs(RunStore):
    """Runs: create, read, lease release, takeover, pause and end."""

    def __init__(self, engine: Engine, scope: Scope) -> None:
        super().__init__(_stores_of(engine, scope).db, scope)
        self._engine = engine

    async def create_run(self, new: NewRun, lease: Lease | None = None, first: Progress | None = None) -> CreatedRun:
        """Create a run: running under ``lease`` (with its first snapshot) when one is given. The identical
        start again returns the stored run with ``fresh`` false; a different one under the id is RunExists."""
        return await self._engine.apply(StartRun(self.scope, new, lease, first))

    async def release_lease(self, run_id: str, owner: str) -> bool:
        return await self._engine.apply(ReleaseLease(self.scope, run_id, owner))

    async def claim_continuation_leased(self, run_id: str, lease: Lease, first: Progress | None = None) -> Run:
        """Take over a running run whose lease lapsed, under ``lease``, writing ``first`` in the same
        transaction (or handing its snapshot over as it stands). The revision does not change."""
        try:
            return await self._engine.apply(TakeOverRun(self.scope, run_id, lease, first))
        except RunNotReclaimable:
            await self.get_run(run_id)  # RunNotFound rather than RunNotReclaimable when there is no run
            raise

    async def pause_run(self, run_id: str, owner: str, pause: Pause, *, correlation_id: str | None = None) -> Paused:
        """Pause a running run held by ``owner`` (at the revision it has now)."""
        run = await self._held(run_id)
        return await self._engine.apply(PauseRun(run, owner, pause, correlation_id))

    async def end_run(
        self,
        run_id: str,
        owner: str,
        kind: RunEventKind,
        *,
        output: str | None = None,
        error: str | None = None,
        correlation_id: str | None = None,
        own_messages: list[Message] | None = None,
        counts: Continuation | None = None,
        traceparent: str | None = None,
    ) -> RunEvent:
        """End a running run held by ``owner`` (at the revision it has now)."""
        run = await self._held(run_id)
        return await self._engine.apply(
            EndRun(
                self.scope,
                run_id,
                owner,
                run.revision,
                kind,
                output=output,
                error=error,
                correlation_id=correlation_id,
                own_messages=own_messages,
                counts=counts,
                traceparent=traceparent,
            )
        )

    async def _held(self, run_id: str) -> Run:
        """The run as it stands, for the revision its holder's transition pins. A run that is not there is
        nobody's to pause or end."""
        try:
            return await self.get_run(run_id)
        except RunNotFound as exc:
            raise RunLeaseLost(f"nobody holds run {run_id}: there is none at scope {self.scope}") from exc


class Suspensions(SuspensionStore):
    """Suspensions and the claims that resume them (the original's Store, VersionedStore and the pause half
    of LeasedClaimStore)."""

    def __init__(self, engine: Engine, scope: Scope) -> None:
        super().__init__(_stores_of(engine, scope).db, scope)
        self._engine = engine

    async def create_suspension(self, s: Suspension, *, ttl_seconds: float | None = None) -> Suspension:
        return await self._engine.apply(CreatePause(self.scope, s, ttl_seconds))

    async def delete_suspension(self, run_id: str) -> None:
        await self._engine.apply(DeletePause(self.scope, run_id))

    async def move_deadline(
        self, run_id: str, suspension_id: int, *, extend_by: float | None, moved_by: str
    ) -> MovedDeadline:
        return await self._engine.apply(MoveDeadline(self.scope, run_id, suspension_id, extend_by, moved_by))

    async def claim_suspension(self, run_id: str) -> ClaimedPause:
        """The concurrency primitive for resume: paused -> running and the suspension read, atomically. The
        loser of a race gets NotSuspended; an expired pause is SuspensionExpired and nothing moves. The row is
        not deleted: the fleet deletes it before it re-enters the loop."""
        return await self._engine.apply(ClaimWhole(self.scope, run_id))

    async def claim_expired_suspension(self, run_id: str, now: datetime) -> ClaimedPause:
        """The same move, conditioned on the deadline having PASSED (by ``now`` and by the database clock):
        the two predicates partition one stored ``expires_at``, so a resume and a sweep are exclusive."""
        try:
            return await self._engine.apply(ClaimWhole(self.scope, run_id, expired_by=now))
        except SuspensionExpired as exc:  # pragma: no cover - an expired-by claim never reports expiry
            raise NotSuspended(exc.detail) from exc

    async def claim_suspension_version(self, version: ClaimVersion) -> ClaimedPause:
        """The claim fenced on (run, suspension, revision): a later pause of the same run never satisfies it."""
        return await self._engine.apply(ClaimWhole(self.scope, version.run_id, version=version))

    async def claim_suspension_leased(self, claim: LeasedClaim) -> ClaimedPause:
        """The pinned claim plus the run's lease and its first progress snapshot, in one transaction, so no
        worker that claimed a pause can die holding a running run nobody owns."""
        if not claim.lease.is_set:
            check_lease(claim.lease)
        return await self._engine.apply(
            ClaimWhole(
                self.scope,
                claim.version.run_id,
                version=claim.version,
                expired_by=claim.expired_by,
                lease=claim.lease,
                first=claim.first,
            )
        )


class Snapshots(ProgressStore):
    """The original's ProgressStore: a running run's last durable boundary, written only by its holder."""

    def __init__(self, engine: Engine, scope: Scope) -> None:
        super().__init__(_stores_of(engine, scope).db, scope)
        self._engine = engine

    async def save_progress(self, p: Progress) -> Progress:
        return await self._engine.apply(SaveProgress(self.scope, p))

    async def delete_progress(self, run_id: str) -> None:
        await self._engine.apply(DeleteProgress(self.scope, run_id))


class Resumes(ResumeStore):
    """Agent-reply resume evidence and the writes that make it (the original's ResumeAdmissionStore,
    ResumeRecoveryStore and ResumeClosureStore)."""

    def __init__(self, engine: Engine, scope: Scope) -> None:
        super().__init__(_stores_of(engine, scope).db, scope)
        self._engine = engine

    async def admit_resume(self, req: ResumeAdmissionRequest, *, correlation_id: str | None = None) -> ResumeAdmission:
        """Claim the pinned agent_reply pause and retain the reply, in one transaction. An admission never
        grants execution: StartResume does."""
        return await self._admit(req, None, None, correlation_id)

    async def admit_resume_leased(
        self,
        req: ResumeAdmissionRequest,
        lease: Lease,
        first: Progress | None = None,
        *,
        correlation_id: str | None = None,
    ) -> ResumeAdmission:
        """``admit_resume`` that also takes the run's lease and writes ``first`` in the claiming transaction."""
        check_lease(lease)
        return await self._admit(req, lease, first, correlation_id)

    async def _admit(
        self, req: ResumeAdmissionRequest, lease: Lease | None, first: Progress | None, correlation_id: str | None
    ) -> ResumeAdmission:
        if not isinstance(req, ResumeAdmissionRequest):
            raise InvalidArgument("an admission request is required")
        req.check(self.scope)
        # The digest binds the pause as claimed; a pause row never changes once written, so the one read here
        # is the one the transition claims (it is pinned to its id) or the claim fails.
        pause: Suspension | None = None
        try:
            pause = await self.pause_for(req.version)
        except (NotSuspended, RunConflict):
            pause = None
        return await self._engine.apply(AdmitResume(req, pause, lease, first, correlation_id=correlation_id))

    async def start_resume(self, run_id: str, suspension_id: int, digest: str) -> ResumeStart:
        return await self._engine.apply(StartResume(self.scope, run_id, suspension_id, digest))

    async def start_resume_leased(
        self, run_id: str, suspension_id: int, digest: str, lease: Lease, first: Progress | None = None
    ) -> ResumeStart:
        check_lease(lease)
        return await self._engine.apply(StartResume(self.scope, run_id, suspension_id, digest, lease, first))

    async def expire_resume_admission(self, run_id: str, suspension_id: int, digest: str) -> ResumeExpiry:
        return await self._engine.apply(ExpireAdmission(self.scope, run_id, suspension_id, digest))

    async def close_resume(self, request: ResumeClosureRequest) -> ResumeClosure:
        """Call it through ResumeCloser: the engine checks evidence, not authority."""
        return await self._engine.apply(CloseResume(self.scope, request))


class ScopedEngine:
    """The original package's stores at one exact scope: reads from the store, writes through the engine."""

    def __init__(self, engine: Engine, scope: Scope) -> None:
        self.engine = engine
        # Checked again here, not trusted from the type: a Scope built with model_construct skips pydantic,
        # and a zero scope must fail before any statement is sent.
        self.scope = require_scope(scope)

    @cached_property
    def runs(self) -> Runs:
        return Runs(self.engine, self.scope)

    @cached_property
    def suspensions(self) -> Suspensions:
        return Suspensions(self.engine, self.scope)

    @cached_property
    def progress(self) -> Snapshots:
        return Snapshots(self.engine, self.scope)

    @cached_property
    def resume(self) -> Resumes:
        return Resumes(self.engine, self.scope)

    @cached_property
    def sessions(self) -> SessionStore:
        return _stores_of(self.engine, self.scope).sessions

    @cached_property
    def ledger(self) -> DemoLedger:
        return _stores_of(self.engine, self.scope).ledger
