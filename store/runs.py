"""Run writes: create, lease renewal and release, takeover, pause and end.

Every state change is one transaction that also writes what it causes: a pause writes the suspension, the
approval checkpoint, the run's move to paused (revision + 1), the removal of its progress and its Notice
in the outbox; an end writes the terminal state, its metadata event and its ``run.*`` event. Only the
holder of a live lease may pause or end a running run; anyone else gets RunLeaseLost and writes nothing.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field

from intermission.schemas.digest import digest
from intermission.schemas.errors import InvalidArgument, RunExists, RunLeaseLost, RunNotFound, RunNotReclaimable
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Message
from intermission.schemas.run import Lease, NewRun, Run, RunState
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import Continuation, Notice, PendingCall, Progress, SuspendReason, Suspension
from intermission.store import outbox, rows
from intermission.store.db import Conn, Database
from intermission.store.progress import save_progress_in

_END_STATES: dict[RunEventKind, RunState] = {
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


def _check_lease(lease: Lease) -> None:
    if not lease.is_set:
        raise RunLeaseLost("a lease needs both an owner and a ttl")


def check_new_run(new: NewRun, lease: Lease | None, first: Progress | None) -> None:
    if lease is not None:
        _check_lease(lease)
    if first is not None:
        if lease is None or first.owner != lease.owner:
            raise RunLeaseLost("the first progress snapshot must be owned by the lease owner")
        if first.run_id != new.run_id:
            raise InvalidArgument("the first progress snapshot is for another run")


def start_digest(scope: Scope, new: NewRun) -> str:
    """Binds a start request, so a repeated start is recognised and a different one is run_exists."""
    return digest({"scope": scope, "run": new})


class RunStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create_run(
        self, scope: Scope, new: NewRun, lease: Lease | None = None, first: Progress | None = None
    ) -> CreatedRun:
        """Create a run: running under ``lease`` (with its first snapshot) when one is given.

        The caller picks the run id. The identical start again returns the stored run with ``fresh``
        false and changes nothing; a different start under the same id is RunExists.
        """
        require_scope(scope)
        check_new_run(new, lease, first)
        async with self.db.transaction() as con:
            return await create_run_in(con, scope, new, lease, first)

    async def get_run(self, scope: Scope, run_id: str) -> Run:
        require_scope(scope)
        async with self.db.connection() as con:
            row = await con.fetchrow("get_run", run_id, scope.app, scope.tenant)
        if row is None:
            raise RunNotFound(f"no run {run_id} at scope {scope}")
        return rows.run_from_row(row)

    async def renew_lease(self, scope: Scope, run_id: str, lease: Lease) -> None:
        """Extend a live lease. A lease that lapsed or passed to someone else is RunLeaseLost: its holder
        must stop at once and write nothing more."""
        require_scope(scope)
        _check_lease(lease)
        async with self.db.connection() as con:
            expires = await con.fetchval("renew_lease", run_id, scope.app, scope.tenant, lease.owner, lease.ttl_seconds)
        if expires is None:
            raise RunLeaseLost(f"{lease.owner} no longer holds run {run_id}")

    async def release_lease(self, scope: Scope, run_id: str, owner: str) -> bool:
        """Let a held lease lapse now (a graceful stop), so another worker may take the run at once."""
        require_scope(scope)
        async with self.db.connection() as con:
            return await con.fetchval("release_lease", run_id, scope.app, scope.tenant, owner) is not None

    async def claim_continuation_leased(
        self, scope: Scope, run_id: str, lease: Lease, first: Progress | None = None
    ) -> Run:
        """Take over a running run whose lease lapsed, under ``lease``, writing ``first`` in the same
        transaction. The revision does not change."""
        require_scope(scope)
        _check_lease(lease)
        if first is not None and first.owner != lease.owner:
            raise RunLeaseLost("the first progress snapshot must be owned by the lease owner")
        if first is not None and first.run_id != run_id:
            raise InvalidArgument("the first progress snapshot is for another run")
        async with self.db.transaction() as con:
            row = await con.fetchrow(
                "claim_continuation_leased", run_id, scope.app, scope.tenant, lease.owner, lease.ttl_seconds
            )
            if row is None:
                if await con.fetchrow("get_run", run_id, scope.app, scope.tenant) is None:
                    raise RunNotFound(f"no run {run_id} at scope {scope}")
                raise RunNotReclaimable(f"run {run_id} is not running under a lapsed lease")
            if first is not None:
                await save_progress_in(con, scope, first)
            else:
                # The snapshot belongs to whoever holds the run: hand it over with the lease.
                await con.execute("adopt_progress", [run_id], lease.owner)
            return rows.run_from_row(row)

    async def reclaim_lapsed(self, lease: Lease, limit: int) -> list[Reclaimed]:
        """The reclaim sweep's cross-scope take: up to ``limit`` running runs whose lease lapsed, each under
        ``lease`` with its progress handed over, skipping runs another worker is taking right now."""
        _check_lease(lease)
        if limit < 1:
            raise InvalidArgument("limit must be at least 1")
        async with self.db.transaction() as con:
            taken = [
                rows.run_from_row(r) for r in await con.fetch("reclaim_lapsed", lease.owner, lease.ttl_seconds, limit)
            ]
            if not taken:
                return []
            adopted = {
                p.run_id: p
                for p in map(
                    rows.progress_from_row,
                    await con.fetch("adopt_progress", [run.id for run in taken], lease.owner),
                )
            }
        return [Reclaimed(run, adopted.get(run.id)) for run in taken]

    async def pause_run(
        self,
        scope: Scope,
        run_id: str,
        owner: str,
        pause: Pause,
        *,
        correlation_id: str | None = None,
    ) -> Paused:
        """Pause a running run held by ``owner``, in ONE transaction: the run moves to paused with its
        revision bumped and its lease cleared, any old pause is removed, the new suspension (and for an
        approval its checkpoint) is written, the progress is dropped and the Notice goes to the outbox."""
        require_scope(scope)
        if not pause.pending:
            raise InvalidArgument("a pause needs at least one pending call")
        if pause.ttl_seconds is not None and not (math.isfinite(pause.ttl_seconds) and pause.ttl_seconds >= 0):
            # NaN compares false both ways: unchecked it would read as "no deadline" below.
            raise InvalidArgument("a pause ttl must be a finite, non-negative number of seconds")
        async with self.db.transaction() as con:
            moved = await con.fetchrow(
                "pause_run",
                run_id,
                scope.app,
                scope.tenant,
                owner,
                pause.continuation.step_index,
                pause.continuation.tokens_used,
            )
            if moved is None:
                raise RunLeaseLost(f"{owner or 'an empty owner'} does not hold run {run_id}")
            ttl = pause.ttl_seconds if pause.ttl_seconds is not None else float(moved["pause_ttl_seconds"])
            if ttl < 0:
                raise InvalidArgument("a pause ttl must not be negative")
            await con.execute("delete_run_suspension", run_id)
            created = await con.fetchrow(
                "create_suspension",
                run_id,
                scope.app,
                scope.tenant,
                pause.reason.value,
                rows.dump_list(rows.PENDING, pause.pending),
                rows.dump(pause.continuation),
                None,
                ttl if ttl > 0 else None,
                None,
                pause.approvers,
            )
            assert created is not None  # the run row is ours: the pause_run update just matched it
            checkpoint_id: int | None = None
            if pause.reason is SuspendReason.APPROVAL:
                checkpoint_id = await con.fetchval(
                    "insert_checkpoint", run_id, created["id"], scope.app, scope.tenant, pause.approvers
                )
                await con.execute("set_suspension_checkpoint", created["id"], checkpoint_id)
            await con.execute("delete_run_progress", run_id)
            suspension = Suspension(
                id=created["id"],
                run_id=run_id,
                scope=scope,
                reason=pause.reason,
                pending=pause.pending,
                continuation=pause.continuation,
                expires_at=created["expires_at"],
                checkpoint_id=checkpoint_id,
                approvers=pause.approvers,
                created_at=created["created_at"],
            )
            notice = Notice(
                suspension_id=suspension.id,
                run_id=run_id,
                run_revision=moved["revision"],
                reason=pause.reason,
                pending=pause.pending,
                expires_at=suspension.expires_at,
                checkpoint_id=checkpoint_id,
                approvers=pause.approvers,
                scope=scope,
            )
            await _event(con, scope, run_id, "paused", moved["revision"], {"suspension_id": suspension.id})
            await outbox.write(con, outbox.notice_event(notice, correlation_id))
        return Paused(suspension, notice)

    async def end_run(
        self,
        scope: Scope,
        run_id: str,
        owner: str,
        kind: RunEventKind,
        *,
        output: str | None = None,
        error: str | None = None,
        correlation_id: str | None = None,
        own_messages: list[Message] | None = None,
        at_revision: int | None = None,
    ) -> RunEvent:
        """End a running run held by ``owner``, in ONE transaction with its metadata event and its
        ``run.<kind>`` event: progress and any pause are removed, undecided checkpoints are closed, and the
        run's OWN messages (never its loaded history) are appended to the session it started in.

        ``at_revision`` is the run's revision as the caller holds it: given, the end is first tried as ONE
        statement pinned to it (``end_run_at_once``: one round trip instead of nine); if that matches
        nothing (the lease is gone, or the revision is not the caller's), nothing was written and the
        step-by-step transaction below decides, as it always has."""
        require_scope(scope)
        state = _END_STATES.get(kind)
        if state is None:
            raise InvalidArgument(f"{kind.value} is not an end")
        if at_revision is not None:
            ended_at_once = await self._end_at_once(
                scope, run_id, owner, kind, state, output, error, correlation_id, own_messages, at_revision
            )
            if ended_at_once is not None:
                return ended_at_once
        async with self.db.transaction() as con:
            ended = await con.fetchrow("end_run", run_id, scope.app, scope.tenant, owner, state.value, output, error)
            if ended is None:
                raise RunLeaseLost(f"{owner or 'an empty owner'} does not hold run {run_id}")
            revision: int = ended["revision"]
            if own_messages:
                await con.execute(
                    "append_session",
                    scope.app,
                    scope.tenant,
                    ended["session_id"],
                    run_id,
                    rows.dump_list(rows.MESSAGES, own_messages),
                )
            await con.execute("delete_run_progress", run_id)
            await con.execute("delete_run_suspension", run_id)
            await con.execute("close_pending_checkpoints", run_id, "rejected", error or kind.value)
            event = RunEvent(kind=kind, run_id=run_id, revision=revision, scope=scope, output=output, error=error)
            await _event(con, scope, run_id, kind.value, revision, {"output": output, "error": error})
            await outbox.write(con, outbox.run_event(event, correlation_id))
        return event

    async def _end_at_once(
        self,
        scope: Scope,
        run_id: str,
        owner: str,
        kind: RunEventKind,
        state: RunState,
        output: str | None,
        error: str | None,
        correlation_id: str | None,
        own_messages: list[Message] | None,
        revision: int,
    ) -> RunEvent | None:
        """``end_run`` as one statement; None when it matched nothing (and so wrote nothing)."""
        event = RunEvent(kind=kind, run_id=run_id, revision=revision + 1, scope=scope, output=output, error=error)
        announced = outbox.run_event(event, correlation_id)
        # Encoded before the statement, like the step-by-step path: a message that cannot be stored
        # (U+0000) is refused here, typed, with nothing written.
        messages = rows.dump_list(rows.MESSAGES, own_messages) if own_messages else None
        async with self.db.connection() as con:
            ended = await con.fetchval(
                "end_run_at_once",
                run_id,
                scope.app,
                scope.tenant,
                owner,
                state.value,
                output,
                error,
                revision,
                messages,
                error or kind.value,
                uuid.uuid4(),
                kind.value,
                json.dumps({"output": output, "error": error}),
                *outbox.columns(announced),
            )
        return event if ended is not None else None

    async def list_run_events(self, scope: Scope, run_id: str) -> list[dict[str, object]]:
        require_scope(scope)
        async with self.db.connection() as con:
            found = await con.fetch("list_run_events", run_id, scope.app, scope.tenant)
        return [
            {
                "event_id": r["event_id"],
                "kind": r["kind"],
                "revision": r["revision"],
                "data": json.loads(r["data"]),
            }
            for r in found
        ]


async def _event(con: Conn, scope: Scope, run_id: str, kind: str, revision: int, data: dict[str, object]) -> None:
    await con.execute(
        "insert_run_event", uuid.uuid4(), run_id, scope.app, scope.tenant, kind, revision, json.dumps(data)
    )


async def create_run_in(
    con: Conn, scope: Scope, new: NewRun, lease: Lease | None = None, first: Progress | None = None
) -> CreatedRun:
    """``RunStore.create_run`` inside a transaction the caller holds."""
    require_scope(scope)
    check_new_run(new, lease, first)
    wanted = start_digest(scope, new)
    row = await con.fetchrow(
        "create_run",
        new.run_id,
        scope.app,
        scope.tenant,
        new.agent_id,
        new.input,
        rows.dump(new.config),
        None if new.script is None else rows.dump_list(rows.SCRIPT, new.script),
        new.pause_ttl_seconds,
        new.session_id or new.run_id,
        wanted,
        lease.owner if lease is not None else None,
        lease.ttl_seconds if lease is not None else None,
    )
    if row is None:
        existing = await con.fetchrow("run_start_digest", new.run_id)
        if (
            existing is None
            or existing["start_digest"] != wanted
            or (existing["app"], existing["tenant"]) != (scope.app, scope.tenant)
        ):
            raise RunExists(f"run id {new.run_id} holds a different run")
        stored = await con.fetchrow("get_run", new.run_id, scope.app, scope.tenant)
        assert stored is not None
        return CreatedRun(rows.run_from_row(stored), fresh=False)
    if first is not None:
        await save_progress_in(con, scope, first)
    return CreatedRun(rows.run_from_row(row), fresh=True)
