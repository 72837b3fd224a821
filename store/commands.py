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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

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
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import (
    InvalidArgument,
    InvalidState,
    LimitExceeded,
    MessageIdConflict,
    NotSuspended,
    ResumeAdmissionConflict,
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
from intermission.store.queries import QUERIES
from intermission.store.resume import ResumeStore
from intermission.store.runs import NO_QUOTA, Quota, check_lease, start_in
from intermission.store.suspensions import Decided, claim_arguments, refusal
from intermission.tracing import current_traceparent


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
    """What a start takes from the settings when its command leaves it out, the most it may ask for (0: no
    ceiling), and the quotas of a scope that has none of its own."""

    pause_ttl_seconds: int
    max_steps: int
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS
    max_steps_limit: int = 0
    max_tool_calls_limit: int = 0
    max_total_tokens_limit: int = 0
    max_tokens_limit: int = 0
    quota: Quota = NO_QUOTA


def _check_ceilings(config: RunConfig, defaults: RunDefaults) -> None:
    """LimitExceeded when a start asks for more than the fleet allows a run. Refused rather than clamped: a
    clamped run would fail at the smaller limit hours later, far from the start that caused it."""
    for field, asked, ceiling in (
        ("max_steps", config.max_steps, defaults.max_steps_limit),
        ("budget.max_tool_calls", config.budget.max_tool_calls, defaults.max_tool_calls_limit),
        ("budget.max_total_tokens", config.budget.max_total_tokens, defaults.max_total_tokens_limit),
        ("max_tokens", config.max_tokens, defaults.max_tokens_limit),
    ):
        if ceiling and asked > ceiling:
            raise LimitExceeded(f"config.{field} is {asked}, over this fleet's limit of {ceiling}")


def _within_token_ceilings(config: RunConfig, defaults: RunDefaults) -> RunConfig:
    """The config with its unset (0, "no limit") token budgets given the fleet's ceilings, where it has
    them: a host that never sets them keeps working, and its run is bounded like any other."""
    if config.budget.max_total_tokens == 0 and defaults.max_total_tokens_limit:
        budget = config.budget.model_copy(update={"max_total_tokens": defaults.max_total_tokens_limit})
        config = config.model_copy(update={"budget": budget})
    if config.max_tokens == 0 and defaults.max_tokens_limit:
        config = config.model_copy(update={"max_tokens": defaults.max_tokens_limit})
    return config


def new_run(cmd: StartCommand, defaults: RunDefaults) -> NewRun:
    """Resolve a start into the run to create: the config is flattened once, here, and stored; a resume
    never re-merges it. So a run's limits are the ones it started with, whichever worker continues it."""
    _check_ceilings(cmd.config, defaults)
    config = cmd.config
    if config.max_steps == 0:
        config = config.model_copy(update={"max_steps": defaults.max_steps})
    if config.budget.max_tool_calls == 0:
        budget = config.budget.model_copy(update={"max_tool_calls": defaults.max_tool_calls})
        config = config.model_copy(update={"budget": budget})
    config = _within_token_ceilings(config, defaults)
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


@dataclass(frozen=True)
class AnswerRequest:
    """A command that answers a pause, ready for its transition: where it acts, under which lease, with
    which inbox receipt, and the check that turns what its read found into the claim to make."""

    scope: Scope
    run_id: str
    lease: Lease
    receipt: Receipt | None
    correlation_id: str | None
    check: Callable[[Scope, Stored], Answer]
    # The checkpoint a decision names, read with the run.
    checkpoint_id: int | None = None


@dataclass(frozen=True)
class _Claiming:
    """One claim of a batch: the request, what its read found, and the checked answer."""

    request: AnswerRequest
    stored: Stored
    answer: Answer


# The batch statement takes claim_pause's arguments as arrays, in claim_pause's order, and the outbox hold
# (one for the batch) after them.
_CLAIM_ARGUMENTS: tuple[str, ...] = tuple(a for a in QUERIES["claim_pause"].arguments or () if a != "outbox_hold")


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
        a no-op (None); a different start under the same id in the same scope is RunExists."""
        scope = require_scope(cmd.scope)
        new = new_run(cmd, defaults)
        first = Progress(
            run_id=new.run_id,
            owner=lease.owner,
            # The run's trace begins with the start command's span (intermission/tracing.py).
            continuation=Continuation(config=new.config, session_id=new.session_id, traceparent=current_traceparent()),
        )
        async with self.db.connection() as con:
            created = await start_in(con, scope, new, lease, first, receipt, defaults.quota)
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
        return await self.answer(self.resume_request(cmd, lease, receipt=receipt, correlation_id=correlation_id))

    def resume_request(
        self, cmd: ResumeCommand, lease: Lease, *, receipt: Receipt | None = None, correlation_id: str | None = None
    ) -> AnswerRequest:
        def check(scope: Scope, stored: Stored) -> Answer:
            pause = stored.pause_pinned(scope, cmd.version)
            check_authority(Source.HOST, pause)
            return Answer(cmd.version, results_progress(pause, cmd.results, lease.owner), pause)

        return _request(cmd.scope, cmd.version.run_id, lease, receipt, correlation_id, check)

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
        return await self.answer(
            self.decide_request(cmd, lease, principal=principal, receipt=receipt, correlation_id=correlation_id)
        )

    def decide_request(
        self,
        cmd: DecideCommand,
        lease: Lease,
        *,
        principal: str | None,
        receipt: Receipt | None = None,
        correlation_id: str | None = None,
    ) -> AnswerRequest:
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

        return _request(
            cmd.scope, cmd.version.run_id, lease, receipt, correlation_id, check, checkpoint_id=cmd.checkpoint_id
        )

    async def expire(
        self, cmd: ExpireCommand, lease: Lease, *, receipt: Receipt | None = None, correlation_id: str | None = None
    ) -> Claimed:
        """Claim a pause past its deadline (judged against ``expired_by`` AND the database clock) with
        ``ending = expire``; the worker fails the run with a reason naming the deadline."""
        return await self.answer(self.expire_request(cmd, lease, receipt=receipt, correlation_id=correlation_id))

    def expire_request(
        self, cmd: ExpireCommand, lease: Lease, *, receipt: Receipt | None = None, correlation_id: str | None = None
    ) -> AnswerRequest:
        def check(scope: Scope, stored: Stored) -> Answer:
            pause = stored.pause_pinned(scope, cmd.version)
            deadline = pause.expires_at.isoformat() if pause.expires_at else "no deadline"
            ending = Ending(
                kind=EndingKind.EXPIRE,
                reason=f"suspension_expired: the {pause.reason.value} pause passed its deadline {deadline} unanswered",
            )
            first = ending_progress(pause, ending, lease.owner)
            return Answer(cmd.version, first, pause, expired_by=cmd.expired_by, announce=False)

        return _request(cmd.scope, cmd.version.run_id, lease, receipt, correlation_id, check)

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

    async def answer(self, request: AnswerRequest) -> Claimed:
        """Apply one command that answers a pause: its read, its check, its claim."""
        (result,) = await self.answer_all([request])
        if isinstance(result, Exception):
            raise result
        return result

    async def answer_all(self, requests: Sequence[AnswerRequest]) -> list[Claimed | Exception]:
        """Apply several commands that answer pauses together (group commit): ONE read for all of them, each
        checked on its own, then ONE statement with every claim that passed, committed once. Each command's
        outcome is its own: the run it claimed, or the typed error that refused it (AlreadyApplied for a
        duplicate), in ``requests``' order; a refused command writes nothing, as alone. An error that is
        nobody's in particular (the database away, a claim function that raised) is raised for the batch,
        and nothing of the batch is written."""
        results: list[Claimed | Exception | None] = [None] * len(requests)
        async with self.db.connection() as con:
            found = await self._read_all(con, [(r.scope, r.run_id, r.receipt, r.checkpoint_id) for r in requests])
            claiming: list[tuple[int, _Claiming]] = []
            for i, (request, stored) in enumerate(zip(requests, found, strict=True)):
                if isinstance(stored, Exception):
                    results[i] = stored
                    continue
                try:
                    claiming.append((i, _Claiming(request, stored, request.check(request.scope, stored))))
                except Exception as refused:  # the command's own refusal (or its bug), not the batch's
                    results[i] = refused
            claimed = await self._claim_all(con, [c for _, c in claiming])
        for (i, _), outcome in zip(claiming, claimed, strict=True):
            results[i] = outcome
        assert all(r is not None for r in results)  # every command was read, then refused or claimed
        return [r for r in results if r is not None]

    @staticmethod
    async def _read(
        con: Conn, scope: Scope, run_id: str, receipt: Receipt | None, checkpoint_id: int | None = None
    ) -> Stored:
        """The command's first round trip: the run, its pause, the inbox (a recorded message_id is
        AlreadyApplied or MessageIdConflict here) and the named checkpoint's state."""
        (stored,) = await CommandStore._read_all(con, [(scope, run_id, receipt, checkpoint_id)])
        if isinstance(stored, Exception):
            raise stored
        return stored

    @staticmethod
    async def _read_all(
        con: Conn, keys: Sequence[tuple[Scope, str, Receipt | None, int | None]]
    ) -> list[Stored | Exception]:
        """``_read`` for each key, in one round trip (``read_for_command`` for one, ``read_for_commands``
        for more)."""
        message_ids = [inbox_arguments(receipt, scope)["message_id"] for scope, _, receipt, _ in keys]
        if len(keys) == 1:
            ((scope, run_id, _, checkpoint_id),) = keys
            row = await con.fetchrow("read_for_command", run_id, scope.app, scope.tenant, message_ids[0], checkpoint_id)
            assert row is not None  # the read always returns its one row
            found = [row]
        else:
            found = await con.fetch(
                "read_for_commands",
                [run_id for _, run_id, _, _ in keys],
                [scope.app for scope, _, _, _ in keys],
                [scope.tenant for scope, _, _, _ in keys],
                message_ids,
                [checkpoint_id for _, _, _, checkpoint_id in keys],
            )
            assert len(found) == len(keys)  # one row per key, in order
        stored: list[Stored | Exception] = []
        for (_, _, receipt, _), row in zip(keys, found, strict=True):
            try:
                if receipt is not None:
                    receipt.check_recorded(row["i_routing_key"], row["i_body_digest"], row["i_outcome"])
            except Exception as recorded:
                stored.append(recorded)
                continue
            stored.append(
                Stored(
                    run=rows.run_from_row(row["run"]) if row["run"] is not None else None,
                    pause=rows.suspension_from_row(row["pause"]) if row["pause"] is not None else None,
                    checkpoint_state=row["k_state"],
                )
            )
        return stored

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
        request = AnswerRequest(scope, run_id, lease, receipt, correlation_id, lambda _scope, _stored: answer)
        (result,) = await CommandStore._claim_all(con, [_Claiming(request, stored, answer)])
        if isinstance(result, Exception):
            raise result
        return result

    @staticmethod
    async def _claim_all(con: Conn, claims: Sequence[_Claiming]) -> list[Claimed | Exception]:
        """The transitions of ``claims``, in ONE statement (``claim_pause`` for one, ``claim_pauses`` for
        more), so they commit together; each claim's outcome is its own. The run.resumed events of the
        claims that succeed are known whole here, so where the database hands events over they are handed
        over (``Conn.hand_over``): published from memory after the commit, their rows held for the relays."""
        if not claims:
            return []
        events = [_event(c) for c in claims]
        arguments = [_claim_arguments(c, event) for c, event in zip(claims, events, strict=True)]
        if len(claims) == 1:
            row = await con.fetchrow("claim_pause", **arguments[0], outbox_hold=con.outbox_hold)
            assert row is not None
            found = [row]
        else:
            # Sorted by run, so that concurrent batches lock the runs they share in the same order.
            order = sorted(
                range(len(claims)),
                key=lambda i: (claims[i].request.scope.app, claims[i].request.scope.tenant, claims[i].request.run_id),
            )
            columns = [[arguments[i][name] for i in order] for name in _CLAIM_ARGUMENTS]
            by_position = await con.fetch("claim_pauses", *columns, con.outbox_hold)
            assert len(by_position) == len(claims)  # one row per claim, in the arrays' order
            found = [by_position[0]] * len(claims)
            for position, i in enumerate(order):
                found[i] = by_position[position]
        outcomes = [_claimed(c, row) for c, row in zip(claims, found, strict=True)]
        if con.outbox_hold is not None:
            con.hand_over(
                [
                    event
                    for event, row in zip(events, found, strict=True)
                    if event is not None and row["outcome"] == "claimed"
                ]
            )
        return outcomes

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
        try:
            admission = await evidence.admit_resume_leased(
                request, lease, first, correlation_id=correlation_id, pause=suspension, receipt=receipt
            )
        except ResumeAdmissionConflict:
            # The admission function checks the inbox, then looks for an admission: a rival that reused this
            # message_id with another body can commit both between those two reads. Its inbox record commits
            # with its admission, so it is visible now: the message_id is what was reused.
            if receipt is not None:
                await self._refuse_reused_message_id(receipt, scope)
            raise
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


def _request(
    scope: Scope,
    run_id: str,
    lease: Lease,
    receipt: Receipt | None,
    correlation_id: str | None,
    check: Callable[[Scope, Stored], Answer],
    *,
    checkpoint_id: int | None = None,
) -> AnswerRequest:
    """A checked-up request: the scope is one, the lease whole (no I/O before either holds)."""
    check_lease(lease)
    return AnswerRequest(require_scope(scope), run_id, lease, receipt, correlation_id, check, checkpoint_id)


def _event(claim: _Claiming) -> outbox.OutboxEvent | None:
    """The run.resumed a claim announces (its revision is known: the claim is pinned to the one before)."""
    request, version = claim.request, claim.answer.version
    if not claim.answer.announce:
        return None
    resumed = RunEvent(
        kind=RunEventKind.RESUMED, run_id=request.run_id, revision=version.run_revision + 1, scope=request.scope
    )
    # In the run's trace, as its pause recorded it; a pause that recorded none: the command's.
    recorded = claim.stored.pause.continuation.traceparent if claim.stored.pause is not None else None
    return outbox.run_event(resumed, request.correlation_id, traceparent=recorded or current_traceparent())


def _claim_arguments(claim: _Claiming, event: outbox.OutboxEvent | None) -> dict[str, Any]:
    """The claim's named arguments, but for the outbox hold (the statement's, not the claim's)."""
    request, answer = claim.request, claim.answer
    named = claim_arguments(
        request.scope,
        request.run_id,
        version=answer.version,
        expired_by=answer.expired_by,
        lease=request.lease,
        first=answer.first,
        answers_only=True,
        drop_pause=True,
        receipt=request.receipt,
        decision=answer.decision,
        event=event,
    )
    del named["outbox_hold"]
    return named


def _claimed(claim: _Claiming, result: Any) -> Claimed | Exception:
    """One claim's outcome: the run as claimed, or the typed error of its refusal."""
    request, answer, stored = claim.request, claim.answer, claim.stored
    outcome = result["outcome"]
    try:
        if request.receipt is not None:
            request.receipt.refuse(outcome)
    except Exception as recorded:
        return recorded
    if outcome != "claimed":
        return refusal(
            outcome, result, request.scope, request.run_id, version=answer.version, expired_by=answer.expired_by
        )
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
    progress = answer.first.model_copy(update={"scope": request.scope, "updated_at": result["first_updated_at"]})
    return Claimed(run=run, progress=progress, suspension=answer.suspension, correlation_id=request.correlation_id)
