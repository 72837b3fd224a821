"""Runs at one exact scope: create, read, lease renewal and release, takeover, pause and end.

Each state change is one call of its transition (``store/migrations/0005_transitions.sql``), which writes
everything the change causes in the same transaction: a pause writes the suspension, the approval
checkpoint, the run's move to paused (revision + 1), the removal of its progress and its Notice; an end
writes the terminal state, the run's own messages into its session, its metadata event and its ``run.*``
event. Only the holder of a live lease may pause or end a running run; anyone else gets RunLeaseLost and
writes nothing.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from intermission.schemas.config import REDACTED_ARGUMENTS, RunConfig
from intermission.schemas.digest import digest
from intermission.schemas.errors import (
    InvalidArgument,
    MessageIdConflict,
    QuotaExceeded,
    RunExists,
    RunLeaseLost,
    RunNotFound,
    RunNotReclaimable,
    UnsupportedConfig,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Message
from intermission.schemas.run import Ending, Lease, NewRun, Run, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Continuation, Notice, PendingCall, Progress, SuspendReason, Suspension
from intermission.store import outbox, rows
from intermission.store.db import Conn, Database
from intermission.store.inbox import AlreadyApplied, Receipt, inbox_arguments

END_STATES: dict[RunEventKind, RunState] = {
    RunEventKind.COMPLETED: RunState.COMPLETED,
    RunEventKind.FAILED: RunState.FAILED,
    RunEventKind.CANCELLED: RunState.CANCELLED,
    # An expiry fails the run: nobody answered its pause in time.
    RunEventKind.EXPIRED: RunState.FAILED,
}


@dataclass(frozen=True)
class CreatedRun:
    run: Run
    # True only for the call that created it; a repeated identical start is a no-op.
    fresh: bool


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


@dataclass(frozen=True)
class Reclaimed:
    run: Run
    progress: Progress | None


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


def publishable(pending: list[PendingCall], config: RunConfig) -> list[PendingCall]:
    """The pending calls as a Notice of a run under ``config`` may carry them outside: with their arguments
    redacted when its publication policy says so."""
    if not config.publication.redact_arguments:
        return pending
    return [call.model_copy(update={"arguments": REDACTED_ARGUMENTS}) for call in pending]


def check_lease(lease: Lease) -> None:
    if not lease.is_set:
        raise RunLeaseLost("a lease needs both an owner and a ttl")


def check_new_run(new: NewRun, lease: Lease | None, first: Progress | None) -> None:
    unsupported = new.config.unsupported()
    if unsupported:
        # Before anything is written: a run is never started on a config it would then silently ignore.
        raise UnsupportedConfig("; ".join(unsupported))
    if lease is not None:
        check_lease(lease)
    if first is not None:
        if lease is None or first.owner != lease.owner:
            raise RunLeaseLost("the first progress snapshot must be owned by the lease owner")
        if first.run_id != new.run_id:
            raise InvalidArgument("the first progress snapshot is for another run")


def start_digest(scope: Scope, new: NewRun) -> str:
    """Binds a start request, so a repeated start is recognised and a different one is run_exists."""
    return digest({"scope": scope, "run": new})


def end_arguments(
    scope: Scope,
    run_id: str,
    kind: RunEventKind,
    *,
    output: str | None,
    error: str | None,
    correlation_id: str | None,
    own_messages: list[Message] | None,
    run_event_id: uuid.UUID | None = None,
    run_event_kind: str | None = None,
    run_event_data: dict[str, object] | None = None,
    counts: Continuation | None = None,
    traceparent: str | None = None,
) -> dict[str, object]:
    """Everything the end transition takes but who may end the run (``owner``, ``at_revision``). ``counts``
    is the continuation whose step and token counts the run row ends with (None keeps those stored);
    ``traceparent`` goes on the run's end event."""
    state = END_STATES.get(kind)
    if state is None:
        raise InvalidArgument(f"{kind.value} is not an end")
    # The event's revision is the one the end gives the run; the transition adds it.
    event = RunEvent(kind=kind, run_id=run_id, revision=0, scope=scope, output=output, error=error)
    announced = outbox.run_event(event, correlation_id, revision_known=False, traceparent=traceparent)
    return {
        "run_id": run_id,
        "app": scope.app,
        "tenant": scope.tenant,
        "state": state.value,
        "output": output,
        "error": error,
        # Encoded here, before the statement: a message that cannot be stored (U+0000) is refused typed,
        # with nothing written.
        "messages": rows.dump_list(rows.MESSAGES, own_messages) if own_messages else None,
        "checkpoint_reason": error or kind.value,
        "run_event_id": run_event_id or uuid.uuid4(),
        "run_event_kind": run_event_kind or kind.value,
        "run_event_data": json.dumps(
            run_event_data if run_event_data is not None else {"output": output, "error": error}
        ),
        "event": announced.body,
        **announced.arguments(body=False),
        "step_count": counts.step_index if counts is not None else None,
        "tokens_used": counts.tokens_used if counts is not None else None,
    }


@dataclass(frozen=True)
class Quota:
    """The fleet's default quotas of a scope without a row of its own in ``scope_quotas`` (0: none)."""

    live_runs: int = 0
    starts_per_second: float = 0.0


NO_QUOTA: Final = Quota()


async def start_in(
    con: Conn,
    scope: Scope,
    new: NewRun,
    lease: Lease | None,
    first: Progress | None,
    receipt: Receipt | None,
    quota: Quota = NO_QUOTA,
) -> CreatedRun:
    """The start transition on ``con``: the run (with its first snapshot and the command's inbox record),
    within the scope's quotas (QuotaExceeded, nothing written)."""
    check_new_run(new, lease, first)
    row = await con.fetchrow(
        "start_run",
        run_id=new.run_id,
        app=scope.app,
        tenant=scope.tenant,
        agent_id=new.agent_id,
        input=new.input,
        config=rows.dump(new.config),
        script=None if new.script is None else rows.dump_list(rows.SCRIPT, new.script),
        pause_ttl_seconds=new.pause_ttl_seconds,
        session_id=new.session_id or new.run_id,
        start_digest=start_digest(scope, new),
        lease_owner=lease.owner if lease is not None else None,
        lease_ttl=lease.ttl_seconds if lease is not None else None,
        first_continuation=rows.dump(first.continuation) if first is not None else None,
        **inbox_arguments(receipt, scope),
        default_live_runs=quota.live_runs,
        default_starts_per_second=quota.starts_per_second,
    )
    assert row is not None  # the function always returns its one row
    outcome = row["outcome"]
    if outcome == "quota_live_runs":
        raise QuotaExceeded(f"scope {scope} holds as many live runs as its quota allows")
    if outcome == "quota_starts_per_second":
        raise QuotaExceeded(f"scope {scope} started as many runs this second as its quota allows")
    if outcome == "duplicate":
        assert receipt is not None
        raise AlreadyApplied(receipt.message_id, "applied")
    if outcome == "message_id_conflict":
        assert receipt is not None
        raise MessageIdConflict(f"message_id {receipt.message_id} was used for a different command")
    if outcome == "run_exists":
        raise RunExists(f"run id {new.run_id} holds a different run in this scope")
    return CreatedRun(rows.run_from_row(row["run"]), fresh=outcome == "created")


class RunStore:
    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def create_run(self, new: NewRun, lease: Lease | None = None, first: Progress | None = None) -> CreatedRun:
        """Create a run: running under ``lease`` (with its first snapshot) when one is given.

        The caller picks the run id, unique within this scope (another scope's run of that id is another
        run, and says nothing here). The identical start again returns the stored run with ``fresh`` false
        and changes nothing; a different start under the same id in this scope is RunExists.
        """
        check_new_run(new, lease, first)
        async with self.db.connection() as con:
            return await start_in(con, self.scope, new, lease, first, None)

    async def get_run(self, run_id: str) -> Run:
        async with self.db.connection() as con:
            row = await con.fetchrow("get_run", run_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise RunNotFound(f"no run {run_id} at scope {self.scope}")
        return rows.run_from_row(row)

    async def renew_lease(self, run_id: str, lease: Lease) -> None:
        """Extend a live lease. A lease that lapsed or passed to someone else is RunLeaseLost: its holder
        must stop at once and write nothing more."""
        check_lease(lease)
        async with self.db.connection() as con:
            expires = await con.fetchval(
                "renew_lease", run_id, self.scope.app, self.scope.tenant, lease.owner, lease.ttl_seconds
            )
        if expires is None:
            raise RunLeaseLost(f"{lease.owner} no longer holds run {run_id}")

    async def release_lease(self, run_id: str, owner: str) -> bool:
        """Let a held lease lapse now (a graceful stop), so another worker may take the run at once."""
        async with self.db.connection() as con:
            return await con.fetchval("release_lease", run_id, self.scope.app, self.scope.tenant, owner) is not None

    async def claim_continuation_leased(self, run_id: str, lease: Lease, first: Progress | None = None) -> Run:
        """Take over a running run whose lease lapsed, under ``lease``, writing ``first`` in the same
        transaction (or handing its snapshot over as it stands). The revision does not change."""
        check_lease(lease)
        if first is not None and first.owner != lease.owner:
            raise RunLeaseLost("the first progress snapshot must be owned by the lease owner")
        if first is not None and first.run_id != run_id:
            raise InvalidArgument("the first progress snapshot is for another run")
        snapshot = rows.progress_arguments(first, "first_") if first is not None else {}
        async with self.db.transaction() as con:
            row = await con.fetchrow(
                "take_over",
                owner=lease.owner,
                lease_ttl=lease.ttl_seconds,
                limit=1,
                run_id=run_id,
                app=self.scope.app,
                tenant=self.scope.tenant,
                first_continuation=snapshot.get("first_continuation"),
                first_started=snapshot.get("first_started"),
                first_done=snapshot.get("first_done"),
                first_ending=snapshot.get("first_ending"),
                first_approved=snapshot.get("first_approved"),
            )
            if row is None:
                if await con.fetchrow("get_run", run_id, self.scope.app, self.scope.tenant) is None:
                    raise RunNotFound(f"no run {run_id} at scope {self.scope}")
                raise RunNotReclaimable(f"run {run_id} is not running under a lapsed lease")
            return rows.run_from_row(row["run"])

    async def pause_run(self, run_id: str, owner: str, pause: Pause, *, correlation_id: str | None = None) -> Paused:
        """Pause a running run held by ``owner``, in ONE transaction: the run moves to paused with its
        revision bumped and its lease cleared, any old pause is removed, the new suspension (and for an
        approval its checkpoint) is written, the progress is dropped and the Notice goes to the outbox."""
        if not pause.pending:
            raise InvalidArgument("a pause needs at least one pending call")
        if pause.ttl_seconds is not None and not (math.isfinite(pause.ttl_seconds) and pause.ttl_seconds >= 0):
            # NaN compares false both ways: unchecked it would read as "no deadline".
            raise InvalidArgument("a pause ttl must be a finite, non-negative number of seconds")
        # The Notice as far as it is known here; the pause's transaction adds its id, deadline, checkpoint
        # and the run's new revision. It carries the pending calls as the run's publication policy lets it:
        # the stored pause keeps their arguments, for whoever must execute them.
        known = Notice(
            suspension_id=0,
            run_id=run_id,
            run_revision=0,
            reason=pause.reason,
            pending=publishable(pause.pending, pause.continuation.config),
            approvers=pause.approvers,
            scope=self.scope,
        )
        # The Notice carries the trace the pause recorded in its continuation (the pause's own span).
        event = outbox.notice_event(known, correlation_id, traceparent=pause.continuation.traceparent)
        async with self.db.connection() as con:
            row = await con.fetchrow(
                "pause_run",
                run_id=run_id,
                app=self.scope.app,
                tenant=self.scope.tenant,
                owner=owner,
                reason=pause.reason.value,
                pending=rows.dump_list(rows.PENDING, pause.pending),
                continuation=rows.dump(pause.continuation),
                approvers=pause.approvers,
                ttl=pause.ttl_seconds,
                step_count=pause.continuation.step_index,
                tokens_used=pause.continuation.tokens_used,
                notice=event.body,
                **event.arguments(body=False),
                outbox_hold=con.outbox_hold,
            )
            if con.outbox_hold is not None:
                # The Notice as its transaction wrote it, published from memory after the commit.
                con.hand_over([event.with_body(row["event_body"])] if row is not None and row["event_body"] else [])
        if row is None or row["revision"] is None:
            ending = _ending(row["ending"]) if row is not None else None
            if ending is not None:
                raise EndingRequested(run_id, ending)
            raise RunLeaseLost(f"{owner or 'an empty owner'} does not hold run {run_id}")
        written = row["pause"]
        suspension = Suspension(
            id=written["id"],
            run_id=run_id,
            scope=self.scope,
            reason=pause.reason,
            pending=pause.pending,
            continuation=pause.continuation,
            expires_at=written["expires_at"],
            checkpoint_id=written["checkpoint_id"],
            approvers=pause.approvers,
            created_at=written["created_at"],
        )
        notice = known.model_copy(
            update={
                "suspension_id": suspension.id,
                "run_revision": row["revision"],
                "expires_at": suspension.expires_at,
                "checkpoint_id": suspension.checkpoint_id,
            }
        )
        return Paused(suspension, notice)

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
        """End a running run held by ``owner``, in ONE transaction with its metadata event and its
        ``run.<kind>`` event: progress and any pause are removed, undecided checkpoints are closed, the
        run's OWN messages (never its loaded history) are appended to the session it started in, and the
        run row takes the step and token counts of ``counts`` (the continuation it ended at).

        A run asked to end while it ran (a cancel) ends only as cancelled: any other end is EndingRequested
        and writes nothing. ``traceparent`` (the run's trace) goes on the ``run.<kind>`` event."""
        named = end_arguments(
            self.scope,
            run_id,
            kind,
            output=output,
            error=error,
            correlation_id=correlation_id,
            own_messages=own_messages,
            counts=counts,
            traceparent=traceparent,
        )
        row = await self.db.run_ends.fetchrow(owner=owner, at_revision=None, **named)
        revision = row["revision"] if row is not None else None
        if revision is None:
            ending = _ending(row["ending"]) if row is not None else None
            if ending is not None:
                raise EndingRequested(run_id, ending)
            raise RunLeaseLost(f"{owner or 'an empty owner'} does not hold run {run_id}")
        return RunEvent(kind=kind, run_id=run_id, revision=revision, scope=self.scope, output=output, error=error)

    async def list_run_events(self, run_id: str) -> list[dict[str, object]]:
        async with self.db.connection() as con:
            found = await con.fetch("list_run_events", run_id, self.scope.app, self.scope.tenant)
        return [
            {
                "event_id": r["event_id"],
                "kind": r["kind"],
                "revision": r["revision"],
                "data": json.loads(r["data"]),
                "created_at": r["created_at"],
            }
            for r in found
        ]

    async def list_outbox(self, run_id: str) -> list[RunOutboxRow]:
        """Operators: the run's outbox rows in order, where each stands, never their bodies."""
        async with self.db.connection() as con:
            found = await con.fetch("list_run_outbox", run_id, self.scope.app, self.scope.tenant)
        return [
            RunOutboxRow(
                id=r["id"],
                message_id=r["message_id"],
                routing_key=r["routing_key"],
                correlation_id=r["correlation_id"],
                headers=_header_table(r["headers"]),
                created_at=r["created_at"],
                sent_at=r["sent_at"],
                attempts=r["attempts"],
                next_attempt_at=r["next_attempt_at"],
                quarantined_at=r["quarantined_at"],
                last_error=r["last_error"],
            )
            for r in found
        ]

    async def notice_of_pause(self, run_id: str, suspension_id: int) -> StoredEvent | None:
        """The outbox row that carried the Notice of pause ``suspension_id``, whole (None: there is none,
        or it was pruned)."""
        async with self.db.connection() as con:
            r = await con.fetchrow("notice_of_pause", run_id, self.scope.app, self.scope.tenant, suspension_id)
        if r is None:
            return None
        return StoredEvent(
            id=r["id"],
            message_id=r["message_id"],
            routing_key=r["routing_key"],
            body=r["body"],
            correlation_id=r["correlation_id"],
            headers=_header_table(r["headers"]),
        )


def _header_table(raw: str | None) -> dict[str, str | int | float | bool]:
    # The outbox only ever stores scalars (the schema version, a traceparent); anything else is left out.
    decoded: object = json.loads(raw) if raw else {}
    if not isinstance(decoded, dict):
        return {}
    return {str(k): v for k, v in decoded.items() if isinstance(v, str | int | float | bool)}


@dataclass(frozen=True)
class RunOutboxRow:
    """One of a run's outbox rows as operators see it: where it goes and where it stands, not its body."""

    id: int
    message_id: str
    routing_key: str
    correlation_id: str | None
    headers: dict[str, str | int | float | bool]
    created_at: datetime
    sent_at: datetime | None
    attempts: int
    next_attempt_at: datetime | None
    quarantined_at: datetime | None
    last_error: str | None


@dataclass(frozen=True)
class StoredEvent:
    """An outbox row whole, to be published again exactly as it was written."""

    id: int
    message_id: str
    routing_key: str
    body: str
    correlation_id: str | None
    headers: dict[str, str | int | float | bool]
