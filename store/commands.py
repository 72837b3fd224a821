"""Each command's effect as ONE transaction: the inbox record, validation against the stored pause, the
claim with the worker's lease and the first progress snapshot, and the outbox event.

Consumers (RabbitMQ) and the in-process control (tests, the demo) both apply commands through these
functions, so there is one implementation of every effect. Validation that needs the stored pause (its
reason, its pending calls, its approvers) reads it inside the same transaction, and the claim is pinned to
the version the command names, so what was validated is exactly what is claimed. A refusal raises and
rolls everything back: nothing is half-written, not even the inbox record.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from intermission.schemas.answers import (
    Source,
    check_approver,
    check_authority,
    decision_progress,
    ending_progress,
    reply_progress,
    results_progress,
)
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    StartCommand,
)
from intermission.schemas.errors import (
    IntermissionError,
    InvalidArgument,
    InvalidState,
    NotSuspended,
    ResumeAdmissionNotFound,
    RunConflict,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.resume import ResumeAdmissionRequest
from intermission.schemas.run import Lease, NewRun, Run, RunState
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import (
    ClaimVersion,
    Continuation,
    Ending,
    EndingKind,
    LeasedClaim,
    Progress,
    Suspension,
)
from intermission.store import outbox, rows
from intermission.store.db import Conn, Database
from intermission.store.inbox import AlreadyApplied, Receipt, record_in
from intermission.store.resume import ResumeStore
from intermission.store.runs import create_run_in
from intermission.store.suspensions import SuspensionStore, check_leased_claim, claim_pinned_in


@dataclass(frozen=True)
class Claimed:
    """A run a command claimed for this worker: hand it to the fleet."""

    run: Run
    progress: Progress
    suspension: Suspension | None
    correlation_id: str | None


@dataclass(frozen=True)
class RunDefaults:
    """What a start takes from the settings when its command leaves it out."""

    pause_ttl_seconds: int
    max_steps: int


def new_run(cmd: StartCommand, defaults: RunDefaults) -> NewRun:
    """Resolve a start into the run to create: the config is flattened once, here, and stored; a resume
    never re-merges it."""
    config = cmd.config
    if config.max_steps == 0:
        config = config.model_copy(update={"max_steps": defaults.max_steps})
    return NewRun(
        run_id=cmd.run_id,
        agent_id=cmd.agent_id,
        input=cmd.input,
        config=config,
        script=cmd.script,
        pause_ttl_seconds=defaults.pause_ttl_seconds if cmd.pause_ttl_seconds is None else cmd.pause_ttl_seconds,
        session_id=cmd.session_id or cmd.run_id,
    )


async def _stored_pause(con: Conn, scope: Scope, version: ClaimVersion) -> Suspension:
    row = await con.fetchrow("get_suspension", version.run_id, scope.app, scope.tenant)
    if row is None:
        raise NotSuspended(f"no live pause for run {version.run_id} at scope {scope}")
    suspension = rows.suspension_from_row(row)
    if suspension.id != version.suspension_id:
        raise RunConflict(f"run {version.run_id} is paused on suspension {suspension.id}, not {version.suspension_id}")
    return suspension


async def _claim(
    con: Conn,
    scope: Scope,
    version: ClaimVersion,
    lease: Lease,
    first: Progress,
    correlation_id: str | None,
    *,
    expired_by: datetime | None = None,
    announce: bool = True,
) -> Claimed:
    claim = LeasedClaim(version=version, lease=lease, first=first, expired_by=expired_by)
    check_leased_claim(claim)
    suspension = await claim_pinned_in(con, scope, version, claim, claim.expired_by)
    run = suspension.claimed_run
    assert run is not None
    # The pause is answered: its row goes with the claim, so a running run holds no stale pause for the
    # sweeper to find, and a run that pauses again holds exactly one, the new one.
    await con.execute("delete_run_suspension", run.id)
    if announce:
        event = RunEvent(kind=RunEventKind.RESUMED, run_id=run.id, revision=run.revision, scope=scope)
        await outbox.write(con, outbox.run_event(event, correlation_id))
    progress = first.model_copy(update={"scope": scope})
    return Claimed(run=run, progress=progress, suspension=suspension, correlation_id=correlation_id)


async def _record(con: Conn, receipt: Receipt | None, scope: Scope, run_id: str) -> None:
    if receipt is not None:
        await record_in(con, receipt, scope, run_id)


class CommandStore:
    """Command effects over one pool. ``receipt`` records the delivering message in the inbox, in the
    same transaction; it raises ``AlreadyApplied`` for a message whose effect committed before."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.suspensions = SuspensionStore(db)
        self.admissions = ResumeStore(db)

    async def start(
        self,
        cmd: StartCommand,
        defaults: RunDefaults,
        lease: Lease,
        *,
        receipt: Receipt | None = None,
        correlation_id: str | None = None,
    ) -> Claimed | None:
        """Create the run under this worker's lease with its first snapshot. A repeated identical start is
        a no-op (None); a different start under the same id is RunExists."""
        scope = require_scope(cmd.scope)
        new = new_run(cmd, defaults)
        first = Progress(
            run_id=new.run_id,
            owner=lease.owner,
            continuation=Continuation(config=new.config, session_id=new.session_id),
        )
        async with self.db.transaction() as con:
            await _record(con, receipt, scope, new.run_id)
            created = await create_run_in(con, scope, new, lease, first)
        if not created.fresh:
            return None
        return Claimed(
            run=created.run,
            progress=first.model_copy(update={"scope": scope}),
            suspension=None,
            correlation_id=correlation_id,
        )

    async def resume(
        self,
        cmd: ResumeCommand,
        lease: Lease,
        *,
        receipt: Receipt | None = None,
        correlation_id: str | None = None,
    ) -> Claimed:
        """A host's results for an ``external_tool`` pause.

        The common case takes two round trips (``_resume_at_once``); anything unusual there (a duplicate,
        a refusal, a race, a row that does not decode) falls through to the step-by-step transaction below,
        which decides it exactly as it always has: inbox record first, then the pause, then the claim.
        """
        scope = require_scope(cmd.scope)
        claimed = await self._resume_at_once(scope, cmd, lease, receipt, correlation_id)
        if claimed is not None:
            return claimed
        async with self.db.transaction() as con:
            await _record(con, receipt, scope, cmd.version.run_id)
            suspension = await _stored_pause(con, scope, cmd.version)
            check_authority(Source.HOST, suspension)
            first = results_progress(suspension, cmd.results, lease.owner)
            return await _claim(con, scope, cmd.version, lease, first, correlation_id)

    async def _resume_at_once(
        self,
        scope: Scope,
        cmd: ResumeCommand,
        lease: Lease,
        receipt: Receipt | None,
        correlation_id: str | None,
    ) -> Claimed | None:
        """The resume as one read and ONE writing statement (``claim_resume``), or None when it did not
        apply; then nothing was written and the caller takes the step-by-step path.

        Why it is the same effect as the step-by-step transaction: the read decodes and checks the pause and
        its run BEFORE anything is written (a row that does not decode never gets claimed), and the claim is
        pinned to the suspension id and run revision that were read. A suspension row never changes after
        the transaction that created it, and a run row does not change without its revision changing, so
        what was checked is exactly what is claimed. The claim, the first snapshot, the removal of the
        pause, the inbox record and the outbox event are one statement: they commit together or not at
        all. A recorded message_id fails that statement (no ON CONFLICT), so a duplicate writes nothing and
        the step-by-step path finds it recorded.
        """
        version = cmd.version
        if not lease.is_set:
            return None
        async with self.db.connection() as con:
            row = await con.fetchrow("read_pause_and_run", version.run_id, scope.app, scope.tenant)
            if row is None or row["id"] != version.suspension_id or row["r_revision"] != version.run_revision:
                return None
            try:
                suspension = rows.suspension_from_row(row)
                run = rows.run_from_row(row, prefix="r_")
                check_authority(Source.HOST, suspension)
                first = results_progress(suspension, cmd.results, lease.owner)
                done = rows.dump_list(rows.DONE, first.done)
            except IntermissionError:
                return None
            event = RunEvent(kind=RunEventKind.RESUMED, run_id=run.id, revision=version.run_revision + 1, scope=scope)
            announced = outbox.run_event(event, correlation_id)
            try:
                claimed = await con.fetchrow(
                    "claim_resume",
                    version.run_id,
                    scope.app,
                    scope.tenant,
                    version.suspension_id,
                    version.run_revision,
                    lease.owner,
                    lease.ttl_seconds,
                    done,
                    receipt.message_id if receipt is not None else None,
                    receipt.routing_key if receipt is not None else None,
                    receipt.body_digest if receipt is not None else None,
                    *outbox.columns(announced),
                )
            except asyncpg.UniqueViolationError:
                return None
        if claimed is None:
            return None
        run = run.model_copy(
            update={
                "state": RunState(claimed["state"]),
                "revision": claimed["revision"],
                "lease_owner": claimed["lease_owner"],
                "lease_expires_at": claimed["lease_expires_at"],
                "updated_at": claimed["updated_at"],
            }
        )
        suspension.claimed_run = run
        progress = first.model_copy(update={"scope": scope})
        return Claimed(run=run, progress=progress, suspension=suspension, correlation_id=correlation_id)

    async def decide(
        self,
        cmd: DecideCommand,
        lease: Lease,
        *,
        principal: str | None,
        receipt: Receipt | None = None,
        correlation_id: str | None = None,
    ) -> Claimed:
        """An approval decision. ``principal`` is the broker-validated sender, never the body's word."""
        scope = require_scope(cmd.scope)
        async with self.db.transaction() as con:
            await _record(con, receipt, scope, cmd.version.run_id)
            suspension = await _stored_pause(con, scope, cmd.version)
            check_authority(Source.DECISION, suspension)
            if suspension.checkpoint_id != cmd.checkpoint_id:
                raise RunConflict(f"run {suspension.run_id} waits on checkpoint {suspension.checkpoint_id}")
            check_approver(suspension, principal)
            first = decision_progress(suspension, cmd.decision, cmd.reason, lease.owner)
            claimed = await _claim(con, scope, cmd.version, lease, first, correlation_id)
            state = "approved" if cmd.decision is Decision.APPROVE else "denied"
            decided = await con.fetchval(
                "decide_checkpoint", cmd.checkpoint_id, suspension.run_id, state, principal, cmd.reason
            )
            if decided is None:
                raise InvalidState(f"checkpoint {cmd.checkpoint_id} is not pending")
            return claimed

    async def expire(
        self,
        cmd: ExpireCommand,
        lease: Lease,
        *,
        receipt: Receipt | None = None,
        correlation_id: str | None = None,
    ) -> Claimed:
        """Claim a pause past its deadline (judged against ``expired_by`` AND the database clock) with
        ``ending = expire``; the worker fails the run with a reason naming the deadline."""
        scope = require_scope(cmd.scope)
        async with self.db.transaction() as con:
            await _record(con, receipt, scope, cmd.version.run_id)
            suspension = await _stored_pause(con, scope, cmd.version)
            deadline = suspension.expires_at.isoformat() if suspension.expires_at else "no deadline"
            ending = Ending(
                kind=EndingKind.EXPIRE,
                reason=f"suspension_expired: the {suspension.reason.value} pause passed its deadline "
                f"{deadline} unanswered",
            )
            first = ending_progress(suspension, ending, lease.owner)
            return await _claim(
                con, scope, cmd.version, lease, first, correlation_id, expired_by=cmd.expired_by, announce=False
            )

    async def cancel(
        self,
        cmd: CancelCommand,
        lease: Lease,
        *,
        receipt: Receipt | None = None,
        correlation_id: str | None = None,
    ) -> Claimed:
        """Claim a paused run with ``ending = cancel``; a run that already ended is InvalidState."""
        scope = require_scope(cmd.scope)
        async with self.db.transaction() as con:
            await _record(con, receipt, scope, cmd.run_id)
            run_row = await con.fetchrow("get_run", cmd.run_id, scope.app, scope.tenant)
            if run_row is None:
                raise NotSuspended(f"no run {cmd.run_id} at scope {scope}")
            if RunState(run_row["state"]).is_terminal:
                raise InvalidState(f"run {cmd.run_id} already ended {run_row['state']}")
            row = await con.fetchrow("get_suspension", cmd.run_id, scope.app, scope.tenant)
            if row is None or run_row["state"] != RunState.PAUSED.value:
                raise NotSuspended(f"run {cmd.run_id} is not paused")
            suspension = rows.suspension_from_row(row)
            version = ClaimVersion(run_id=cmd.run_id, suspension_id=suspension.id, run_revision=run_row["revision"])
            first = ending_progress(suspension, Ending(kind=EndingKind.CANCEL, reason=cmd.reason), lease.owner)
            return await _claim(con, scope, version, lease, first, correlation_id, announce=False)

    async def reply(self, cmd: ReplyCommand, lease: Lease, *, correlation_id: str | None = None) -> Claimed | None:
        """The messaging bus's reply to an ``agent_reply`` pause (the caller has checked that the sender IS
        the bus). Admit (claim the pause, keep the input bytes exactly, take the lease, write the first
        snapshot, announce run.resumed), then start (the single grant of execution).

        A redelivered reply is the identical admission request: it gets the stored admission back and the
        start is granted at most once, so a reply interrupted between admit and start is finished by its
        redelivery, and one that started is not run again (None). The admission is the reply's idempotency
        record: a different reply for the same pause is resume_admission_conflict.
        """
        scope = require_scope(cmd.scope)
        try:
            suspension = await self.suspensions.get_suspension(scope, cmd.version.run_id)
            if suspension.id != cmd.version.suspension_id:
                raise RunConflict(f"run {cmd.version.run_id} is paused on suspension {suspension.id}")
        except (NotSuspended, RunConflict):
            # The run may have left this pause BECAUSE this very reply was admitted: then this is a
            # redelivery or a re-send, acknowledged with no second effect and no refusal.
            await self._raise_if_admitted(scope, cmd, correlation_id)
            raise
        check_authority(Source.BUS, suspension)
        first = reply_progress(suspension, cmd.reply_with, cmd.input, lease.owner)
        request = ResumeAdmissionRequest(scope=scope, version=cmd.version, input=cmd.input.encode("utf-8"))
        admission = await self.admissions.admit_resume_leased(
            scope, request, lease, first, correlation_id=correlation_id
        )
        started = await self.admissions.start_resume_leased(
            scope, cmd.version.run_id, cmd.version.suspension_id, admission.request_digest, lease, first
        )
        if not started.fresh or started.suspension is None or started.suspension.claimed_run is None:
            return None
        return Claimed(
            run=started.suspension.claimed_run,
            progress=first.model_copy(update={"scope": scope}),
            suspension=started.suspension,
            correlation_id=correlation_id,
        )

    async def _raise_if_admitted(self, scope: Scope, cmd: ReplyCommand, correlation_id: str | None) -> None:
        """AlreadyApplied when the identical reply was admitted for its pause before: the admission is a
        reply's idempotency record. Otherwise return, and the caller's refusal stands."""
        version = cmd.version
        try:
            admission = await self.admissions.get_resume_admission(scope, version.run_id, version.suspension_id)
        except (ResumeAdmissionNotFound, InvalidArgument):
            return
        request = ResumeAdmissionRequest(scope=scope, version=version, input=cmd.input.encode("utf-8"))
        if admission.request_digest == request.digest():
            raise AlreadyApplied(correlation_id or f"reply to {version.run_id}", "admitted")
