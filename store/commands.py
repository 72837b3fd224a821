"""Each command's effect as ONE transition: the inbox record, the claim with the worker's lease and the
first progress snapshot, and the outbox event.

Consumers (RabbitMQ) and the in-process control of the tests both apply commands through these methods,
so there is one implementation of every effect. A command names its own scope (its body's, which the
consumer checked), so the command store is not bound to one.

A command that answers a pause takes two round trips. The first reads, at the command's exact scope, the
run, its live pause and what the inbox holds for the command's message_id (a key within that scope); the
command is checked against that pause (who may answer it, whether the answers fit). The second is the
transition (``intermission_claim_pause_v1`` with the command's parts), pinned to the pause and revision
that were read: a pause row never changes after the transaction that wrote it, and a run row does not
change without its revision changing, so what was checked is exactly what is claimed. A refusal at either
step writes nothing, not even the inbox record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

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
    InvalidArgument,
    InvalidState,
    MessageIdConflict,
    NotSuspended,
    ResumeAdmissionNotFound,
    RunConflict,
    TransientError,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.resume import ResumeAdmissionRequest
from intermission.schemas.run import Lease, NewRun, Run, RunState
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import ClaimVersion, Continuation, Ending, EndingKind, Progress, Suspension
from intermission.store import outbox, rows
from intermission.store.db import Conn, Database
from intermission.store.inbox import AlreadyApplied, Receipt, inbox_arguments
from intermission.store.resume import ResumeStore
from intermission.store.runs import check_lease, start_in
from intermission.store.suspensions import Decided, claim_arguments, refusal


@dataclass(frozen=True)
class Claimed:
    """A run a command claimed for this worker: hand it to the fleet."""

    run: Run
    progress: Progress
    suspension: Suspension | None
    correlation_id: str | None


# How often a cancel reads a run again because it moved between the read and the write. Each retry means
# the run really changed (claimed, paused again); a run that changes this often gets a TransientError, and
# the command is retried with backoff.
CANCEL_ATTEMPTS = 8

# The settings' default of budget.max_tool_calls (INTERMISSION_MAX_TOOL_CALLS, fleet/settings.py).
DEFAULT_MAX_TOOL_CALLS = 256


@dataclass(frozen=True)
class RunDefaults:
    """What a start takes from the settings when its command leaves it out."""

    pause_ttl_seconds: int
    max_steps: int
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS


def new_run(cmd: StartCommand, defaults: RunDefaults) -> NewRun:
    """Resolve a start into the run to create: the config is flattened once, here, and stored; a resume
    never re-merges it. So a run's limits are the ones it started with, whichever worker continues it."""
    config = cmd.config
    if config.max_steps == 0:
        config = config.model_copy(update={"max_steps": defaults.max_steps})
    if config.budget.max_tool_calls == 0:
        budget = config.budget.model_copy(update={"max_tool_calls": defaults.max_tool_calls})
        config = config.model_copy(update={"budget": budget})
    return NewRun(
        run_id=cmd.run_id,
        agent_id=cmd.agent_id,
        input=cmd.input,
        config=config,
        script=cmd.script,
        pause_ttl_seconds=defaults.pause_ttl_seconds if cmd.pause_ttl_seconds is None else cmd.pause_ttl_seconds,
        session_id=cmd.session_id or cmd.run_id,
    )


@dataclass(frozen=True)
class Stored:
    """The run and its live pause as the command's first read found them (None where absent), and the
    state of the checkpoint a decision names (None when it names none of this run's)."""

    run: Run | None
    pause: Suspension | None
    checkpoint_state: str | None = None

    def pause_pinned(self, scope: Scope, version: ClaimVersion) -> Suspension:
        """The live pause ``version`` names, or why there is none to answer."""
        if self.pause is None:
            raise NotSuspended(f"no live pause for run {version.run_id} at scope {scope}")
        if self.pause.id != version.suspension_id:
            raise RunConflict(
                f"run {version.run_id} is paused on suspension {self.pause.id}, not {version.suspension_id}"
            )
        return self.pause


@dataclass(frozen=True)
class Answer:
    """What a checked command asks of the answer transition."""

    version: ClaimVersion
    first: Progress
    suspension: Suspension
    # The sweep's claim: only a pause whose deadline passed by this.
    expired_by: datetime | None = None
    # An approval decision to record on the pause's checkpoint.
    decision: Decided | None = None
    # Whether the claim announces run.resumed (a cancel's and an expiry's claims end the run instead).
    announce: bool = True


class CommandStore:
    """Command effects over one pool. ``receipt`` records the delivering message in the inbox, in the
    same transition; it raises ``AlreadyApplied`` for a message whose effect committed before."""

    def __init__(self, db: Database) -> None:
        self.db = db

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
        async with self.db.connection() as con:
            created = await start_in(con, scope, new, lease, first, receipt)
        if not created.fresh:
            return None
        return Claimed(
            run=created.run,
            progress=first.model_copy(update={"scope": scope}),
            suspension=None,
            correlation_id=correlation_id,
        )

    async def resume(
        self, cmd: ResumeCommand, lease: Lease, *, receipt: Receipt | None = None, correlation_id: str | None = None
    ) -> Claimed:
        """A host's results for an ``external_tool`` pause."""

        def check(scope: Scope, stored: Stored) -> Answer:
            pause = stored.pause_pinned(scope, cmd.version)
            check_authority(Source.HOST, pause)
            return Answer(cmd.version, results_progress(pause, cmd.results, lease.owner), pause)

        return await self._answer(cmd.scope, cmd.version.run_id, lease, receipt, correlation_id, check)

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

        def check(scope: Scope, stored: Stored) -> Answer:
            if stored.checkpoint_state not in (None, "pending"):
                # The original: a decision on a checkpoint that is no longer pending is invalid_state, even
                # though its pause is gone by now (which alone would read as not_suspended).
                raise InvalidState(f"checkpoint {cmd.checkpoint_id} is no longer pending: {stored.checkpoint_state}")
            pause = stored.pause_pinned(scope, cmd.version)
            check_authority(Source.DECISION, pause)
            if pause.checkpoint_id != cmd.checkpoint_id:
                raise RunConflict(f"run {pause.run_id} waits on checkpoint {pause.checkpoint_id}")
            check_approver(pause, principal)
            state = "approved" if cmd.decision is Decision.APPROVE else "denied"
            return Answer(
                cmd.version,
                decision_progress(pause, cmd.decision, cmd.reason, lease.owner),
                pause,
                decision=Decided(cmd.checkpoint_id, state, principal, cmd.reason),
            )

        return await self._answer(
            cmd.scope, cmd.version.run_id, lease, receipt, correlation_id, check, checkpoint_id=cmd.checkpoint_id
        )

    async def expire(
        self, cmd: ExpireCommand, lease: Lease, *, receipt: Receipt | None = None, correlation_id: str | None = None
    ) -> Claimed:
        """Claim a pause past its deadline (judged against ``expired_by`` AND the database clock) with
        ``ending = expire``; the worker fails the run with a reason naming the deadline."""

        def check(scope: Scope, stored: Stored) -> Answer:
            pause = stored.pause_pinned(scope, cmd.version)
            deadline = pause.expires_at.isoformat() if pause.expires_at else "no deadline"
            ending = Ending(
                kind=EndingKind.EXPIRE,
                reason=f"suspension_expired: the {pause.reason.value} pause passed its deadline {deadline} unanswered",
            )
            first = ending_progress(pause, ending, lease.owner)
            return Answer(cmd.version, first, pause, expired_by=cmd.expired_by, announce=False)

        return await self._answer(cmd.scope, cmd.version.run_id, lease, receipt, correlation_id, check)

    async def cancel(
        self, cmd: CancelCommand, lease: Lease, *, receipt: Receipt | None = None, correlation_id: str | None = None
    ) -> Claimed | None:
        """End a run as cancelled; a run that already ended is InvalidState.

        A PAUSED run is claimed with ``ending = cancel`` and handed to this worker, which ends it. A RUNNING
        run held under a lease (live, or lapsed with its worker dead) is asked to end: the request is kept
        on its row (``intermission_request_ending_v1``) and nothing is handed over (None): its holder ends it
        cancelled at its next boundary, or whoever takes it over does. A run running under the original's
        plain claim holds no lease and nobody here could end it: NotSuspended, and nothing is touched
        (scenario 31).

        The read and the write are two round trips, and the run may move between them (resumed and paused
        again on a new pause, or claimed, or paused): the cancel then reads again and acts on what it finds
        now, so a run that merely moved on is never refused (run_conflict, not_suspended). It gives up with
        a TransientError (retried) only if the run changed under it every time.
        """
        scope = require_scope(cmd.scope)
        check_lease(lease)
        ending = Ending(kind=EndingKind.CANCEL, reason=cmd.reason)
        for _ in range(CANCEL_ATTEMPTS):
            async with self.db.connection() as con:
                stored = await self._read(con, scope, cmd.run_id, receipt)
                run = stored.run
                if run is None:
                    raise NotSuspended(f"no run {cmd.run_id} at scope {scope}")
                if run.state.is_terminal:
                    raise InvalidState(f"run {cmd.run_id} already ended {run.state.value}")
                if run.state is RunState.RUNNING:
                    requested = await con.fetchrow(
                        "request_ending",
                        run_id=cmd.run_id,
                        app=scope.app,
                        tenant=scope.tenant,
                        ending=rows.dump(ending),
                        **inbox_arguments(receipt, scope),
                    )
                    assert requested is not None  # the function always returns its one row
                    outcome = requested["outcome"]
                    if receipt is not None:
                        receipt.refuse(outcome)
                    if outcome in ("requested", "ending_before"):
                        return None
                    if outcome == "not_leased":
                        raise NotSuspended(
                            f"run {cmd.run_id} runs under a claim without a lease: only its claimer can end it"
                        )
                    continue  # not running any more: it paused or ended meanwhile
                if stored.pause is None or run.state is not RunState.PAUSED:
                    raise NotSuspended(f"run {cmd.run_id} is neither paused nor running")
                version = ClaimVersion(run_id=cmd.run_id, suspension_id=stored.pause.id, run_revision=run.revision)
                first = ending_progress(stored.pause, ending, lease.owner)
                answer = Answer(version, first, stored.pause, announce=False)
                try:
                    return await self._claim(con, scope, cmd.run_id, lease, receipt, correlation_id, stored, answer)
                except (RunConflict, NotSuspended):
                    continue  # resumed (and perhaps paused again) between the read and the claim
        raise TransientError(f"run {cmd.run_id} changed under the cancel {CANCEL_ATTEMPTS} times; try again")

    async def _answer(
        self,
        scope: Scope,
        run_id: str,
        lease: Lease,
        receipt: Receipt | None,
        correlation_id: str | None,
        check: Callable[[Scope, Stored], Answer],
        *,
        checkpoint_id: int | None = None,
    ) -> Claimed:
        scope = require_scope(scope)
        check_lease(lease)
        async with self.db.connection() as con:
            stored = await self._read(con, scope, run_id, receipt, checkpoint_id)
            return await self._claim(con, scope, run_id, lease, receipt, correlation_id, stored, check(scope, stored))

    @staticmethod
    async def _read(
        con: Conn, scope: Scope, run_id: str, receipt: Receipt | None, checkpoint_id: int | None = None
    ) -> Stored:
        """The command's first round trip: the run, its pause, the inbox (a recorded message_id is
        AlreadyApplied or MessageIdConflict here) and the named checkpoint's state."""
        row = await con.fetchrow(
            "read_for_command",
            run_id,
            scope.app,
            scope.tenant,
            inbox_arguments(receipt, scope)["message_id"],
            checkpoint_id,
        )
        assert row is not None  # the read always returns its one row
        if receipt is not None:
            receipt.check_recorded(row["i_routing_key"], row["i_body_digest"], row["i_outcome"])
        return Stored(
            run=rows.run_from_row(row["run"]) if row["run"] is not None else None,
            pause=rows.suspension_from_row(row["pause"]) if row["pause"] is not None else None,
            checkpoint_state=row["k_state"],
        )

    @staticmethod
    async def _claim(
        con: Conn,
        scope: Scope,
        run_id: str,
        lease: Lease,
        receipt: Receipt | None,
        correlation_id: str | None,
        stored: Stored,
        answer: Answer,
    ) -> Claimed:
        """The command's transition: the claim pinned to what was read and checked, with everything that
        commits with it."""
        version = answer.version
        event = (
            outbox.run_event(
                RunEvent(kind=RunEventKind.RESUMED, run_id=run_id, revision=version.run_revision + 1, scope=scope),
                correlation_id,
            )
            if answer.announce
            else None
        )
        result = await con.fetchrow(
            "claim_pause",
            **claim_arguments(
                scope,
                run_id,
                version=version,
                expired_by=answer.expired_by,
                lease=lease,
                first=answer.first,
                answers_only=True,
                drop_pause=True,
                receipt=receipt,
                decision=answer.decision,
                event=event,
            ),
        )
        assert result is not None
        outcome = result["outcome"]
        if receipt is not None:
            receipt.refuse(outcome)
        if outcome != "claimed":
            raise refusal(outcome, result, scope, run_id, version=version, expired_by=answer.expired_by)
        assert stored.run is not None  # claimed, so it was read
        run = stored.run.model_copy(
            update={
                "state": RunState.RUNNING,
                "revision": result["r_revision"],
                "lease_owner": result["r_lease_owner"],
                "lease_expires_at": result["r_lease_expires_at"],
                "updated_at": result["r_updated_at"],
            }
        )
        progress = answer.first.model_copy(update={"scope": scope, "updated_at": result["first_updated_at"]})
        return Claimed(run=run, progress=progress, suspension=answer.suspension, correlation_id=correlation_id)

    async def reply(
        self, cmd: ReplyCommand, lease: Lease, *, receipt: Receipt | None = None, correlation_id: str | None = None
    ) -> Claimed | None:
        """The messaging bus's reply to an ``agent_reply`` pause (the caller has checked that the sender IS
        the bus). Admit (claim the pause, keep the input bytes exactly, take the lease, write the first
        snapshot, announce run.resumed), then start (the single grant of execution).

        A redelivered reply is the identical admission request: it gets the stored admission back and the
        start is granted at most once, so a reply interrupted between admit and start is finished by its
        redelivery, and one that started is not run again (None). The admission is the reply's idempotency
        record: a different reply for the same pause is resume_admission_conflict. Its ``receipt`` is
        recorded in the inbox with the admission too, so that its message_id can never stand for another
        command: a message_id recorded for a different body is message_id_conflict, whatever the pause.
        """
        scope = require_scope(cmd.scope)
        if receipt is not None:
            await self._refuse_reused_message_id(receipt, scope)
        evidence = ResumeStore(self.db, scope)
        request = ResumeAdmissionRequest(scope=scope, version=cmd.version, input=cmd.input.encode("utf-8"))
        try:
            suspension = await evidence.pause_for(cmd.version)
        except (NotSuspended, RunConflict):
            # The run may have left this pause BECAUSE this very reply was admitted: then this is a
            # redelivery or a re-send, acknowledged with no second effect and no refusal.
            await self._raise_if_admitted(evidence, request, correlation_id)
            raise
        check_authority(Source.BUS, suspension)
        first = reply_progress(suspension, cmd.reply_with, cmd.input, lease.owner)
        admission = await evidence.admit_resume_leased(
            request, lease, first, correlation_id=correlation_id, pause=suspension, receipt=receipt
        )
        started = await evidence.start_resume_leased(
            cmd.version.run_id, cmd.version.suspension_id, admission.request_digest, lease, first
        )
        if not started.fresh or started.suspension is None or started.run is None:
            return None
        return Claimed(
            run=started.run,
            progress=first.model_copy(update={"scope": scope}),
            suspension=started.suspension,
            correlation_id=correlation_id,
        )

    async def _refuse_reused_message_id(self, receipt: Receipt, scope: Scope) -> None:
        """MessageIdConflict when ``receipt``'s message_id is recorded at ``scope`` for a different command.
        Recorded for this very command it is no refusal here: a reply's redelivery goes on to its admission,
        which it finds, and to the start its first delivery may not have reached."""
        message_id = receipt.arguments(scope)["message_id"]
        async with self.db.connection() as con:
            row = await con.fetchrow("recorded_command", scope.app, scope.tenant, message_id)
        if row is not None and (row["body_digest"], row["routing_key"]) != (receipt.body_digest, receipt.routing_key):
            raise MessageIdConflict(f"message_id {receipt.message_id} was used for a different command")

    @staticmethod
    async def _raise_if_admitted(
        evidence: ResumeStore, request: ResumeAdmissionRequest, correlation_id: str | None
    ) -> None:
        """AlreadyApplied when the identical reply was admitted for its pause before: the admission is a
        reply's idempotency record. Otherwise return, and the caller's refusal stands."""
        version = request.version
        try:
            admission = await evidence.get_resume_admission(version.run_id, version.suspension_id)
        except (ResumeAdmissionNotFound, InvalidArgument):
            return
        if admission.request_digest == request.digest():
            raise AlreadyApplied(correlation_id or f"reply to {version.run_id}", "admitted")
