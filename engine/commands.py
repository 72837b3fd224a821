"""Each command's effect: what a ``run.start``, ``run.resume``, ``run.decide``, ``run.expire``, ``run.cancel``
or ``run.reply`` does, given its parsed body, its inbox receipt and who sent it.

Consumers (RabbitMQ) and the in-process control of the tests apply commands through these operations, so
there is one implementation of every effect. A command names its own scope (its body's, checked once by its
model and against its routing key by the consumer). The worker's lease is taken at claim time, from the
engine's terms (``Steps.lease``), never by whoever parsed the command.

A command that answers a pause takes two statements, each group committed with whatever else waits. The
first reads, at the command's exact scope, the run, its live pause and what the inbox holds for the
command's message_id (``ReadForCommand``); the command is checked against that pause (who may answer it,
whether the answers fit: ``schemas/answers.py``). The second is the claim (``ClaimPause``) with the
command's parts, pinned to the pause and revision that were read: a pause row never changes after the
transaction that wrote it, and a run row does not change without its revision changing, so what was
checked is exactly what is claimed. A refusal at either step writes nothing, not even the inbox record.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import KW_ONLY, dataclass
from datetime import datetime
from typing import Generic, Protocol, TypeVar

from intermission.engine.claims import ClaimPause, Decided, ReadForCommand, Stored, check_lease
from intermission.engine.events import OutboxEvent, run_event
from intermission.engine.replies import AdmitResume, ReadEvidence, StartResume
from intermission.engine.runs import RequestEnding
from intermission.engine.starts import StartRun, resolved_config
from intermission.engine.transition import Operation, Steps
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
    InvalidState,
    MessageIdConflict,
    NotSuspended,
    ResumeAdmissionConflict,
    RunConflict,
    TransientError,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.resume import ResumeAdmissionRequest
from intermission.schemas.run import Lease, NewRun, Run, RunState
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import ClaimVersion, Continuation, Ending, EndingKind, Progress, Suspension
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.tracing import current_traceparent


@dataclass(frozen=True)
class Claimed:
    """A run a command claimed for this worker: hand it to the fleet."""

    run: Run
    progress: Progress
    suspension: Suspension | None
    correlation_id: str | None


class StaleExpiry(Exception):
    """An expiry that lost to a resume (or to another sweeper): acknowledge it, nothing to do. Not a refusal
    of anybody's request: the sweeper lost a race it is expected to lose sometimes."""


def new_run(cmd: StartCommand, steps: Steps) -> NewRun:
    """A start resolved into the run to create, its config flattened once against the fleet's defaults."""
    defaults = steps.defaults
    return NewRun(
        run_id=cmd.run_id,
        agent_id=cmd.agent_id,
        input=cmd.input,
        config=resolved_config(cmd.config, defaults),
        script=cmd.script,
        pause_ttl_seconds=defaults.pause_ttl_seconds if cmd.pause_ttl_seconds is None else cmd.pause_ttl_seconds,
        session_id=cmd.session_id or cmd.run_id,
    )


@dataclass(frozen=True)
class Start(Operation[Claimed | None]):
    """``run.start``: create the run under this worker's lease with its first snapshot. A repeated identical
    start is a no-op (None); a different start under the same id in the same scope is RunExists."""

    command: StartCommand
    receipt: Receipt | None = None
    correlation_id: str | None = None

    async def apply_in(self, steps: Steps) -> Claimed | None:
        scope = require_scope(self.command.scope)
        new, lease = new_run(self.command, steps), steps.lease
        first = Progress(
            run_id=new.run_id,
            owner=lease.owner,
            # The run's trace begins with the start command's span (intermission/tracing.py).
            continuation=Continuation(config=new.config, session_id=new.session_id, traceparent=current_traceparent()),
        )
        created = await steps.commit(StartRun(scope, new, lease, first, self.receipt, steps.defaults.quota))
        if not created.fresh:
            return None
        return Claimed(created.run, first.model_copy(update={"scope": scope}), None, self.correlation_id)


@dataclass(frozen=True)
class Answer:
    """What a checked command asks of its claim."""

    version: ClaimVersion
    first: Progress
    suspension: Suspension
    # The sweep's claim: only a pause whose deadline passed by this.
    expired_by: datetime | None = None
    # An approval decision to record on the pause's checkpoint.
    decision: Decided | None = None
    # Whether the claim announces run.resumed (a cancel's and an expiry's claims end the run instead).
    announce: bool = True


def resumed_event(scope: Scope, answer: Answer, correlation_id: str | None) -> OutboxEvent | None:
    """The run.resumed a claim announces (its revision is known: the claim is pinned to the one before), in
    the run's trace as its pause recorded it (a pause that recorded none: the command's)."""
    if not answer.announce:
        return None
    version = answer.version
    resumed = RunEvent(kind=RunEventKind.RESUMED, run_id=version.run_id, revision=version.run_revision + 1, scope=scope)
    recorded = answer.suspension.continuation.traceparent
    return run_event(resumed, correlation_id, traceparent=recorded or current_traceparent())


async def claim_answer(
    steps: Steps,
    scope: Scope,
    stored: Stored,
    answer: Answer,
    lease: Lease,
    receipt: Receipt | None,
    correlation_id: str | None,
) -> Claimed:
    """The claim of a checked command, pinned to what was read, with everything that commits with it."""
    out = await steps.commit(
        ClaimPause(
            scope,
            answer.version.run_id,
            version=answer.version,
            expired_by=answer.expired_by,
            lease=lease,
            first=answer.first,
            answers_only=True,
            drop_pause=True,
            receipt=receipt,
            decision=answer.decision,
            event=resumed_event(scope, answer, correlation_id),
        )
    )
    assert stored.run is not None  # claimed, so it was read
    run = stored.run.model_copy(
        update={
            "state": RunState.RUNNING,
            "revision": out["revision"],
            "lease_owner": out["lease_owner"],
            "lease_expires_at": out["lease_expires_at"],
            "updated_at": out["updated_at"],
        }
    )
    progress = answer.first.model_copy(update={"scope": scope, "updated_at": out["first_updated_at"]})
    return Claimed(run=run, progress=progress, suspension=answer.suspension, correlation_id=correlation_id)


class PinnedCommand(Protocol):
    """A command that answers one pause, pinned to it and to the run's revision (``ClaimVersion``)."""

    @property
    def scope(self) -> Scope: ...

    @property
    def version(self) -> ClaimVersion: ...


P = TypeVar("P", bound=PinnedCommand)


@dataclass(frozen=True)
class _Answering(Operation[Claimed], Generic[P]):
    """A command that answers a pause: read, check, claim (see the module docstring)."""

    command: P
    _: KW_ONLY
    receipt: Receipt | None = None
    correlation_id: str | None = None

    @property
    def scope(self) -> Scope:
        return self.command.scope

    @property
    def run_id(self) -> str:
        return self.command.version.run_id

    @property
    def checkpoint_id(self) -> int | None:
        return None

    @abstractmethod
    def check(self, stored: Stored, lease: Lease) -> Answer:
        """The claim the command asks for, or its refusal raised, given what its read found."""

    async def apply_in(self, steps: Steps) -> Claimed:
        scope, lease = require_scope(self.scope), steps.lease
        check_lease(lease)
        message_id = self.receipt.arguments(scope)["message_id"] if self.receipt is not None else None
        stored = await steps.commit(ReadForCommand(scope, self.run_id, message_id, self.checkpoint_id))
        stored.check_receipt(self.receipt)
        answer = self.check(stored, lease)
        return await claim_answer(steps, scope, stored, answer, lease, self.receipt, self.correlation_id)


@dataclass(frozen=True)
class Resume(_Answering[ResumeCommand]):
    """``run.resume``: a host's results for an ``external_tool`` pause."""

    def check(self, stored: Stored, lease: Lease) -> Answer:
        pause = stored.pause_pinned(self.scope, self.command.version)
        check_authority(Source.HOST, pause)
        return Answer(self.command.version, results_progress(pause, self.command.results, lease.owner), pause)


@dataclass(frozen=True)
class Decide(_Answering[DecideCommand]):
    """``run.decide``: an approval decision. ``principal`` is the broker-validated sender, never the body's
    word."""

    principal: str | None = None

    @property
    def checkpoint_id(self) -> int | None:
        return self.command.checkpoint_id

    def check(self, stored: Stored, lease: Lease) -> Answer:
        cmd = self.command
        if stored.checkpoint_state not in (None, "pending"):
            # The original: a decision on a checkpoint that is no longer pending is invalid_state, even though
            # its pause is gone by now (which alone would read as not_suspended).
            raise InvalidState(f"checkpoint {cmd.checkpoint_id} is no longer pending: {stored.checkpoint_state}")
        pause = stored.pause_pinned(self.scope, cmd.version)
        check_authority(Source.DECISION, pause)
        if pause.checkpoint_id != cmd.checkpoint_id:
            raise RunConflict(f"run {pause.run_id} waits on checkpoint {pause.checkpoint_id}")
        check_approver(pause, self.principal)
        state = "approved" if cmd.decision is Decision.APPROVE else "denied"
        return Answer(
            cmd.version,
            decision_progress(pause, cmd.decision, cmd.reason, lease.owner),
            pause,
            decision=Decided(cmd.checkpoint_id, state, self.principal, cmd.reason),
        )


@dataclass(frozen=True)
class Expire(_Answering[ExpireCommand]):
    """``run.expire``: claim a pause past its deadline (judged against ``expired_by`` AND the database clock)
    with ``ending = expire``; the worker fails the run with a reason naming the deadline. A pause answered,
    cancelled or expired already is a StaleExpiry."""

    def check(self, stored: Stored, lease: Lease) -> Answer:
        pause = stored.pause_pinned(self.scope, self.command.version)
        deadline = pause.expires_at.isoformat() if pause.expires_at else "no deadline"
        ending = Ending(
            kind=EndingKind.EXPIRE,
            reason=f"suspension_expired: the {pause.reason.value} pause passed its deadline {deadline} unanswered",
        )
        first = ending_progress(pause, ending, lease.owner)
        return Answer(self.command.version, first, pause, expired_by=self.command.expired_by, announce=False)

    async def apply_in(self, steps: Steps) -> Claimed:
        try:
            return await super().apply_in(steps)
        except (NotSuspended, RunConflict) as exc:
            raise StaleExpiry(exc.detail) from exc


# How often a cancel reads a run again because it moved between the read and the write. Each retry means the
# run really changed (claimed, paused again); a run that changes this often gets a TransientError, and the
# command is retried with backoff.
CANCEL_ATTEMPTS = 8


@dataclass(frozen=True)
class Cancel(Operation[Claimed | None]):
    """``run.cancel``: end a run as cancelled; a run that already ended is InvalidState.

    A PAUSED run is claimed with ``ending = cancel`` and handed to this worker, which ends it. A RUNNING run
    held under a lease (live, or lapsed with its worker dead) is asked to end: the request is kept on its row
    (``RequestEnding``) and nothing is handed over (None): its holder ends it cancelled at its next boundary,
    or whoever takes it over does. A run running under the original's plain claim holds no lease and nobody
    here could end it: NotSuspended, and nothing is touched (scenario 31).

    The read and the write are two statements, and the run may move between them (resumed and paused again
    on a new pause, or claimed, or paused): the cancel then reads again and acts on what it finds now, so a
    run that merely moved on is never refused (run_conflict, not_suspended). It gives up with a
    TransientError (retried) only if the run changed under it every time."""

    command: CancelCommand
    receipt: Receipt | None = None
    correlation_id: str | None = None

    async def apply_in(self, steps: Steps) -> Claimed | None:
        cmd, lease = self.command, steps.lease
        scope = require_scope(cmd.scope)
        check_lease(lease)
        ending = Ending(kind=EndingKind.CANCEL, reason=cmd.reason)
        message_id = self.receipt.arguments(scope)["message_id"] if self.receipt is not None else None
        for _ in range(CANCEL_ATTEMPTS):
            stored = await steps.commit(ReadForCommand(scope, cmd.run_id, message_id))
            stored.check_receipt(self.receipt)
            run = stored.run
            if run is None:
                raise NotSuspended(f"no run {cmd.run_id} at scope {scope}")
            if run.state.is_terminal:
                raise InvalidState(f"run {cmd.run_id} already ended {run.state.value}")
            if run.state is RunState.RUNNING:
                outcome = await steps.commit(RequestEnding(scope, cmd.run_id, ending, self.receipt))
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
            answer = Answer(version, ending_progress(stored.pause, ending, lease.owner), stored.pause, announce=False)
            try:
                return await claim_answer(steps, scope, stored, answer, lease, self.receipt, self.correlation_id)
            except (RunConflict, NotSuspended):
                continue  # resumed (and perhaps paused again) between the read and the claim
        raise TransientError(f"run {cmd.run_id} changed under the cancel {CANCEL_ATTEMPTS} times; try again")


@dataclass(frozen=True)
class Reply(Operation[Claimed | None]):
    """``run.reply``: the messaging bus's reply to an ``agent_reply`` pause (the caller has checked that the
    sender IS the bus). Admit (claim the pause, keep the input bytes exactly, take the lease, write the first
    snapshot, announce run.resumed), then start (the single grant of execution).

    A redelivered reply is the identical admission request: it gets the stored admission back and the start
    is granted at most once, so a reply interrupted between admit and start is finished by its redelivery,
    and one that started is not run again (None). The admission is the reply's idempotency record: a
    different reply for the same pause is resume_admission_conflict. Its ``receipt`` is recorded in the inbox
    with the admission too, so that its message_id can never stand for another command: a message_id
    recorded for a different body is message_id_conflict, whatever the pause."""

    command: ReplyCommand
    receipt: Receipt | None = None
    correlation_id: str | None = None

    async def apply_in(self, steps: Steps) -> Claimed | None:
        cmd, lease = self.command, steps.lease
        scope = require_scope(cmd.scope)
        check_lease(lease)
        version = cmd.version
        request = ResumeAdmissionRequest(scope=scope, version=version, input=cmd.input.encode("utf-8"))
        stored = await self._read(steps, scope, version.run_id)
        try:
            pause = stored.pause_pinned(scope, version)
        except (NotSuspended, RunConflict):
            # The run may have left this pause BECAUSE this very reply was admitted: then this is a redelivery
            # or a re-send, acknowledged with no second effect and no refusal.
            await self._raise_if_admitted(steps, request)
            raise
        check_authority(Source.BUS, pause)
        first = reply_progress(pause, cmd.reply_with, cmd.input, lease.owner)
        try:
            admission = await steps.commit(
                AdmitResume(request, pause, lease, first, correlation_id=self.correlation_id, receipt=self.receipt)
            )
        except ResumeAdmissionConflict:
            # The admission function checks the inbox, then looks for an admission: a rival that reused this
            # message_id with another body can commit both between those two reads. Its inbox record commits
            # with its admission, so it is visible now: the message_id is what was reused.
            await self._read(steps, scope, version.run_id)
            raise
        started = await steps.commit(
            StartResume(scope, version.run_id, version.suspension_id, admission.request_digest, lease, first)
        )
        if not started.fresh or started.suspension is None or started.run is None:
            return None
        return Claimed(started.run, first.model_copy(update={"scope": scope}), started.suspension, self.correlation_id)

    async def _read(self, steps: Steps, scope: Scope, run_id: str) -> Stored:
        """The run and its pause, and what the inbox recorded for the reply's message_id: MessageIdConflict
        when it recorded a different command. Recorded for this very command it is no refusal here: a
        reply's redelivery goes on to its admission, which it finds, and to the start its first delivery
        may not have reached."""
        message_id = self.receipt.arguments(scope)["message_id"] if self.receipt is not None else None
        stored = await steps.commit(ReadForCommand(scope, run_id, message_id))
        recorded, receipt = stored.recorded, self.receipt
        if (
            receipt is not None
            and recorded is not None
            and (recorded.body_digest, recorded.routing_key) != (receipt.body_digest, receipt.routing_key)
        ):
            raise MessageIdConflict(f"message_id {receipt.message_id} was used for a different command")
        return stored

    async def _raise_if_admitted(self, steps: Steps, request: ResumeAdmissionRequest) -> None:
        """AlreadyApplied when the identical reply was admitted for its pause before: the admission is a
        reply's idempotency record. Otherwise return, and the caller's refusal stands."""
        version = request.version
        evidence = await steps.commit(ReadEvidence(request.scope, version.run_id, version.suspension_id))
        if evidence.admission is not None and evidence.admission.request_digest == request.digest():
            raise AlreadyApplied(self.correlation_id or f"reply to {version.run_id}", "admitted")
