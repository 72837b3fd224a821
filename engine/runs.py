"""A running run's own transitions: its step saves, its pause, its end, and a cancel asking it to end.

Each is ONE call of its transition, which writes everything the change causes in the same transaction: a
pause writes the suspension, the approval checkpoint, the run's move to paused (revision + 1), the removal
of its snapshot and its Notice; an end writes the terminal state, the run's own messages into its session,
its metadata event and its ``run.*`` event. Only the holder of a live lease may save, pause or end a running
run, at the revision it holds; anyone else gets RunLeaseLost and writes nothing.

A pause's Notice and an end's event are encoded here, whole, before their statement (``engine/events.py``):
the end's revision is the one after the holder's, and the pause's id, its checkpoint's and its deadline are
drawn from the database first (``DrawPauseKeys``), so nothing is left for SQL to fill in.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import ClassVar, Final, NamedTuple

from intermission.engine.columns import event_fields
from intermission.engine.events import OutboxEvent, notice_event, run_event
from intermission.engine.transition import Family, OfRun, Operation, RunKey, Steps, Transition, only
from intermission.schemas.answers import publishable
from intermission.schemas.errors import InvalidArgument, InvalidState, RunLeaseLost
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Message
from intermission.schemas.run import Ending, Run, RunState
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import Continuation, Notice, PendingCall, Progress, SuspendReason, Suspension
from intermission.store import rows
from intermission.store.inbox import Receipt, inbox_arguments
from intermission.store.rows import Out
from intermission.store.sessions import history

END_STATES: Final[dict[RunEventKind, RunState]] = {
    RunEventKind.COMPLETED: RunState.COMPLETED,
    RunEventKind.FAILED: RunState.FAILED,
    RunEventKind.CANCELLED: RunState.CANCELLED,
    # An expiry fails the run: nobody answered its pause in time.
    RunEventKind.EXPIRED: RunState.FAILED,
}


class EndingRequested(Exception):
    """The run was asked to end while it ran (a cancel: ``runs.ending``), so its holder's pause, or an end
    other than that one, wrote nothing: the holder must finish ``ending`` instead. Not an error of anybody's
    request, so not an IntermissionError: it never leaves the fleet."""

    def __init__(self, run_id: str, ending: Ending) -> None:
        super().__init__(f"run {run_id} was asked to end: {ending.kind.value}")
        self.run_id = run_id
        self.ending = ending


def _ending(raw: str | None) -> Ending | None:
    return None if raw is None else rows.load_model(Ending, raw, "run ending")


def _not_left(outcome: str, out: Out, run_id: str, owner: str) -> Exception:
    """Why a holder's pause or end wrote nothing."""
    if outcome == "ending_requested":
        ending = _ending(out["ending"])
        assert ending is not None
        return EndingRequested(run_id, ending)
    if outcome == "revision_moved":
        return InvalidState(f"run {run_id} is at revision {out['revision']}, not the one its holder has")
    return RunLeaseLost(f"{owner or 'an empty owner'} does not hold run {run_id}")


# --- the history a run loads -------------------------------------------------------------------------


class SessionKeyRow(NamedTuple):
    """``intermission_session_key_v1``."""

    app: str
    tenant: str
    session_id: str
    most: int


READ_SESSION = Family("read_session", "read_sessions", SessionKeyRow, reads=True)


@dataclass(frozen=True)
class ReadSession(Transition[list[Message]]):
    """A session's most recent messages at ``scope``, at most ``most`` of them, oldest first, never opening
    on a tool result whose call was cut off."""

    family: ClassVar[Family] = READ_SESSION

    scope: Scope
    session_id: str
    most: int

    def row(self) -> SessionKeyRow:
        return SessionKeyRow(self.scope.app, self.scope.tenant, self.session_id, self.most)

    def result(self, outs: Sequence[Out]) -> list[Message]:
        return history([out["message"] for out in outs])


# --- step saves ---------------------------------------------------------------------------------------


class SaveRow(NamedTuple):
    """``intermission_save_v2``."""

    run_id: str
    app: str
    tenant: str
    # Whose live lease the save needs.
    owner: str
    # The snapshot, its parts encoded as the progress row stores them.
    continuation: str | None
    started: str | None
    done: str | None
    ending: str | None
    approved: str | None
    # What the run row takes from it in the same statement.
    step_count: int
    tokens_used: int


SAVE = Family("save", "save_progresses_v2", SaveRow)


@dataclass(frozen=True)
class SaveProgress(Transition[Progress]):
    """Upsert the run's snapshot, only while the run is running under ``progress.owner``'s live lease;
    RunLeaseLost otherwise, and nothing is written. An empty owner never matches, not even a run that holds
    no lease. The run row takes the snapshot's step and token counts in the same statement.

    Its result is the snapshot as stored: with the scope and time the store gave it, and with the end asked of
    the run while it ran (a cancel), which no snapshot can take back, as its ``ending``."""

    family: ClassVar[Family] = SAVE

    scope: Scope
    progress: Progress

    def __post_init__(self) -> None:
        require_scope(self.scope)
        if not self.progress.owner:  # refused before any I/O, like a half lease
            raise RunLeaseLost("an empty owner never holds a lease")

    def key(self) -> RunKey:
        return (self.scope.app, self.scope.tenant, self.progress.run_id)

    def row(self) -> SaveRow:
        p = self.progress
        snapshot = rows.progress_arguments(p)
        return SaveRow(
            p.run_id,
            self.scope.app,
            self.scope.tenant,
            p.owner,
            snapshot["continuation"],
            snapshot["started"],
            snapshot["done"],
            snapshot["ending"],
            snapshot["approved"],
            p.continuation.step_index,
            p.continuation.tokens_used,
        )

    def result(self, outs: Sequence[Out]) -> Progress:
        p = self.progress
        out = outs[0] if outs else None
        if out is None or out["saved_at"] is None:
            raise RunLeaseLost(f"{p.owner} does not hold a live lease on run {p.run_id} at scope {self.scope}")
        asked = _ending(out["ending"])
        return p.model_copy(update={"scope": self.scope, "updated_at": out["saved_at"], "ending": asked or p.ending})


# --- pauses -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pause:
    """A pause a running run asks for: all calls of one turn that need outside answers, together."""

    reason: SuspendReason
    pending: list[PendingCall]
    continuation: Continuation
    # Who may decide an approval pause; empty means any host.
    approvers: list[str] = field(default_factory=list)
    # The deadline from now, by the database clock; None takes the run's own pause_ttl_seconds, 0 means
    # no deadline.
    ttl_seconds: float | None = None


@dataclass(frozen=True)
class Paused:
    suspension: Suspension
    notice: Notice


class DrawRow(NamedTuple):
    """``intermission_pause_draw_v1``."""

    approval: bool


DRAW = Family("draw", "draw_pause_keys", DrawRow, reads=True)


@dataclass(frozen=True)
class Drawn:
    """What a pause is written under: its id, its checkpoint's (approvals only), and the database clock."""

    suspension_id: int
    checkpoint_id: int | None
    db_now: datetime


@dataclass(frozen=True)
class DrawPauseKeys(Transition[Drawn]):
    family: ClassVar[Family] = DRAW

    approval: bool

    def row(self) -> DrawRow:
        return DrawRow(self.approval)

    def result(self, outs: Sequence[Out]) -> Drawn:
        out = only(outs)
        return Drawn(out["suspension_id"], out["checkpoint_id"], out["db_now"])


class PauseRow(NamedTuple):
    """``intermission_pause_v3``."""

    run_id: str
    app: str
    tenant: str
    owner: str
    revision: int
    suspension_id: int
    checkpoint_id: int | None
    reason: str
    pending: str
    continuation: str
    approvers: list[str]
    expires_at: datetime | None
    step_count: int
    tokens_used: int
    event_message_id: uuid.UUID
    event_routing_key: str
    event_body: str
    event_correlation_id: str | None
    event_headers: str


PAUSE = Family("pause", "pause_runs_v3", PauseRow, held=True, success=frozenset({"paused"}))


def check_pause(pause: Pause) -> None:
    if not pause.pending:
        raise InvalidArgument("a pause needs at least one pending call")
    if pause.ttl_seconds is not None and not (math.isfinite(pause.ttl_seconds) and pause.ttl_seconds >= 0):
        # NaN compares false both ways: unchecked it would read as "no deadline".
        raise InvalidArgument("a pause ttl must be a finite, non-negative number of seconds")


@dataclass(frozen=True)
class PauseWritten(Transition[Paused]):
    """The pause transition itself, under keys drawn for it (``PauseRun`` draws them)."""

    family: ClassVar[Family] = PAUSE

    run: Run
    owner: str
    pause: Pause
    drawn: Drawn
    correlation_id: str | None = None

    @property
    def notice(self) -> Notice:
        pause, run, drawn = self.pause, self.run, self.drawn
        ttl = pause.ttl_seconds if pause.ttl_seconds is not None else run.pause_ttl_seconds
        return Notice(
            suspension_id=drawn.suspension_id,
            run_id=run.id,
            run_revision=run.revision + 1,
            reason=pause.reason,
            # As the run's publication policy lets it: the stored pause keeps the calls' arguments, for
            # whoever must execute them.
            pending=publishable(pause.pending, pause.continuation.config),
            expires_at=drawn.db_now + timedelta(seconds=ttl) if ttl > 0 else None,
            checkpoint_id=drawn.checkpoint_id if pause.reason is SuspendReason.APPROVAL else None,
            approvers=pause.approvers,
            scope=run.scope,
        )

    @cached_property
    def event(self) -> OutboxEvent:
        # Built once: its message_id is drawn here, and the row written and the event handed to the sink
        # must be the same event (a relay marks a handed event sent by it).
        # The Notice carries the trace the pause recorded in its continuation (the pause's own span).
        return notice_event(self.notice, self.correlation_id, traceparent=self.pause.continuation.traceparent)

    def key(self) -> RunKey:
        return (self.run.scope.app, self.run.scope.tenant, self.run.id)

    def row(self) -> PauseRow:
        pause, run, notice = self.pause, self.run, self.notice
        return PauseRow(
            run.id,
            run.scope.app,
            run.scope.tenant,
            self.owner,
            run.revision,
            notice.suspension_id,
            notice.checkpoint_id,
            pause.reason.value,
            rows.dump_list(rows.PENDING, pause.pending),
            rows.dump(pause.continuation),
            pause.approvers,
            notice.expires_at,
            pause.continuation.step_index,
            pause.continuation.tokens_used,
            **event_fields(self.event),
        )

    def events(self) -> Sequence[OutboxEvent]:
        return (self.event,)

    def result(self, outs: Sequence[Out]) -> Paused:
        out = only(outs)
        if out["outcome"] != "paused":
            raise _not_left(out["outcome"], out, self.run.id, self.owner)
        written = out["pause"]
        pause, notice = self.pause, self.notice
        suspension = Suspension(
            id=notice.suspension_id,
            run_id=self.run.id,
            scope=self.run.scope,
            reason=pause.reason,
            pending=pause.pending,
            continuation=pause.continuation,
            expires_at=notice.expires_at,
            checkpoint_id=notice.checkpoint_id,
            approvers=pause.approvers,
            created_at=written["created_at"],
        )
        return Paused(suspension, notice)


@dataclass(frozen=True)
class PauseRun(Operation[Paused]):
    """Pause a running run held by ``owner`` at ``run.revision``, in ONE transaction: the run moves to
    paused with its revision bumped and its lease cleared, any old pause is removed, the new suspension (and
    for an approval its checkpoint) is written, the progress is dropped and the Notice goes to the outbox.
    A run asked to end meanwhile does not pause (EndingRequested)."""

    run: Run
    owner: str
    pause: Pause
    correlation_id: str | None = None

    def __post_init__(self) -> None:
        check_pause(self.pause)

    async def apply_in(self, steps: Steps) -> Paused:
        drawn = await steps.commit(DrawPauseKeys(self.pause.reason is SuspendReason.APPROVAL))
        return await steps.commit(PauseWritten(self.run, self.owner, self.pause, drawn, self.correlation_id))


# --- ends ---------------------------------------------------------------------------------------------


class EndRow(NamedTuple):
    """``intermission_end_v3``."""

    run_id: str
    app: str
    tenant: str
    owner: str | None
    revision: int
    state: str
    output: str | None
    error: str | None
    messages: str | None
    checkpoint_reason: str
    run_event_id: uuid.UUID
    run_event_kind: str
    run_event_data: str
    step_count: int | None
    tokens_used: int | None
    event_message_id: uuid.UUID
    event_routing_key: str
    event_body: str
    event_correlation_id: str | None
    event_headers: str


END = Family("end", "end_runs_v3", EndRow, held=True, success=frozenset({"ended"}))


@dataclass(frozen=True)
class EndRun(OfRun[RunEvent]):
    """End a running run held by ``owner`` at ``revision``, in ONE transaction with its metadata event and
    its ``run.<kind>`` event: progress and any pause are removed, undecided checkpoints are closed, the run's
    OWN messages (never its loaded history) are appended to the session it started in, and the run row takes
    the step and token counts of ``counts`` (the continuation it ended at; None keeps those stored).

    A run asked to end while it ran (a cancel) ends only as cancelled: any other end is EndingRequested and
    writes nothing. ``traceparent`` (the run's trace) goes on the ``run.<kind>`` event."""

    family: ClassVar[Family] = END

    owner: str
    revision: int
    kind: RunEventKind
    output: str | None = None
    error: str | None = None
    correlation_id: str | None = None
    own_messages: list[Message] | None = None
    counts: Continuation | None = None
    traceparent: str | None = None

    def __post_init__(self) -> None:
        require_scope(self.scope)
        if self.kind not in END_STATES:
            raise InvalidArgument(f"{self.kind.value} is not an end")

    @cached_property
    def ended(self) -> RunEvent:
        # Built once: the event's body and the result the caller gets are the same run event.
        return RunEvent(
            kind=self.kind,
            run_id=self.run_id,
            revision=self.revision + 1,
            scope=self.scope,
            output=self.output,
            error=self.error,
        )

    @cached_property
    def event(self) -> OutboxEvent:
        # Built once, so that the row written and the event handed to the sink share one message_id.
        return run_event(self.ended, self.correlation_id, traceparent=self.traceparent)

    def row(self) -> EndRow:
        counts = self.counts
        return EndRow(
            self.run_id,
            self.scope.app,
            self.scope.tenant,
            self.owner,
            self.revision,
            END_STATES[self.kind].value,
            self.output,
            self.error,
            # Encoded here, before the statement: a message that cannot be stored (U+0000) is refused typed,
            # with nothing written.
            rows.dump_list(rows.MESSAGES, self.own_messages) if self.own_messages else None,
            self.error or self.kind.value,
            uuid.uuid4(),
            self.kind.value,
            json.dumps({"output": self.output, "error": self.error}),
            counts.step_index if counts is not None else None,
            counts.tokens_used if counts is not None else None,
            **event_fields(self.event),
        )

    def events(self) -> Sequence[OutboxEvent]:
        return (self.event,)

    def result(self, outs: Sequence[Out]) -> RunEvent:
        out = only(outs)
        if out["outcome"] != "ended":
            raise _not_left(out["outcome"], out, self.run_id, self.owner)
        return self.ended


# --- a cancel of a running run ----------------------------------------------------------------------


class EndingRow(NamedTuple):
    """``intermission_ending_v2``."""

    run_id: str
    app: str
    tenant: str
    ending: str
    message_id: str | None
    routing_key: str | None
    digest: str | None


ENDING = Family("ending", "request_endings_v2", EndingRow)


@dataclass(frozen=True)
class RequestEnding(OfRun[str]):
    """Ask a RUNNING run held under a lease to end (``intermission_request_ending_v1``): the ending is kept
    on its row (and its snapshot), with the command's inbox record, for its holder to finish at its next
    boundary, or whoever takes it over. Its result is the outcome: 'requested', 'ending_before' (asked
    already), 'not_leased' or 'not_running'; a recorded message_id is its receipt's refusal."""

    family: ClassVar[Family] = ENDING

    ending: Ending
    receipt: Receipt | None = None

    def row(self) -> EndingRow:
        inbox = inbox_arguments(self.receipt, self.scope)
        return EndingRow(
            self.run_id,
            self.scope.app,
            self.scope.tenant,
            rows.dump(self.ending),
            inbox["message_id"],
            inbox["routing_key"],
            inbox["digest"],
        )

    def result(self, outs: Sequence[Out]) -> str:
        outcome: str = only(outs)["outcome"]
        if self.receipt is not None:
            self.receipt.refuse(outcome)
        return outcome
