"""ONE conformance suite for the engine's committers: every case runs against the in-memory committer
(``tests/unit/test_conformance_memory.py``) and against PostgreSQL (``tests/integration/
test_conformance_postgres.py``), so the fake can never drift from the real thing.

A case is a plain async function of a ``World``: an engine (holding no lease, with a ``CollectedEvents``
sink attached, so the events each commit hands over are kept) and the few things a case needs besides the
engine, which both sides implement: every row of a table, an operator's quota, a relay's quarantine, time
passing. A case applies transitions and operations through the engine and asserts their results, their
refusals, the rows they leave and the events their commits write, as the worker's one encoder built them
(``engine/events.py``): an event body stored or handed over must be the very bytes the transition built.

The PostgreSQL module also runs each case over a fresh in-memory world and compares the two row for row:
the output rows of every transition (``Recording``) and every table's rows at the end (``dump``), with
what differs by nature (timestamps, random ids) masked (``shape``).

A case uses fixed ids ("r1", "m-1") in fresh worlds, takes time to pass only where a deadline must (a
lease is let go with a release, a deadline moved to now), and never races: nothing here says anything of
concurrency, crashes or the broker.
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, Protocol, TypeVar

import pytest

from intermission.engine.claims import CLAIM, ClaimedPause, ClaimPause, ClaimWhole, Decided
from intermission.engine.commands import Cancel, Claimed, Decide, Expire, Reply, Resume, StaleExpiry
from intermission.engine.committer import Batch, Committer, Outs
from intermission.engine.core import Engine
from intermission.engine.holding import Reclaimed, ReclaimLapsed, ReleaseLease, TakeOverRun, Unreadable
from intermission.engine.memory import InMemoryCommitter, InMemoryLeaseLine, jsonb, memory_engine
from intermission.engine.outbox import RetryQuarantined
from intermission.engine.pauses import CreatePause, DeletePause, DeleteProgress, MoveDeadline
from intermission.engine.replies import AdmitResume, CloseResume, ExpireAdmission, ReadEvidence, StartResume
from intermission.engine.runs import (
    END,
    DrawPauseKeys,
    EndingRequested,
    EndRun,
    Pause,
    Paused,
    PauseRun,
    ReadSession,
    RequestEnding,
    SaveProgress,
)
from intermission.engine.sink import CollectedEvents
from intermission.engine.starts import START, CreatedRun, Quota, StartRun
from intermission.fleet.lease import LeaseLine
from intermission.schemas.answers import reply_progress
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    ToolAnswer,
)
from intermission.schemas.errors import (
    Forbidden,
    InvalidContinuation,
    InvalidState,
    MessageIdConflict,
    NotAgentReplyResumable,
    NotSuspended,
    QuotaExceeded,
    ResumeAdmissionConflict,
    ResumeAdmissionNotFound,
    ResumeAlreadyStarted,
    RunConflict,
    RunExists,
    RunLeaseLost,
    RunNotFound,
    RunNotReclaimable,
    SuspensionExists,
    SuspensionExpired,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Message, Role, ToolCall
from intermission.schemas.resume import ResumeAdmissionRequest, ResumeClosureRequest
from intermission.schemas.run import Ending, EndingKind, Lease, NewRun, Run, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import (
    ClaimVersion,
    Continuation,
    PendingCall,
    Progress,
    ProgressResult,
    SuspendReason,
    Suspension,
)
from intermission.store import rows
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.store.leases import HeldRun, Renewed
from intermission.wire import notice_key, run_event_key

T = TypeVar("T")
Row = dict[str, Any]

SCOPE = Scope(app="acme", tenant="t1")
OTHER = Scope(app="acme", tenant="t2")
OWNER = "worker-1"
LEASE = Lease(owner=OWNER, ttl_seconds=30)
RIVAL = Lease(owner="worker-2", ttl_seconds=30)
# Far enough ahead that LEAST(expired_by, now()) is the database clock.
FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)


# --- the world a case runs in ---------------------------------------------------------------------------


class World(Protocol):
    """What a case is given: the engine under test and what it needs besides (see the module docstring)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def sink(self) -> CollectedEvents: ...

    async def table(self, name: str) -> list[Row]:
        """Every row of table ``name``, each a dict of its columns."""
        ...

    async def set_quota(self, scope: Scope, live_runs: int | None, starts_per_second: float | None) -> None:
        """A scope's own quotas, as an operator sets them (``intermission quotas set``)."""
        ...

    async def quarantine(self, outbox_id: int) -> None:
        """Set an outbox row aside, as a relay does with one the broker keeps refusing."""
        ...

    async def later(self, seconds: float) -> None:
        """Let ``seconds`` pass on the store's clock."""
        ...

    async def spoil(self, table: str, scope: Scope, run_id: str, column: str, value: str) -> None:
        """Rewrite a run's jsonb ``column`` in ``table`` behind the store's back (what only a bug or a hand
        does): a stored row a transition must then refuse to hand over."""
        ...

    def lease_line(self) -> LeaseLine:
        """A lease keeper's line over the world's store (the caller closes it): renewals run outside the
        committer, in a statement of their own."""
        ...


# The tables a comparison of two worlds dumps, each with the columns its rows are ordered by.
TABLES: dict[str, tuple[str, ...]] = {
    "runs": ("app", "tenant", "id"),
    "suspensions": ("id",),
    "checkpoints": ("id",),
    "progress": ("app", "tenant", "run_id"),
    "run_events": ("id",),
    "outbox": ("id",),
    "inbox": ("app", "tenant", "message_id"),
    "session_messages": ("id",),
    "resume_admissions": ("app", "tenant", "run_id", "suspension_id"),
    "resume_starts": ("app", "tenant", "run_id", "suspension_id"),
    "resume_expiries": ("app", "tenant", "run_id", "suspension_id"),
    "resume_closures": ("app", "tenant", "run_id", "suspension_id"),
    "scope_quotas": ("app", "tenant"),
}


def ordered(name: str, found: Sequence[Mapping[str, Any]]) -> list[Row]:
    """``found``'s rows as dicts, in the order of the table's key (Python's order, not a collation's)."""
    key = TABLES[name]
    return sorted((dict(row) for row in found), key=lambda row: tuple(row[column] for column in key))


class MemoryWorld:
    """The world over the in-memory committer."""

    def __init__(
        self, committer: Committer | None = None, memory: InMemoryCommitter | None = None, **options: Any
    ) -> None:
        # ``committer``: what the engine commits through, over ``memory`` (a recording of it, say);
        # ``options``: the engine's (an observer, a lease).
        self.memory = memory or InMemoryCommitter()
        self.engine = memory_engine(self.memory, **options) if committer is None else Engine(committer, **options)
        self.sink = CollectedEvents()
        self.engine.hand_events_to(self.sink)

    async def table(self, name: str) -> list[Row]:
        return ordered(name, list(getattr(self.memory.tables, name).values()))

    async def set_quota(self, scope: Scope, live_runs: int | None, starts_per_second: float | None) -> None:
        self.memory.set_quota(scope.app, scope.tenant, live_runs, starts_per_second)

    async def quarantine(self, outbox_id: int) -> None:
        self.memory.quarantine(outbox_id)

    async def later(self, seconds: float) -> None:
        self.memory.clock.advance(seconds)

    async def spoil(self, table: str, scope: Scope, run_id: str, column: str, value: str) -> None:
        rows_of: dict[Any, Row] = getattr(self.memory.tables, table)
        key_column = "id" if table == "runs" else "run_id"
        for key, row in list(rows_of.items()):
            if (row["app"], row["tenant"], row[key_column]) == (scope.app, scope.tenant, run_id):
                rows_of[key] = {**row, column: jsonb(value)}

    def lease_line(self) -> InMemoryLeaseLine:
        return InMemoryLeaseLine(self.memory)


def forbid_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any connection or name lookup fail at once: the fast tier does no I/O, and a test of it that
    reached for a server would otherwise wait for a timeout, or pass against one that happens to run."""

    def refused(*args: object, **kwargs: object) -> Any:
        raise AssertionError("the unit tier opens no connection (a test reached for the network)")

    monkeypatch.setattr(socket.socket, "connect", refused)
    monkeypatch.setattr(socket.socket, "connect_ex", refused)
    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(socket, "getaddrinfo", refused)


# --- what a case reads through the world --------------------------------------------------------------


def _of(row: Mapping[str, Any], scope: Scope, run_id: str, column: str = "run_id") -> bool:
    return (row["app"], row["tenant"], row[column]) == (scope.app, scope.tenant, run_id)


async def run_row(world: World, scope: Scope, run_id: str) -> Row | None:
    return next((r for r in await world.table("runs") if _of(r, scope, run_id, "id")), None)


async def stored_run(world: World, scope: Scope, run_id: str) -> Run | None:
    row = await run_row(world, scope, run_id)
    return rows.run_from_row(row) if row is not None else None


async def stored_pause(world: World, scope: Scope, run_id: str) -> Suspension | None:
    row = next((r for r in await world.table("suspensions") if _of(r, scope, run_id)), None)
    return rows.suspension_from_row(row) if row is not None else None


async def stored_progress(world: World, scope: Scope, run_id: str) -> Progress | None:
    row = next((r for r in await world.table("progress") if _of(r, scope, run_id)), None)
    return rows.progress_from_row(row) if row is not None else None


async def outbox_of(world: World, scope: Scope, run_id: str) -> list[Row]:
    return [r for r in await world.table("outbox") if _of(r, scope, run_id)]


class Noted(NamedTuple):
    """A run_events row: what a change of the run noted on its record."""

    kind: str
    revision: int
    data: dict[str, Any]


async def noted(world: World, scope: Scope, run_id: str) -> list[Noted]:
    return [
        Noted(r["kind"], r["revision"], json.loads(r["data"]))
        for r in await world.table("run_events")
        if _of(r, scope, run_id)
    ]


async def inbox_of(world: World, scope: Scope, message_id: str) -> Row | None:
    return next(
        (
            r
            for r in await world.table("inbox")
            if (r["app"], r["tenant"], r["message_id"]) == (*scope_of(scope), message_id)
        ),
        None,
    )


async def checkpoint_row(world: World, checkpoint_id: int) -> Row | None:
    return next((r for r in await world.table("checkpoints") if r["id"] == checkpoint_id), None)


def scope_of(scope: Scope) -> tuple[str, str]:
    return (scope.app, scope.tenant)


def published(row: Mapping[str, Any]) -> tuple[uuid.UUID, str, str, str | None, dict[str, Any]]:
    """An outbox row as the event it publishes: message_id, routing key, body, correlation id, headers."""
    return (
        uuid.UUID(str(row["message_id"])),
        row["routing_key"],
        row["body"],
        row["correlation_id"],
        json.loads(row["headers"]),
    )


def handed(world: World, run_id: str) -> list[tuple[Any, ...]]:
    """The events the engine handed to the sink for a run (its commits'), as published."""
    return [
        (e.message_id, e.routing_key, e.body, e.correlation_id, dict(e.headers))
        for e in world.sink.events
        if json.loads(e.body).get("run_id") == run_id
    ]


async def assert_events(world: World, scope: Scope, run_id: str, bodies: list[str]) -> None:
    """The run's outbox holds exactly the events ``bodies`` (in order), each also handed to the sink with the
    same message id, body and headers, and held for it (migration 0009: the sink publishes it first)."""
    stored = await outbox_of(world, scope, run_id)
    assert [r["body"] for r in stored] == bodies
    assert [published(r) for r in stored] == handed(world, run_id)
    assert all(r["next_attempt_at"] is not None for r in stored)


# --- the runs a case starts from ------------------------------------------------------------------------


def receipt(message_id: str, routing_key: str = "run.start", digest: str = "d" * 64, scope: Scope = SCOPE) -> Receipt:
    return Receipt(scope=scope, message_id=message_id, routing_key=routing_key, body_digest=digest)


def snapshot(run_id: str, owner: str = OWNER, *, step: int = 0, tokens: int = 0, **changes: Any) -> Progress:
    return Progress(
        run_id=run_id,
        owner=owner,
        continuation=Continuation(step_index=step, tokens_used=tokens, session_id=f"s-{run_id}"),
        **changes,
    )


def new_run(run_id: str = "r1", **changes: Any) -> NewRun:
    fields: dict[str, Any] = {"run_id": run_id, "agent_id": "demo", "input": "hi", "session_id": f"s-{run_id}"}
    return NewRun(**(fields | changes))


async def start(
    world: World,
    run_id: str = "r1",
    *,
    scope: Scope = SCOPE,
    lease: Lease | None = LEASE,
    via: Receipt | None = None,
    quota: Quota | None = None,
    **changes: Any,
) -> CreatedRun:
    first = snapshot(run_id, lease.owner) if lease is not None else None
    return await world.engine.apply(StartRun(scope, new_run(run_id, **changes), lease, first, via, quota or Quota()))


def pending(reason: SuspendReason) -> list[PendingCall]:
    reply_with = "ask-1" if reason is SuspendReason.AGENT_REPLY else ""
    return [PendingCall(id="c1", name="lookup", arguments='{"query": "q"}', reply_with=reply_with)]


def pause_of(
    reason: SuspendReason = SuspendReason.EXTERNAL_TOOL, *, ttl: float | None = None, approvers: list[str] | None = None
) -> Pause:
    return Pause(
        reason=reason,
        pending=pending(reason),
        continuation=Continuation(
            messages=[Message(role=Role.USER, content="look this up")],
            step_index=1,
            tokens_used=7,
            session_id="s-r1",
            prepared=b"\x00\x01opaque\xff",
        ),
        approvers=approvers or [],
        ttl_seconds=ttl,
    )


async def paused(
    world: World,
    run_id: str = "r1",
    reason: SuspendReason = SuspendReason.EXTERNAL_TOOL,
    *,
    ttl: float | None = None,
    approvers: list[str] | None = None,
) -> Paused:
    run = (await start(world, run_id)).run
    return await world.engine.apply(PauseRun(run, OWNER, pause_of(reason, ttl=ttl, approvers=approvers)))


def pin(p: Paused) -> ClaimVersion:
    return ClaimVersion(run_id=p.suspension.run_id, suspension_id=p.suspension.id, run_revision=p.notice.run_revision)


def leased(world: World, lease: Lease = LEASE) -> Engine:
    """The world's engine under a worker's lease: what commands are applied with."""
    return world.engine.under(lease=lease)


def resumed_body(run_id: str, revision: int, scope: Scope = SCOPE) -> str:
    return RunEvent(kind=RunEventKind.RESUMED, run_id=run_id, revision=revision, scope=scope).model_dump_json()


async def refused(work: Awaitable[Any], error: type[BaseException]) -> BaseException:
    with pytest.raises(error) as caught:
        await work
    return caught.value


# === the cases ==============================================================================================

# --- starts ---------------------------------------------------------------------------------------------


async def start_creates_a_run_under_its_lease_with_its_first_snapshot_and_inbox_record(world: World) -> None:
    via = receipt("m-start")
    created = await start(world, via=via)
    run = created.run
    assert created.fresh
    assert (run.id, run.scope, run.state, run.revision, run.lease_owner) == ("r1", SCOPE, RunState.RUNNING, 0, OWNER)
    assert run.lease_expires_at is not None
    assert run.created_at is not None
    assert run.lease_expires_at - run.created_at == timedelta(seconds=30)
    assert await stored_run(world, SCOPE, "r1") == run
    progress = await stored_progress(world, SCOPE, "r1")
    assert progress is not None
    assert (progress.owner, progress.continuation, progress.done) == (OWNER, snapshot("r1").continuation, [])
    recorded = await inbox_of(world, SCOPE, "m-start")
    assert recorded is not None
    assert (recorded["routing_key"], recorded["body_digest"], recorded["outcome"], recorded["run_id"]) == (
        "run.start",
        via.body_digest,
        "applied",
        "r1",
    )
    # A start announces nothing: its worker runs the run.
    assert await outbox_of(world, SCOPE, "r1") == []
    assert await noted(world, SCOPE, "r1") == []
    assert world.sink.events == []


async def start_without_a_lease_creates_the_run_and_no_snapshot(world: World) -> None:
    created = await start(world, lease=None)
    assert (created.run.state, created.run.lease_owner, created.run.lease_expires_at) == (RunState.CREATED, None, None)
    assert await stored_progress(world, SCOPE, "r1") is None


async def start_again_is_a_no_op_and_another_start_under_the_id_is_run_exists(world: World) -> None:
    first = await start(world)
    again = await start(world)
    assert not again.fresh
    assert again.run == first.run
    await refused(start(world, input="something else"), RunExists)
    # Refused with its receipt: nothing of it stays, not even the inbox record.
    await refused(start(world, input="something else", via=receipt("m-other")), RunExists)
    assert await inbox_of(world, SCOPE, "m-other") is None
    # Another scope's "r1" is another run.
    elsewhere = await start(world, scope=OTHER, lease=RIVAL)
    assert elsewhere.fresh
    assert (elsewhere.run.scope, elsewhere.run.lease_owner) == (OTHER, RIVAL.owner)
    assert (await stored_run(world, SCOPE, "r1")) == first.run


async def start_with_a_recorded_message_id_is_a_duplicate_or_a_conflict(world: World) -> None:
    via = receipt("m-1")
    await start(world, via=via)
    await refused(start(world, "r2", via=via), AlreadyApplied)
    await refused(start(world, "r3", via=receipt("m-1", digest="e" * 64)), MessageIdConflict)
    assert await run_row(world, SCOPE, "r2") is None
    assert await run_row(world, SCOPE, "r3") is None
    # A message_id is a key within its scope: another scope's m-1 is another command.
    assert (await start(world, "r2", scope=OTHER, via=receipt("m-1", scope=OTHER))).fresh


async def start_within_a_scope_s_live_run_quota(world: World) -> None:
    via = receipt("m-1")
    await world.set_quota(SCOPE, 1, None)
    await start(world, via=via)
    await refused(start(world, "r2", via=receipt("m-2")), QuotaExceeded)
    # Refused by its quota: nothing written, not even its inbox record.
    assert await run_row(world, SCOPE, "r2") is None
    assert await inbox_of(world, SCOPE, "m-2") is None
    # A command recorded already is answered as before, never refused by the quota.
    await refused(start(world, via=via), AlreadyApplied)
    # The quota is the scope's own.
    assert (await start(world, "r2", scope=OTHER)).fresh


async def start_within_the_fleet_s_default_start_rate(world: World) -> None:
    rate = Quota(starts_per_second=1.0)
    assert (await start(world, quota=rate)).fresh
    # The bucket held one start; the next within the second is refused.
    await refused(start(world, "r2", quota=rate), QuotaExceeded)
    assert await run_row(world, SCOPE, "r2") is None
    # A scope's own quota of 0 lifts the default.
    await world.set_quota(SCOPE, None, 0)
    assert (await start(world, "r2", quota=rate)).fresh


# --- step saves --------------------------------------------------------------------------------------------


async def save_by_the_holder_writes_the_snapshot_and_the_run_s_counts(world: World) -> None:
    run = (await start(world)).run
    asked = snapshot("r1", step=3, tokens=99, done=[ProgressResult(call_id="c1", content="x")])
    saved = await world.engine.apply(SaveProgress(SCOPE, asked))
    assert (saved.scope, saved.ending, saved.done) == (SCOPE, None, asked.done)
    assert saved.updated_at is not None
    assert await stored_progress(world, SCOPE, "r1") == saved
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["step_count"], row["tokens_used"], row["revision"]) == (3, 99, 0)
    # A save is no state change: the run's revision and time stay.
    assert row["updated_at"] == run.updated_at


async def save_by_anyone_but_the_live_holder_is_refused_and_writes_nothing(world: World) -> None:
    await start(world)
    first = await stored_progress(world, SCOPE, "r1")
    await refused(world.engine.apply(SaveProgress(SCOPE, snapshot("r1", RIVAL.owner, step=5))), RunLeaseLost)
    await refused(world.engine.apply(SaveProgress(OTHER, snapshot("r1", step=5))), RunLeaseLost)
    assert await world.engine.apply(ReleaseLease(SCOPE, "r1", OWNER))
    await refused(world.engine.apply(SaveProgress(SCOPE, snapshot("r1", step=5))), RunLeaseLost)
    assert await stored_progress(world, SCOPE, "r1") == first
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert row["step_count"] == 0


async def save_hands_over_the_ending_asked_of_the_run(world: World) -> None:
    await start(world)
    ending = Ending(kind=EndingKind.CANCEL, reason="stop")
    assert await world.engine.apply(RequestEnding(SCOPE, "r1", ending)) == "requested"
    saved = await world.engine.apply(SaveProgress(SCOPE, snapshot("r1", step=2)))
    assert saved.ending == ending
    # No snapshot takes an ending back.
    stored = await stored_progress(world, SCOPE, "r1")
    assert stored is not None
    assert stored.ending == ending


# --- pauses ---------------------------------------------------------------------------------------------


async def pause_writes_the_pause_drops_the_snapshot_and_announces_its_notice(world: World) -> None:
    result = await paused(world)
    pause, notice = result.suspension, result.notice
    assert (notice.run_id, notice.run_revision, notice.suspension_id, notice.expires_at) == ("r1", 1, pause.id, None)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["revision"], row["lease_owner"], row["lease_expires_at"]) == ("paused", 1, None, None)
    assert (row["step_count"], row["tokens_used"]) == (1, 7)
    assert await stored_pause(world, SCOPE, "r1") == pause
    assert await stored_progress(world, SCOPE, "r1") is None
    assert await noted(world, SCOPE, "r1") == [Noted("paused", 1, {"suspension_id": pause.id})]
    await assert_events(world, SCOPE, "r1", [notice.model_dump_json()])
    [stored] = await outbox_of(world, SCOPE, "r1")
    assert stored["routing_key"] == notice_key(SuspendReason.EXTERNAL_TOOL, SCOPE)


async def an_approval_pause_writes_its_pending_checkpoint(world: World) -> None:
    result = await paused(world, reason=SuspendReason.APPROVAL, approvers=["alice"])
    checkpoint_id = result.notice.checkpoint_id
    assert checkpoint_id is not None
    assert result.suspension.checkpoint_id == checkpoint_id
    checkpoint = await checkpoint_row(world, checkpoint_id)
    assert checkpoint is not None
    assert (checkpoint["state"], checkpoint["approvers"], checkpoint["suspension_id"], checkpoint["run_id"]) == (
        "pending",
        ["alice"],
        result.suspension.id,
        "r1",
    )
    await assert_events(world, SCOPE, "r1", [result.notice.model_dump_json()])


async def a_pause_with_a_deadline_counts_it_from_the_database_clock(world: World) -> None:
    drawn = await world.engine.apply(DrawPauseKeys(False))
    result = await paused(world, ttl=60)
    expires_at = result.notice.expires_at
    assert expires_at is not None
    assert expires_at - drawn.db_now >= timedelta(seconds=60)
    assert result.suspension.expires_at == expires_at
    stored = await stored_pause(world, SCOPE, "r1")
    assert stored is not None
    assert stored.expires_at == expires_at


async def a_pause_by_anyone_but_the_holder_at_its_revision_is_refused(world: World) -> None:
    run = (await start(world)).run
    await refused(world.engine.apply(PauseRun(run, RIVAL.owner, pause_of())), RunLeaseLost)
    await refused(world.engine.apply(PauseRun(run.model_copy(update={"revision": 5}), OWNER, pause_of())), InvalidState)
    ending = Ending(kind=EndingKind.CANCEL, reason="stop")
    await world.engine.apply(RequestEnding(SCOPE, "r1", ending))
    asked = await refused(world.engine.apply(PauseRun(run, OWNER, pause_of())), EndingRequested)
    assert isinstance(asked, EndingRequested)
    assert asked.ending == ending
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["revision"], row["lease_owner"]) == ("running", 0, OWNER)
    assert await stored_pause(world, SCOPE, "r1") is None
    assert await stored_progress(world, SCOPE, "r1") is not None
    assert await outbox_of(world, SCOPE, "r1") == []
    assert world.sink.events == []


async def draws_hand_out_increasing_ids_and_the_database_clock(world: World) -> None:
    plain = await world.engine.apply(DrawPauseKeys(False))
    approval = await world.engine.apply(DrawPauseKeys(True))
    assert plain.checkpoint_id is None
    assert approval.checkpoint_id is not None
    assert approval.suspension_id > plain.suspension_id
    assert approval.db_now >= plain.db_now
    assert plain.db_now.tzinfo is not None


# --- ends -----------------------------------------------------------------------------------------------


async def an_end_ends_the_run_saves_its_own_messages_and_announces_it(world: World) -> None:
    await start(world)
    own = [Message(role=Role.ASSISTANT, content="done")]
    end = EndRun(
        SCOPE,
        "r1",
        OWNER,
        0,
        RunEventKind.COMPLETED,
        output="the answer",
        correlation_id="corr-1",
        own_messages=own,
        counts=Continuation(step_index=2, tokens_used=11),
    )
    event = await world.engine.apply(end)
    assert event == RunEvent(kind=RunEventKind.COMPLETED, run_id="r1", revision=1, scope=SCOPE, output="the answer")
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["revision"], row["output"], row["error"], row["lease_owner"]) == (
        "completed",
        1,
        "the answer",
        None,
        None,
    )
    assert (row["step_count"], row["tokens_used"]) == (2, 11)
    assert row["ended_at"] is not None
    assert await stored_progress(world, SCOPE, "r1") is None
    assert await noted(world, SCOPE, "r1") == [Noted("completed", 1, {"output": "the answer", "error": None})]
    await assert_events(world, SCOPE, "r1", [end.event.body])
    [stored] = await outbox_of(world, SCOPE, "r1")
    assert (stored["routing_key"], stored["correlation_id"]) == (run_event_key(RunEventKind.COMPLETED, SCOPE), "corr-1")
    assert await world.engine.apply(ReadSession(SCOPE, "s-r1", 10)) == own


async def an_end_by_anyone_but_the_holder_at_its_revision_is_refused(world: World) -> None:
    await start(world)
    await refused(world.engine.apply(EndRun(SCOPE, "r1", RIVAL.owner, 0, RunEventKind.COMPLETED)), RunLeaseLost)
    await refused(world.engine.apply(EndRun(SCOPE, "r1", OWNER, 3, RunEventKind.COMPLETED)), InvalidState)
    await refused(world.engine.apply(EndRun(OTHER, "r1", OWNER, 0, RunEventKind.COMPLETED)), RunLeaseLost)
    ending = Ending(kind=EndingKind.CANCEL, reason="stop")
    await world.engine.apply(RequestEnding(SCOPE, "r1", ending))
    await refused(world.engine.apply(EndRun(SCOPE, "r1", OWNER, 0, RunEventKind.FAILED, error="e")), EndingRequested)
    assert await outbox_of(world, SCOPE, "r1") == []
    # The end asked of it is the one end it may take.
    cancelled = EndRun(SCOPE, "r1", OWNER, 0, RunEventKind.CANCELLED, error="stop")
    await world.engine.apply(cancelled)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["ending"]) == ("cancelled", None)
    await assert_events(world, SCOPE, "r1", [cancelled.event.body])
    # Ended: nobody holds it any more.
    await refused(world.engine.apply(EndRun(SCOPE, "r1", OWNER, 1, RunEventKind.COMPLETED)), RunLeaseLost)


async def an_end_closes_the_run_s_undecided_checkpoints(world: World) -> None:
    result = await paused(world, reason=SuspendReason.APPROVAL)
    claimed = await leased(world).apply(Cancel(CancelCommand(scope=SCOPE, run_id="r1", reason="no")))
    assert claimed is not None
    assert claimed.progress.ending == Ending(kind=EndingKind.CANCEL, reason="no")
    await world.engine.apply(EndRun(SCOPE, "r1", OWNER, claimed.run.revision, RunEventKind.CANCELLED, error="no"))
    assert result.notice.checkpoint_id is not None
    checkpoint = await checkpoint_row(world, result.notice.checkpoint_id)
    assert checkpoint is not None
    assert (checkpoint["state"], checkpoint["reason"]) == ("rejected", "no")
    assert checkpoint["decided_at"] is not None
    assert await stored_pause(world, SCOPE, "r1") is None


# --- cancels --------------------------------------------------------------------------------------------


async def an_ending_is_asked_only_of_a_running_run_held_under_a_lease(world: World) -> None:
    ending = Ending(kind=EndingKind.CANCEL, reason="stop")
    await start(world)
    assert await world.engine.apply(RequestEnding(SCOPE, "r1", ending)) == "requested"
    assert await world.engine.apply(RequestEnding(SCOPE, "r1", ending, receipt("m-2", "run.cancel"))) == "ending_before"
    # Asked before: the command is recorded, and its redelivery is a duplicate.
    await refused(world.engine.apply(RequestEnding(SCOPE, "r1", ending, receipt("m-2", "run.cancel"))), AlreadyApplied)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert rows.load_model(Ending, row["ending"], "ending") == ending
    await paused(world, "r2")
    assert await world.engine.apply(RequestEnding(SCOPE, "r2", ending, receipt("m-3", "run.cancel"))) == "not_running"
    assert await inbox_of(world, SCOPE, "m-3") is None
    # A run claimed without a lease (the original's plain claim): nobody here could end it.
    await world.engine.apply(ClaimWhole(SCOPE, "r2"))
    assert await world.engine.apply(RequestEnding(SCOPE, "r2", ending)) == "not_leased"
    assert await world.engine.apply(RequestEnding(SCOPE, "nobody", ending)) == "not_running"


async def a_cancel_claims_a_paused_run_and_asks_a_running_one_to_end(world: World) -> None:
    await paused(world, "r1")
    await start(world, "r2")
    worker = leased(world)
    claimed = await worker.apply(
        Cancel(CancelCommand(scope=SCOPE, run_id="r1", reason="no"), receipt("m-1", "run.cancel"))
    )
    assert claimed is not None
    assert (claimed.run.state, claimed.run.revision, claimed.run.lease_owner) == (RunState.RUNNING, 2, OWNER)
    assert await stored_pause(world, SCOPE, "r1") is None
    # A cancel's claim ends the run: it announces no resume.
    assert len(await outbox_of(world, SCOPE, "r1")) == 1
    assert await worker.apply(Cancel(CancelCommand(scope=SCOPE, run_id="r2", reason="no"))) is None
    row = await run_row(world, SCOPE, "r2")
    assert row is not None
    assert row["ending"] is not None
    await refused(worker.apply(Cancel(CancelCommand(scope=SCOPE, run_id="nobody"))), NotSuspended)
    await world.engine.apply(EndRun(SCOPE, "r2", OWNER, 0, RunEventKind.CANCELLED, error="no"))
    await refused(worker.apply(Cancel(CancelCommand(scope=SCOPE, run_id="r2"))), InvalidState)


# --- claims ---------------------------------------------------------------------------------------------


def answer(p: Paused, content: str = "42") -> ResumeCommand:
    return ResumeCommand(scope=SCOPE, version=pin(p), results=[ToolAnswer(call_id="c1", content=content)])


async def a_resume_claims_its_pause_under_the_worker_s_lease_and_announces_it(world: World) -> None:
    p = await paused(world)
    via = receipt("m-resume", "run.resume")
    claimed = await leased(world).apply(Resume(answer(p), receipt=via, correlation_id="corr-1"))
    assert isinstance(claimed, Claimed)
    run, progress = claimed.run, claimed.progress
    assert (run.state, run.revision, run.lease_owner, claimed.suspension) == (RunState.RUNNING, 2, OWNER, p.suspension)
    assert run.lease_expires_at is not None
    assert progress.done == [ProgressResult(call_id="c1", content="42")]
    assert progress.continuation == p.suspension.continuation
    assert await stored_progress(world, SCOPE, "r1") == progress
    stored = await stored_run(world, SCOPE, "r1")
    assert stored is not None
    assert (stored.state, stored.revision, stored.lease_expires_at, stored.updated_at) == (
        RunState.RUNNING,
        2,
        run.lease_expires_at,
        run.updated_at,
    )
    assert await stored_pause(world, SCOPE, "r1") is None
    recorded = await inbox_of(world, SCOPE, "m-resume")
    assert recorded is not None
    assert recorded["outcome"] == "applied"
    await assert_events(world, SCOPE, "r1", [p.notice.model_dump_json(), resumed_body("r1", 2)])
    # Delivered again: its effect committed before.
    await refused(leased(world).apply(Resume(answer(p), receipt=via)), AlreadyApplied)
    assert len(await outbox_of(world, SCOPE, "r1")) == 2


async def a_claim_pinned_to_another_pause_or_revision_is_refused_and_writes_nothing(world: World) -> None:
    p = await paused(world)
    worker = leased(world)
    stale = answer(p).model_copy(update={"version": pin(p).model_copy(update={"run_revision": 0})})
    await refused(worker.apply(Resume(stale, receipt=receipt("m-1", "run.resume"))), RunConflict)
    other = answer(p).model_copy(update={"version": pin(p).model_copy(update={"suspension_id": p.suspension.id + 7})})
    await refused(worker.apply(Resume(other)), RunConflict)
    # The claim itself, pinned to a revision the run is not at, finds why under the lock.
    refusal = await refused(
        world.engine.apply(ClaimPause(SCOPE, "r1", version=pin(p).model_copy(update={"run_revision": 0}))), RunConflict
    )
    assert "revision 1" in str(refusal)
    await refused(world.engine.apply(ClaimPause(SCOPE, "nobody")), NotSuspended)
    await refused(world.engine.apply(ClaimPause(OTHER, "r1")), NotSuspended)
    assert await inbox_of(world, SCOPE, "m-1") is None
    assert await stored_pause(world, SCOPE, "r1") == p.suspension
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["revision"]) == ("paused", 1)


async def a_claim_s_recorded_message_id_is_a_duplicate_or_a_conflict(world: World) -> None:
    await start(world, "r0", via=receipt("m-used"))
    p = await paused(world)
    await refused(
        world.engine.apply(ClaimPause(SCOPE, "r1", version=pin(p), receipt=receipt("m-used"))), AlreadyApplied
    )
    await refused(
        world.engine.apply(ClaimPause(SCOPE, "r1", version=pin(p), receipt=receipt("m-used", "run.resume"))),
        MessageIdConflict,
    )
    assert await stored_pause(world, SCOPE, "r1") == p.suspension
    recorded = await inbox_of(world, SCOPE, "m-used")
    assert recorded is not None
    assert recorded["run_id"] == "r0"


async def a_plain_claim_hands_back_the_pause_and_the_run_it_claimed(world: World) -> None:
    p = await paused(world)
    claimed = await world.engine.apply(ClaimWhole(SCOPE, "r1"))
    assert isinstance(claimed, ClaimedPause)
    assert claimed.suspension == p.suspension
    assert (claimed.run.state, claimed.run.revision, claimed.run.lease_owner) == (RunState.RUNNING, 2, None)
    assert await stored_run(world, SCOPE, "r1") == claimed.run
    # The plain claim keeps the pause (its caller deletes it) and announces nothing.
    assert await stored_pause(world, SCOPE, "r1") == p.suspension
    assert len(await outbox_of(world, SCOPE, "r1")) == 1
    await refused(world.engine.apply(ClaimWhole(SCOPE, "r1")), NotSuspended)


async def a_decision_records_itself_on_the_pause_s_checkpoint(world: World) -> None:
    p = await paused(world, reason=SuspendReason.APPROVAL, approvers=["alice"])
    checkpoint_id = p.notice.checkpoint_id
    assert checkpoint_id is not None
    decide = DecideCommand(
        scope=SCOPE, version=pin(p), checkpoint_id=checkpoint_id, decision=Decision.APPROVE, reason="fine"
    )
    worker = leased(world)
    await refused(worker.apply(Decide(decide, "bob")), Forbidden)
    claimed = await worker.apply(Decide(decide, "alice", receipt=receipt("m-1", "run.decide")))
    assert claimed.progress.approved == ["c1"]
    checkpoint = await checkpoint_row(world, checkpoint_id)
    assert checkpoint is not None
    assert (checkpoint["state"], checkpoint["decided_by"], checkpoint["reason"]) == ("approved", "alice", "fine")
    await assert_events(world, SCOPE, "r1", [p.notice.model_dump_json(), resumed_body("r1", 2)])
    # Decided: a second decision on it is invalid_state, though its pause is gone.
    await refused(worker.apply(Decide(decide, "alice", receipt=receipt("m-2", "run.decide"))), InvalidState)


async def a_claim_whose_decision_finds_no_pending_checkpoint_raises_and_writes_nothing(world: World) -> None:
    p = await paused(world, reason=SuspendReason.APPROVAL)
    assert p.notice.checkpoint_id is not None
    decision = Decided(p.notice.checkpoint_id + 100, "approved", "alice", "")
    await refused(
        world.engine.apply(ClaimPause(SCOPE, "r1", version=pin(p), lease=LEASE, decision=decision)), InvalidState
    )
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["revision"], row["lease_owner"]) == ("paused", 1, None)
    assert await stored_pause(world, SCOPE, "r1") == p.suspension


async def an_expired_pause_is_claimed_by_its_expiry_and_never_by_an_answer(world: World) -> None:
    p = await paused(world)
    worker = leased(world)
    expire = ExpireCommand(scope=SCOPE, version=pin(p), expired_by=FAR_FUTURE)
    # No deadline yet: the sweeper's expiry is stale.
    await refused(worker.apply(Expire(expire)), StaleExpiry)
    await refused(world.engine.apply(ClaimPause(SCOPE, "r1", expired_by=FAR_FUTURE)), NotSuspended)
    moved = await world.engine.apply(MoveDeadline(SCOPE, "r1", p.suspension.id, None, "ops"))
    assert moved.previous is None
    refusal = await refused(worker.apply(Resume(answer(p))), SuspensionExpired)
    assert moved.expires_at.isoformat() in str(refusal)
    claimed = await worker.apply(Expire(expire, receipt=receipt("m-x", "run.expire")))
    assert claimed.progress.ending is not None
    assert claimed.progress.ending.kind is EndingKind.EXPIRE
    # An expiry's claim fails the run: it announces no resume.
    assert len(await outbox_of(world, SCOPE, "r1")) == 1


# --- two rows of one batch ---------------------------------------------------------------------------------


async def two_starts_of_one_run_in_one_batch_behave_one_after_the_other(world: World) -> None:
    one, two = await world.engine.apply_all(
        [StartRun(SCOPE, new_run(), LEASE, snapshot("r1")), StartRun(SCOPE, new_run(), LEASE, snapshot("r1"))]
    )
    assert world.engine.scheduler.sizes(START) == [2]
    assert isinstance(one, CreatedRun)
    assert isinstance(two, CreatedRun)
    assert (one.fresh, two.fresh) == (True, False)
    assert two.run == one.run


async def two_claims_of_one_pause_in_one_batch_have_one_winner(world: World) -> None:
    p = await paused(world)
    won, lost = await world.engine.apply_all([ClaimWhole(SCOPE, "r1", version=pin(p)), ClaimWhole(SCOPE, "r1")])
    assert world.engine.scheduler.sizes(CLAIM) == [2]
    assert isinstance(won, ClaimedPause)
    assert won.run.revision == 2
    assert isinstance(lost, NotSuspended)


async def two_ends_of_one_run_in_one_batch_end_it_once(world: World) -> None:
    await start(world)
    first = EndRun(SCOPE, "r1", OWNER, 0, RunEventKind.COMPLETED, output="a")
    second = EndRun(SCOPE, "r1", OWNER, 0, RunEventKind.FAILED, error="b")
    ended, refusal = await world.engine.apply_all([first, second])
    assert world.engine.scheduler.sizes(END) == [2]
    assert isinstance(ended, RunEvent)
    assert ended.kind is RunEventKind.COMPLETED
    assert isinstance(refusal, RunLeaseLost)
    await assert_events(world, SCOPE, "r1", [first.event.body])


async def a_row_that_raises_fails_alone_and_the_rest_of_its_batch_commits(world: World) -> None:
    good = await paused(world, "r1")
    bad = await paused(world, "r2", reason=SuspendReason.APPROVAL)
    assert bad.notice.checkpoint_id is not None
    decision = Decided(bad.notice.checkpoint_id + 100, "approved", "alice", "")
    won, raised = await world.engine.apply_all(
        [
            ClaimPause(SCOPE, "r1", version=pin(good), lease=LEASE),
            ClaimPause(SCOPE, "r2", version=pin(bad), lease=LEASE, decision=decision),
        ]
    )
    assert world.engine.scheduler.sizes(CLAIM) == [2]
    assert isinstance(raised, InvalidState)
    assert not isinstance(won, BaseException)
    assert won["outcome"] == "claimed"
    one, two = await run_row(world, SCOPE, "r1"), await run_row(world, SCOPE, "r2")
    assert one is not None
    assert two is not None
    assert (one["state"], two["state"]) == ("running", "paused")


# --- agent replies --------------------------------------------------------------------------------------


def reply_request(p: Paused, content: str = '"yes"') -> ResumeAdmissionRequest:
    return ResumeAdmissionRequest(scope=SCOPE, version=pin(p), input=content.encode())


async def an_admission_claims_the_reply_s_pause_and_its_start_is_granted_once(world: World) -> None:
    p = await paused(world, reason=SuspendReason.AGENT_REPLY)
    first = reply_progress(p.suspension, "ask-1", '"yes"', OWNER)
    admitted = await world.engine.apply(AdmitResume(reply_request(p), p.suspension, LEASE, first))
    assert admitted.fresh
    assert (admitted.claimed_revision, admitted.request.input) == (2, b'"yes"')
    evidence = await world.engine.apply(ReadEvidence(SCOPE, "r1", p.suspension.id))
    assert evidence.admission == admitted.model_copy(update={"fresh": False})
    assert evidence.latest == evidence.admission
    assert evidence.start is None
    await assert_events(world, SCOPE, "r1", [p.notice.model_dump_json(), resumed_body("r1", 2)])
    again = await world.engine.apply(AdmitResume(reply_request(p), p.suspension, LEASE, first))
    assert not again.fresh
    assert again.request_digest == admitted.request_digest
    await refused(
        world.engine.apply(AdmitResume(reply_request(p, '"no"'), p.suspension, LEASE, first)), ResumeAdmissionConflict
    )
    theirs = reply_progress(p.suspension, "ask-1", '"yes"', RIVAL.owner)
    started = await world.engine.apply(
        StartResume(SCOPE, "r1", p.suspension.id, admitted.request_digest, RIVAL, theirs)
    )
    assert started.fresh
    assert started.suspension == p.suspension
    assert started.run is not None
    assert (started.run.lease_owner, started.run.revision) == (RIVAL.owner, 2)
    retried = await world.engine.apply(StartResume(SCOPE, "r1", p.suspension.id, admitted.request_digest))
    assert (retried.fresh, retried.suspension, retried.started_at) == (False, None, started.started_at)
    await refused(world.engine.apply(StartResume(SCOPE, "r1", p.suspension.id, "0" * 64)), ResumeAdmissionConflict)
    await refused(world.engine.apply(StartResume(SCOPE, "r1", p.suspension.id + 9, "0" * 64)), ResumeAdmissionNotFound)


async def a_reply_command_admits_and_starts_and_its_redelivery_does_neither_again(world: World) -> None:
    p = await paused(world, reason=SuspendReason.AGENT_REPLY)
    reply = ReplyCommand(scope=SCOPE, version=pin(p), reply_with="ask-1", input="yes")
    via = receipt("m-reply", "run.reply")
    claimed = await leased(world).apply(Reply(reply, via, "corr-1"))
    assert claimed is not None
    assert (claimed.run.lease_owner, claimed.suspension) == (OWNER, p.suspension)
    assert claimed.progress.done == [ProgressResult(call_id="c1", content="yes")]
    assert await leased(world).apply(Reply(reply, via, "corr-1")) is None
    recorded = await inbox_of(world, SCOPE, "m-reply")
    assert recorded is not None
    assert recorded["outcome"] == "applied"
    assert len(await world.table("resume_starts")) == 1


async def an_admission_of_a_pause_that_waits_on_no_reply_is_refused(world: World) -> None:
    p = await paused(world)
    await refused(world.engine.apply(AdmitResume(reply_request(p), p.suspension, LEASE)), NotAgentReplyResumable)
    assert await world.table("resume_admissions") == []
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert row["state"] == "paused"


async def an_admission_that_never_started_expires_and_then_never_starts(world: World) -> None:
    p = await paused(world, reason=SuspendReason.AGENT_REPLY)
    admitted = await world.engine.apply(AdmitResume(reply_request(p), p.suspension))
    digest = admitted.request_digest
    await refused(world.engine.apply(ExpireAdmission(SCOPE, "r1", p.suspension.id, "0" * 64)), ResumeAdmissionConflict)
    await refused(
        world.engine.apply(ExpireAdmission(SCOPE, "r1", p.suspension.id + 9, digest)), ResumeAdmissionNotFound
    )
    expired = await world.engine.apply(ExpireAdmission(SCOPE, "r1", p.suspension.id, digest))
    assert (expired.fresh, expired.run_revision, expired.request_digest) == (True, 2, digest)
    again = await world.engine.apply(ExpireAdmission(SCOPE, "r1", p.suspension.id, digest))
    assert (again.fresh, again.event_id, again.expired_at) == (False, expired.event_id, expired.expired_at)
    await refused(world.engine.apply(StartResume(SCOPE, "r1", p.suspension.id, digest)), SuspensionExpired)
    assert (await noted(world, SCOPE, "r1"))[-1] == Noted(
        "resume_expired", 2, {"suspension_id": p.suspension.id, "request_digest": digest}
    )


async def a_started_admission_never_expires(world: World) -> None:
    p = await paused(world, reason=SuspendReason.AGENT_REPLY)
    admitted = await world.engine.apply(AdmitResume(reply_request(p), p.suspension))
    await world.engine.apply(StartResume(SCOPE, "r1", p.suspension.id, admitted.request_digest))
    await refused(
        world.engine.apply(ExpireAdmission(SCOPE, "r1", p.suspension.id, admitted.request_digest)), ResumeAlreadyStarted
    )
    assert await world.table("resume_expiries") == []


def closure_request(
    p: Paused, admission_digest: str, start_digest: str, *, revision: int = 2, late: bool = False
) -> ResumeClosureRequest:
    # Fixed times, so that the request (and its digest) is the same in every world: a proof that expired
    # long ago, or one that holds for ever.
    observed = datetime(2000, 1, 1, tzinfo=UTC)
    return ResumeClosureRequest(
        scope=SCOPE,
        version=pin(p),
        admission_digest=admission_digest,
        start_digest=start_digest,
        run_revision=revision,
        actor="operator",
        issuer="issuer",
        issuer_revision="1",
        proof_ref="proof-1",
        proof_digest="2" * 64,
        observed_at=observed,
        expires_at=observed + timedelta(hours=1) if late else FAR_FUTURE,
    )


async def a_closure_ends_an_uncertain_start_failed_and_is_idempotent(world: World) -> None:
    p = await paused(world, reason=SuspendReason.AGENT_REPLY)
    admitted = await world.engine.apply(AdmitResume(reply_request(p), p.suspension, LEASE))
    started = await world.engine.apply(StartResume(SCOPE, "r1", p.suspension.id, admitted.request_digest))
    digest = admitted.request_digest
    await refused(
        world.engine.apply(CloseResume(SCOPE, closure_request(p, digest, started.digest(), revision=1))), RunConflict
    )
    await refused(
        world.engine.apply(CloseResume(SCOPE, closure_request(p, digest, started.digest(), late=True))), Forbidden
    )
    await refused(world.engine.apply(CloseResume(SCOPE, closure_request(p, digest, "3" * 64))), ResumeAdmissionConflict)
    request = closure_request(p, digest, started.digest())
    closed = await world.engine.apply(CloseResume(SCOPE, request))
    assert (closed.fresh, closed.run_revision) == (True, 3)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["revision"], row["lease_owner"]) == ("failed", 3, None)
    assert row["error"] is not None
    assert row["error"].startswith("incomplete:")
    failed = RunEvent(kind=RunEventKind.FAILED, run_id="r1", revision=3, scope=SCOPE, error=row["error"])
    await assert_events(
        world, SCOPE, "r1", [p.notice.model_dump_json(), resumed_body("r1", 2), failed.model_dump_json()]
    )
    assert (await noted(world, SCOPE, "r1"))[-1].kind == "resume_closed"
    again = await world.engine.apply(CloseResume(SCOPE, request))
    assert (again.fresh, again.event_id, again.closed_at) == (False, closed.event_id, closed.closed_at)


# --- operators' deadline moves ---------------------------------------------------------------------------


async def a_deadline_moves_on_the_live_pause_and_is_noted(world: World) -> None:
    p = await paused(world)
    moved = await world.engine.apply(MoveDeadline(SCOPE, "r1", p.suspension.id, 60, "ops"))
    assert (moved.previous, moved.run_revision, moved.suspension_id) == (None, 1, p.suspension.id)
    stored = await stored_pause(world, SCOPE, "r1")
    assert stored is not None
    assert stored.expires_at == moved.expires_at
    later = await world.engine.apply(MoveDeadline(SCOPE, "r1", p.suspension.id, 30, "ops"))
    assert later.previous == moved.expires_at
    assert later.expires_at == moved.expires_at + timedelta(seconds=30)
    [first, second] = (await noted(world, SCOPE, "r1"))[1:]
    assert (first.kind, first.revision) == ("deadline_moved", 1)
    assert first.data["previous"] is None
    assert datetime.fromisoformat(first.data["expires_at"]) == moved.expires_at
    assert (first.data["moved_by"], first.data["how"], first.data["extend_by_seconds"]) == ("ops", "extend", 60)
    assert datetime.fromisoformat(second.data["previous"]) == moved.expires_at
    # A deadline moved is no state change: the run's revision stays, and nothing is announced.
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert row["revision"] == 1
    assert len(await outbox_of(world, SCOPE, "r1")) == 1


async def a_deadline_move_on_another_pause_or_no_pause_is_refused(world: World) -> None:
    p = await paused(world)
    await refused(world.engine.apply(MoveDeadline(SCOPE, "r1", p.suspension.id + 5, 60, "ops")), RunConflict)
    await refused(world.engine.apply(MoveDeadline(OTHER, "r1", p.suspension.id, 60, "ops")), NotSuspended)
    await start(world, "r2")
    await refused(world.engine.apply(MoveDeadline(SCOPE, "r2", p.suspension.id, 60, "ops")), NotSuspended)
    assert len(await noted(world, SCOPE, "r1")) == 1


# --- who holds a run ------------------------------------------------------------------------------------


async def a_released_lease_is_taken_over_with_its_snapshot(world: World) -> None:
    run = (await start(world)).run
    saved = await world.engine.apply(SaveProgress(SCOPE, snapshot("r1", step=4)))
    assert not await world.engine.apply(ReleaseLease(SCOPE, "r1", RIVAL.owner))
    await refused(world.engine.apply(TakeOverRun(SCOPE, "r1", RIVAL)), RunNotReclaimable)
    assert await world.engine.apply(ReleaseLease(SCOPE, "r1", OWNER))
    assert not await world.engine.apply(ReleaseLease(SCOPE, "r1", OWNER))
    taken = await world.engine.apply(TakeOverRun(SCOPE, "r1", RIVAL))
    assert (taken.lease_owner, taken.revision, taken.state) == (RIVAL.owner, run.revision, RunState.RUNNING)
    assert await stored_run(world, SCOPE, "r1") == taken
    handed_over = await stored_progress(world, SCOPE, "r1")
    assert handed_over is not None
    assert (handed_over.owner, handed_over.continuation) == (RIVAL.owner, saved.continuation)
    await refused(world.engine.apply(SaveProgress(SCOPE, snapshot("r1", step=5))), RunLeaseLost)


async def a_takeover_may_write_its_own_first_snapshot(world: World) -> None:
    await start(world)
    await world.engine.apply(ReleaseLease(SCOPE, "r1", OWNER))
    mine = snapshot("r1", RIVAL.owner, step=9)
    await world.engine.apply(TakeOverRun(SCOPE, "r1", RIVAL, mine))
    stored = await stored_progress(world, SCOPE, "r1")
    assert stored is not None
    assert (stored.owner, stored.continuation.step_index) == (RIVAL.owner, 9)


async def the_reclaim_sweep_takes_lapsed_runs_oldest_lapse_first(world: World) -> None:
    for run_id in ("r1", "r2", "r3"):
        await start(world, run_id)
    await world.engine.apply(ReleaseLease(SCOPE, "r2", OWNER))
    await world.engine.apply(ReleaseLease(SCOPE, "r1", OWNER))
    [first] = await world.engine.apply(ReclaimLapsed(RIVAL, 1))
    assert isinstance(first, Reclaimed)
    assert first.run.id == "r2"
    assert first.progress is not None
    assert first.progress.owner == RIVAL.owner
    rest = await world.engine.apply(ReclaimLapsed(RIVAL, 10))
    assert [r.run.id for r in rest if isinstance(r, Reclaimed)] == ["r1"]
    assert await world.engine.apply(ReclaimLapsed(RIVAL, 10)) == []


async def a_takeover_whose_run_cannot_be_read_is_rolled_back(world: World) -> None:
    await start(world)
    await world.engine.apply(ReleaseLease(SCOPE, "r1", OWNER))
    await world.spoil("runs", SCOPE, "r1", "config", '{"max_steps": "many"}')
    # Decoded before its commit (atomic): a run nobody could continue is not taken.
    await refused(world.engine.apply(TakeOverRun(SCOPE, "r1", RIVAL)), InvalidContinuation)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert row["lease_owner"] == OWNER
    # The sweep takes it all the same, and hands it back as unreadable, for its taker to end.
    [unreadable] = await world.engine.apply(ReclaimLapsed(RIVAL, 5))
    assert isinstance(unreadable, Unreadable)
    assert (unreadable.run_id, unreadable.scope, unreadable.revision) == ("r1", SCOPE, 0)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert row["lease_owner"] == RIVAL.owner


async def a_plain_claim_of_a_pause_that_cannot_be_read_is_rolled_back(world: World) -> None:
    p = await paused(world)
    await world.spoil("suspensions", SCOPE, "r1", "continuation", '{"messages": 5}')
    await refused(world.engine.apply(ClaimWhole(SCOPE, "r1")), InvalidContinuation)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["revision"]) == ("paused", 1)
    # A claim that hands back nothing to decode commits as asked.
    out = await world.engine.apply(ClaimPause(SCOPE, "r1", version=pin(p)))
    assert out["outcome"] == "claimed"


# --- the original package's pause API -----------------------------------------------------------------


async def a_pause_created_from_outside_is_one_per_run_and_deleted_by_key(world: World) -> None:
    await start(world)
    asked = Suspension(
        run_id="r1", scope=OTHER, reason=SuspendReason.EXTERNAL_TOOL, pending=pending(SuspendReason.EXTERNAL_TOOL)
    )
    created = await world.engine.apply(CreatePause(SCOPE, asked, ttl_seconds=30))
    assert created.scope == SCOPE
    assert created.id > 0
    assert created.expires_at is not None
    assert created.created_at is not None
    assert created.expires_at - created.created_at == timedelta(seconds=30)
    assert await stored_pause(world, SCOPE, "r1") == created
    await refused(world.engine.apply(CreatePause(SCOPE, asked)), SuspensionExists)
    await refused(world.engine.apply(CreatePause(SCOPE, asked.model_copy(update={"run_id": "nobody"}))), RunNotFound)
    await world.engine.apply(DeletePause(SCOPE, "r1"))
    await refused(world.engine.apply(DeletePause(SCOPE, "r1")), NotSuspended)
    assert await stored_pause(world, SCOPE, "r1") is None
    await world.engine.apply(DeleteProgress(SCOPE, "r1"))
    await world.engine.apply(DeleteProgress(SCOPE, "r1"))
    assert await stored_progress(world, SCOPE, "r1") is None


# --- the outbox ------------------------------------------------------------------------------------------


async def quarantined_outbox_rows_are_put_back_in_line(world: World) -> None:
    await paused(world, "r1")
    await paused(world, "r2")
    [one] = await outbox_of(world, SCOPE, "r1")
    [two] = await outbox_of(world, SCOPE, "r2")
    assert await world.engine.apply(RetryQuarantined()) == []
    await world.quarantine(one["id"])
    await world.quarantine(two["id"])
    assert await world.engine.apply(RetryQuarantined(one["id"])) == [one["id"]]
    assert await world.engine.apply(RetryQuarantined()) == [two["id"]]
    assert await world.engine.apply(RetryQuarantined()) == []
    [back] = await outbox_of(world, SCOPE, "r1")
    assert (back["quarantined_at"], back["attempts"], back["next_attempt_at"]) == (None, 0, None)
    assert (back["message_id"], back["body"], back["last_error"]) == (one["message_id"], one["body"], "refused")


# --- sessions --------------------------------------------------------------------------------------------


async def a_session_is_read_at_its_scope_within_its_window(world: World) -> None:
    await start(world)
    call = ToolCall(id="t1", name="lookup")
    own = [
        Message(role=Role.USER, content="q"),
        Message(role=Role.ASSISTANT, tool_calls=[call]),
        Message(role=Role.TOOL, content="a", tool_call_id="t1", name="lookup"),
        Message(role=Role.ASSISTANT, content="done"),
    ]
    await world.engine.apply(EndRun(SCOPE, "r1", OWNER, 0, RunEventKind.COMPLETED, output="done", own_messages=own))
    assert await world.engine.apply(ReadSession(SCOPE, "s-r1", 100)) == own
    assert await world.engine.apply(ReadSession(SCOPE, "s-r1", 3)) == own[1:]
    # A window never opens on a tool result whose call it cut off.
    assert await world.engine.apply(ReadSession(SCOPE, "s-r1", 2)) == own[3:]
    assert await world.engine.apply(ReadSession(OTHER, "s-r1", 100)) == []


async def a_renewal_extends_only_the_live_leases_its_owner_holds_and_hands_over_an_asked_ending(
    world: World,
) -> None:
    ending = Ending(kind=EndingKind.CANCEL, reason="stop")
    await start(world, "r1")
    await start(world, "r1", scope=OTHER)
    await start(world, "r2", lease=RIVAL)
    await start(world, "r3")
    assert await world.engine.apply(ReleaseLease(SCOPE, "r3", OWNER))  # lapsed now, by its holder's leave
    await paused(world, "r4")
    assert await world.engine.apply(RequestEnding(SCOPE, "r1", ending)) == "requested"
    before = {(r["app"], r["tenant"], r["id"]): r for r in await world.table("runs")}
    held = [HeldRun(run_id, SCOPE) for run_id in ("r1", "r2", "r3", "r4", "nobody")] + [HeldRun("r1", OTHER)]
    line = world.lease_line()
    try:
        renewed = await line.renew(OWNER, 60, held)
        # Held by the owner under a live lease, at the exact scope asked: the two r1; with the ending asked.
        assert renewed == {
            HeldRun("r1", SCOPE): Renewed("r1", SCOPE, ending),
            HeldRun("r1", OTHER): Renewed("r1", OTHER, None),
        }
        after = {(r["app"], r["tenant"], r["id"]): r for r in await world.table("runs")}
        mine = [(SCOPE.app, SCOPE.tenant, "r1"), (OTHER.app, OTHER.tenant, "r1")]
        # One statement: one now() + ttl for every lease it renews, and nothing else of a run changes.
        assert after[mine[0]]["lease_expires_at"] == after[mine[1]]["lease_expires_at"]
        for k in mine:
            assert after[k]["lease_expires_at"] > before[k]["lease_expires_at"]
            assert {c: v for c, v in after[k].items() if c != "lease_expires_at"} == {
                c: v for c, v in before[k].items() if c != "lease_expires_at"
            }
        assert {k: after[k] for k in after if k not in mine} == {k: before[k] for k in before if k not in mine}
        # Nobody's name, another's run at a scope it is not in, nothing asked: nothing renewed.
        assert await line.renew("", 60, held) == {}
        assert await line.renew(RIVAL.owner, 60, [HeldRun("r2", OTHER)]) == {}
        assert await line.renew(OWNER, 60, []) == {}
        assert await world.table("runs") == list(after.values())
    finally:
        await line.close()


# The cases, in the order they run; a case added here runs against both committers.
Case = Callable[[World], Awaitable[None]]
CASES: list[Case] = [
    start_creates_a_run_under_its_lease_with_its_first_snapshot_and_inbox_record,
    start_without_a_lease_creates_the_run_and_no_snapshot,
    start_again_is_a_no_op_and_another_start_under_the_id_is_run_exists,
    start_with_a_recorded_message_id_is_a_duplicate_or_a_conflict,
    start_within_a_scope_s_live_run_quota,
    start_within_the_fleet_s_default_start_rate,
    save_by_the_holder_writes_the_snapshot_and_the_run_s_counts,
    save_by_anyone_but_the_live_holder_is_refused_and_writes_nothing,
    save_hands_over_the_ending_asked_of_the_run,
    pause_writes_the_pause_drops_the_snapshot_and_announces_its_notice,
    an_approval_pause_writes_its_pending_checkpoint,
    a_pause_with_a_deadline_counts_it_from_the_database_clock,
    a_pause_by_anyone_but_the_holder_at_its_revision_is_refused,
    draws_hand_out_increasing_ids_and_the_database_clock,
    an_end_ends_the_run_saves_its_own_messages_and_announces_it,
    an_end_by_anyone_but_the_holder_at_its_revision_is_refused,
    an_end_closes_the_run_s_undecided_checkpoints,
    an_ending_is_asked_only_of_a_running_run_held_under_a_lease,
    a_cancel_claims_a_paused_run_and_asks_a_running_one_to_end,
    a_resume_claims_its_pause_under_the_worker_s_lease_and_announces_it,
    a_claim_pinned_to_another_pause_or_revision_is_refused_and_writes_nothing,
    a_claim_s_recorded_message_id_is_a_duplicate_or_a_conflict,
    a_plain_claim_hands_back_the_pause_and_the_run_it_claimed,
    a_decision_records_itself_on_the_pause_s_checkpoint,
    a_claim_whose_decision_finds_no_pending_checkpoint_raises_and_writes_nothing,
    an_expired_pause_is_claimed_by_its_expiry_and_never_by_an_answer,
    two_starts_of_one_run_in_one_batch_behave_one_after_the_other,
    two_claims_of_one_pause_in_one_batch_have_one_winner,
    two_ends_of_one_run_in_one_batch_end_it_once,
    a_row_that_raises_fails_alone_and_the_rest_of_its_batch_commits,
    an_admission_claims_the_reply_s_pause_and_its_start_is_granted_once,
    a_reply_command_admits_and_starts_and_its_redelivery_does_neither_again,
    an_admission_of_a_pause_that_waits_on_no_reply_is_refused,
    an_admission_that_never_started_expires_and_then_never_starts,
    a_started_admission_never_expires,
    a_closure_ends_an_uncertain_start_failed_and_is_idempotent,
    a_deadline_moves_on_the_live_pause_and_is_noted,
    a_deadline_move_on_another_pause_or_no_pause_is_refused,
    a_released_lease_is_taken_over_with_its_snapshot,
    a_takeover_may_write_its_own_first_snapshot,
    the_reclaim_sweep_takes_lapsed_runs_oldest_lapse_first,
    a_takeover_whose_run_cannot_be_read_is_rolled_back,
    a_plain_claim_of_a_pause_that_cannot_be_read_is_rolled_back,
    a_pause_created_from_outside_is_one_per_run_and_deleted_by_key,
    quarantined_outbox_rows_are_put_back_in_line,
    a_session_is_read_at_its_scope_within_its_window,
    a_renewal_extends_only_the_live_leases_its_owner_holds_and_hands_over_an_asked_ending,
]


def case_id(case: Case) -> str:
    return getattr(case, "__name__", repr(case))


# --- comparing two worlds row for row ------------------------------------------------------------------

_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_DIGEST = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


class Shaper:
    """Values as two worlds can be compared: what differs between them by nature (every time, as the clocks
    are not one clock; every random id; every digest, as some bind times) is renamed by order of first
    appearance, wherever it is, text included: ``<time 3>``, ``<uuid 1>``, ``<digest 2>``. So what must be
    equal stays compared (columns, NULLs against rows of NULLs, types, ids drawn from sequences, jsonb's
    text), and so does which of those values are the same one (a lease's time and a snapshot's, an event's
    id in the outbox and in the sink). One shaper per world, used in the same order on both."""

    def __init__(self) -> None:
        self._names: dict[tuple[str, Any], str] = {}

    def _name(self, kind: str, value: Any) -> str:
        key = (kind, value)
        if key not in self._names:
            self._names[key] = f"<{kind} {sum(1 for k, _ in self._names if k == kind) + 1}>"
        return self._names[key]

    def _text(self, text: str) -> str:
        text = _TIMESTAMP.sub(lambda m: self._name("time", datetime.fromisoformat(m.group(0))), text)
        text = _UUID.sub(lambda m: self._name("uuid", uuid.UUID(m.group(0))), text)
        return _DIGEST.sub(lambda m: self._name("digest", m.group(0)), text)

    def __call__(self, value: Any) -> Any:
        if isinstance(value, datetime):
            return self._name("time", value)
        if isinstance(value, uuid.UUID) or type(value).__name__ == "UUID":
            return self._name("uuid", uuid.UUID(str(value)))
        if isinstance(value, str):
            return self._text(value)
        if isinstance(value, Mapping) or hasattr(value, "items"):
            # In column order by name: a record's columns and a dict's may come in other orders.
            return {str(k): self(value[k]) for k in sorted(value.keys())}
        if isinstance(value, list | tuple):
            return [self(v) for v in value]
        if isinstance(value, float):
            # A float is a float8 column: an int in its place would be another type.
            return ("float", value)
        return value


class Recording:
    """A committer that keeps the output rows of every transition it commits (through ``inner``), shaped."""

    def __init__(self, inner: Committer) -> None:
        self.inner = inner
        self.shape = Shaper()
        self.outs: list[tuple[str, list[Any]]] = []

    async def commit(self, batch: Batch, decode: Callable[[Outs], T]) -> T:
        def kept(outs: Outs) -> T:
            self.outs.extend((batch.family.name, [self.shape(dict(out)) for out in found]) for found in outs)
            return decode(outs)

        return await self.inner.commit(batch, kept)


async def dump(world: World, shape: Shaper) -> dict[str, list[Any]]:
    """Every table's rows, shaped (with the world's own shaper, after its outputs)."""
    return {name: [shape(row) for row in await world.table(name)] for name in TABLES}


def first_difference(left: Any, right: Any, where: str = "") -> str | None:
    """Where two shaped values first differ (for a readable failure), None when they are equal."""
    if isinstance(left, dict) and isinstance(right, dict):
        for key in sorted(set(left) | set(right)):
            if key not in left or key not in right:
                return f"{where}.{key}: only on one side"
            found = first_difference(left[key], right[key], f"{where}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(left, list | tuple) and isinstance(right, list | tuple) and type(left) is type(right):
        for i, (a, b) in enumerate(zip(left, right, strict=False)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found is not None:
                return found
        return None if len(left) == len(right) else f"{where}: {len(left)} against {len(right)} items"
    return None if left == right else f"{where}: {left!r} against {right!r}"
