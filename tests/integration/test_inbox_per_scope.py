"""A message_id is an idempotency key within a scope (docs/contracts.md, "Every message"): the inbox is keyed
by ``(app, tenant, message_id)`` (migration 0007), so one tenant can never pre-empt another's command id.

Against the real database, for every transition that records a command: the same id used in two scopes is
two commands, each applied in its own scope; within one scope the same command again is a duplicate (no
second effect) and another body under that id is ``message_id_conflict``; races of one id across scopes,
over many connections, have exactly one effect per scope. The migration keeps the rows it re-keys.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from intermission.engine.commands import Cancel, Decide, Expire, Reply, Resume, Start
from intermission.engine.core import Engine
from intermission.engine.starts import RunDefaults
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    StartCommand,
    ToolAnswer,
)
from intermission.schemas.errors import InvalidArgument, MessageIdConflict, NotSuspended, RunExists, SuspensionExpired
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import PendingCall, SuspendReason
from intermission.store import Stores, migrate
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.store.migrate import ensure_database
from intermission.wire import Command
from tests.conftest import MakeStores, race
from tests.support import pg
from tests.support.factories import lease, paused_run, running_run, writes
from tests.support.inspect import FAR_FUTURE, Inspector, pin, unexpected, winners

SHARED_ID = "m-shared"
DEFAULTS = RunDefaults(pause_ttl_seconds=0, max_steps=8)
TINY_TTL = 0.001  # a deadline a millisecond ahead of the database clock: passed almost at once
# Scopes that differ by tenant, and by app: each part of the key counts.
SCOPES = [Scope(app="acme", tenant="t1"), Scope(app="acme", tenant="t2"), Scope(app="globex", tenant="t1")]
PER_SCOPE = 16
ROUNDS = 3


@dataclass
class Case:
    """One command of some kind, ready to apply at its scope, and what applying it must leave."""

    kind: Command
    scope: Scope
    run_id: str
    command: BaseModel
    # The same kind of command at the same scope with another body.
    other: BaseModel
    # The run row (state, revision, whether an ending is set) the command leaves, and whether it announces
    # run.resumed.
    state: str
    revision: int
    ending: bool = False
    resumed: bool = False


async def apply(stores: Stores, kind: Command, body: Any, receipt: Receipt) -> object:
    """``body`` applied as a command of ``kind`` through an engine over ``stores``, as its consumer applies it:
    under a worker's lease and the fleet's defaults."""
    engine = Engine.over(stores).under(lease=lease(), defaults=DEFAULTS)
    match kind:
        case Command.START:
            return await engine.apply(Start(body, receipt=receipt))
        case Command.RESUME:
            return await engine.apply(Resume(body, receipt=receipt))
        case Command.DECIDE:
            return await engine.apply(Decide(body, principal="alice", receipt=receipt))
        case Command.REPLY:
            return await engine.apply(Reply(body, receipt=receipt))
        case Command.EXPIRE:
            return await engine.apply(Expire(body, receipt=receipt))
        case Command.CANCEL:
            return await engine.apply(Cancel(body, receipt=receipt))


async def case_of(kind: Command, stores: Stores, db: Inspector, scope: Scope) -> Case:
    """A run at ``scope`` waiting for a command of ``kind``, and that command."""
    body: BaseModel
    other: BaseModel
    if kind is Command.START:
        start = StartCommand(scope=scope, run_id=f"run-{uuid.uuid4().hex[:12]}", agent_id="demo", input="hi")
        other = start.model_copy(update={"input": "another start"})
        return Case(kind, scope, start.run_id, start, other, state="running", revision=0)
    if kind is Command.CANCEL:
        run, _ = await running_run(stores, scope)
        cancel = CancelCommand(scope=scope, run_id=run.id, reason="stop")
        other = cancel.model_copy(update={"reason": "another reason"})
        return Case(kind, scope, run.id, cancel, other, state="running", revision=run.revision, ending=True)

    reason = {
        Command.RESUME: SuspendReason.EXTERNAL_TOOL,
        Command.DECIDE: SuspendReason.APPROVAL,
        Command.REPLY: SuspendReason.AGENT_REPLY,
        Command.EXPIRE: SuspendReason.EXTERNAL_TOOL,
    }[kind]
    call = PendingCall(id="c1", name="lookup", reply_with="rw-1" if kind is Command.REPLY else "")
    ttl = TINY_TTL if kind is Command.EXPIRE else 0
    p = await paused_run(stores, scope, reason=reason, pending=[call], ttl_seconds=ttl)
    if kind is Command.RESUME:
        body = ResumeCommand(scope=scope, version=pin(p), results=[ToolAnswer(call_id="c1", content="sunny")])
        other = ResumeCommand(scope=scope, version=pin(p), results=[ToolAnswer(call_id="c1", content="rain")])
    elif kind is Command.DECIDE:
        assert p.suspension.checkpoint_id is not None
        body = DecideCommand(
            scope=scope, version=pin(p), checkpoint_id=p.suspension.checkpoint_id, decision=Decision.APPROVE
        )
        other = body.model_copy(update={"decision": Decision.DENY})
    elif kind is Command.REPLY:
        body = ReplyCommand(scope=scope, version=pin(p), reply_with="rw-1", input='"forty-two"')
        other = body.model_copy(update={"input": '"forty-three"'})
    else:
        await db.wait_pause_expired(p.run.id)
        body = ExpireCommand(scope=scope, version=pin(p), expired_by=FAR_FUTURE)
        other = body.model_copy(update={"expired_by": FAR_FUTURE.replace(year=9998)})
    resumed = kind in (Command.RESUME, Command.DECIDE, Command.REPLY)
    return Case(kind, scope, p.run.id, body, other, state="running", revision=p.revision + 1, resumed=resumed)


async def recorded(db: Inspector, message_id: str) -> list[tuple[str, str, str, str | None]]:
    """The inbox rows under ``message_id``: (app, tenant, routing key, run), in scope order."""
    found = await db.con.fetch(
        "SELECT app, tenant, routing_key, run_id FROM inbox WHERE message_id = $1 ORDER BY app, tenant", message_id
    )
    return [(r["app"], r["tenant"], r["routing_key"], r["run_id"]) for r in found]


async def assert_applied(db: Inspector, case: Case) -> None:
    """The rows one application of ``case`` leaves for its run."""
    run = await db.con.fetchrow(
        "SELECT app, tenant, state::text AS state, revision, ending IS NOT NULL AS ending FROM runs WHERE id = $1",
        case.run_id,
    )
    assert run is not None, f"{case.kind.value} at {case.scope} created no run"
    assert dict(run) == {
        "app": case.scope.app,
        "tenant": case.scope.tenant,
        "state": case.state,
        "revision": case.revision,
        "ending": case.ending,
    }
    resumed = await db.con.fetchval(
        "SELECT count(*) FROM outbox WHERE run_id = $1 AND routing_key = $2",
        case.run_id,
        f"run.resumed.{case.scope.app}.{case.scope.tenant}",
    )
    assert resumed == (1 if case.resumed else 0)


async def resend(stores: Stores, case: Case, receipt: Receipt) -> None:
    """The same command under the same id at the same scope again: no second effect, no refusal."""
    try:
        again = await apply(stores, case.kind, case.command, receipt)
    except AlreadyApplied:
        return
    # A reply's idempotency record is its admission: a re-send finds it and the start it granted, and is
    # handed nothing to run.
    assert case.kind is Command.REPLY
    assert again is None


@pytest.mark.parametrize("kind", list(Command), ids=lambda k: k.value)
async def test_one_message_id_in_three_scopes_is_three_commands_each_applied_in_its_own_scope(
    stores: Stores, db: Inspector, kind: Command
) -> None:
    cases = [await case_of(kind, stores, db, scope) for scope in SCOPES]
    receipts = [Receipt.of(SHARED_ID, kind.value, case.command) for case in cases]
    for case, receipt in zip(cases, receipts, strict=True):
        await apply(stores, case.kind, case.command, receipt)

    # Every scope's command took effect, and each is recorded under its own scope.
    for case in cases:
        await assert_applied(db, case)
    assert await recorded(db, SHARED_ID) == [
        (s.app, s.tenant, kind.value, c.run_id) for s, c in zip(SCOPES, cases, strict=True)
    ]

    # Within a scope the id still means that one command: the same again changes nothing, another body
    # under it is a conflict, and neither touches the other scopes' records.
    before = await db.snapshot()
    for case, receipt in zip(cases, receipts, strict=True):
        await resend(stores, case, receipt)
        with pytest.raises(MessageIdConflict):
            await apply(stores, kind, case.other, Receipt.of(SHARED_ID, kind.value, case.other))
    assert await db.snapshot() == before


async def test_an_id_one_scope_used_for_another_kind_of_command_leaves_other_scopes_free(
    stores: Stores, db: Inspector
) -> None:
    """A tenant that takes an id first, with any command, takes it only for itself."""
    first, second = SCOPES[:2]
    squatter = await case_of(Command.START, stores, db, first)
    await apply(stores, Command.START, squatter.command, Receipt.of(SHARED_ID, Command.START.value, squatter.command))
    # In its own scope a resume under that id is a conflict, and writes nothing ...
    own = await case_of(Command.RESUME, stores, db, first)
    before = await db.snapshot()
    with pytest.raises(MessageIdConflict):
        await apply(stores, Command.RESUME, own.command, Receipt.of(SHARED_ID, Command.RESUME.value, own.command))
    assert await db.snapshot() == before
    # ... while the other tenant's resume under it is its own command, applied.
    victim = await case_of(Command.RESUME, stores, db, second)
    await apply(stores, Command.RESUME, victim.command, Receipt.of(SHARED_ID, Command.RESUME.value, victim.command))
    await assert_applied(db, victim)


async def test_a_refusal_in_one_scope_removes_only_its_own_record(stores: Stores, db: Inspector) -> None:
    """A transition that wrote its record before it knew it was refused removes it again: in its own scope
    only, never the record another tenant's command keeps under that id."""
    here, there = SCOPES[:2]
    kept = await case_of(Command.RESUME, stores, db, there)
    await apply(stores, Command.RESUME, kept.command, Receipt.of(SHARED_ID, Command.RESUME.value, kept.command))
    held = [(there.app, there.tenant, Command.RESUME.value, kept.run_id)]

    # A start under a run id a run of its own scope holds already: run_exists (intermission_start_run_v1).
    # (Another scope's run of that id, like kept's, would not refuse it: run ids are keyed by scope.)
    mine, _ = await running_run(stores, here)
    taken = StartCommand(scope=here, run_id=mine.id, agent_id="demo", input="another start")
    with pytest.raises(RunExists):
        await apply(stores, Command.START, taken, Receipt.of(SHARED_ID, Command.START.value, taken))
    assert await recorded(db, SHARED_ID) == held
    # A cancel of a run the original's plain claim holds: nobody here can end it (intermission_request_ending_v1).
    plain = await paused_run(stores, here)
    await writes(stores, here).suspensions.claim_suspension(plain.run.id)
    cancel = CancelCommand(scope=here, run_id=plain.run.id)
    with pytest.raises(NotSuspended):
        await apply(stores, Command.CANCEL, cancel, Receipt.of(SHARED_ID, Command.CANCEL.value, cancel))
    assert await recorded(db, SHARED_ID) == held
    # A resume that reaches the claim after the pause's deadline (intermission_claim_pause_v1).
    late = await paused_run(stores, here, ttl_seconds=TINY_TTL)
    await db.wait_pause_expired(late.run.id)
    resume = ResumeCommand(scope=here, version=pin(late), results=[ToolAnswer(call_id="c1")])
    with pytest.raises(SuspensionExpired):
        await apply(stores, Command.RESUME, resume, Receipt.of(SHARED_ID, Command.RESUME.value, resume))
    assert await recorded(db, SHARED_ID) == held

    # So the other tenant's command under that id is still a duplicate there.
    before = await db.snapshot()
    await resend(stores, kept, Receipt.of(SHARED_ID, Command.RESUME.value, kept.command))
    assert await db.snapshot() == before


async def test_a_receipt_of_one_scope_is_never_recorded_at_another(stores: Stores, db: Inspector) -> None:
    here, there = SCOPES[:2]
    case = await case_of(Command.RESUME, stores, db, here)
    elsewhere = await case_of(Command.RESUME, stores, db, there)
    before = await db.snapshot()
    with pytest.raises(InvalidArgument):
        await apply(
            stores, Command.RESUME, case.command, Receipt.of(SHARED_ID, Command.RESUME.value, elsewhere.command)
        )
    assert await db.snapshot() == before


async def test_resumes_racing_under_one_id_in_two_scopes_have_one_effect_per_scope(
    stores: Stores, make_stores: MakeStores, db: Inspector
) -> None:
    scopes = SCOPES[:2]
    sessions = await make_stores(PER_SCOPE * len(scopes))
    for round_no in range(ROUNDS):
        message_id = f"{SHARED_ID}-resume-{round_no}"
        cases = [await case_of(Command.RESUME, stores, db, scope) for scope in scopes]
        receipts = [Receipt.of(message_id, Command.RESUME.value, case.command) for case in cases]

        def contend(i: int, cases: list[Case] = cases, receipts: list[Receipt] = receipts) -> Awaitable[object]:
            # Contenders alternate between the scopes, each over a Postgres session of its own.
            which = i % len(scopes)
            return apply(sessions[i], Command.RESUME, cases[which].command, receipts[which])

        results = await race(len(sessions), contend)

        assert unexpected(results, (AlreadyApplied,)) == []
        won = winners(results)
        assert sorted(i % len(scopes) for i in won) == list(range(len(scopes))), results
        for case in cases:
            await assert_applied(db, case)
            assert await db.count("inbox", case.run_id) == 1
        assert [(app, tenant) for app, tenant, _, _ in await recorded(db, message_id)] == [
            (s.app, s.tenant) for s in scopes
        ]


async def test_starts_racing_under_one_id_in_two_scopes_start_one_run_per_scope(
    stores: Stores, make_stores: MakeStores, db: Inspector
) -> None:
    scopes = SCOPES[1:]
    sessions = await make_stores(PER_SCOPE * len(scopes))
    for round_no in range(ROUNDS):
        message_id = f"{SHARED_ID}-start-{round_no}"
        cases = [await case_of(Command.START, stores, db, scope) for scope in scopes]
        receipts = [Receipt.of(message_id, Command.START.value, case.command) for case in cases]

        def contend(i: int, cases: list[Case] = cases, receipts: list[Receipt] = receipts) -> Awaitable[object]:
            which = i % len(scopes)
            return apply(sessions[i], Command.START, cases[which].command, receipts[which])

        results = await race(len(sessions), contend)

        # Every loser met its scope's record (a duplicate), never the run (an identical start, None).
        assert unexpected(results, (AlreadyApplied,)) == []
        won = winners(results)
        assert sorted(i % len(scopes) for i in won) == list(range(len(scopes))), results
        assert all(results[i] is not None for i in won)
        for case in cases:
            await assert_applied(db, case)
        assert [(app, tenant) for app, tenant, _, _ in await recorded(db, message_id)] == [
            (s.app, s.tenant) for s in scopes
        ]


@pytest.fixture
async def fresh_url(pg_server: str) -> AsyncIterator[str]:
    name = f"intermission_inbox_{uuid.uuid4().hex[:16]}"
    url = pg.with_database(pg_server, name)
    await ensure_database(url)
    yield url
    await pg.drop(pg_server, name)


async def test_the_migration_keeps_every_inbox_row_under_its_scope(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    everything = migrate.migrations()
    # Applied up to this test's migration, then that one alone: what came after it is not this test's.
    at = [m.name for m in everything].index("inbox_per_scope")
    monkeypatch.setattr(migrate, "migrations", lambda: everything[:at])
    await migrate.migrate(fresh_url)
    con = await asyncpg.connect(fresh_url)
    try:
        rows: list[tuple[Any, ...]] = [
            ("m-1", "run.start", "d1", "applied", "acme", "t1", "run-1"),
            ("m-2", "run.resume", "d2", "applied", "acme", "t2", "run-2"),
        ]
        await con.executemany(
            "INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant, run_id)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7)",
            rows,
        )
        # Before: one id for every scope.
        with pytest.raises(asyncpg.UniqueViolationError):
            await con.execute(
                "INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant)"
                " VALUES ('m-1', 'run.start', 'd3', 'applied', 'acme', 't2')"
            )

        monkeypatch.setattr(migrate, "migrations", lambda: everything[: at + 1])
        assert [m.name for m in await migrate.migrate(fresh_url)] == ["inbox_per_scope"]

        kept = await con.fetch(
            "SELECT message_id, routing_key, body_digest, outcome, app, tenant, run_id FROM inbox ORDER BY message_id"
        )
        assert [tuple(r.values()) for r in kept] == rows
        key = await con.fetchval(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = 'inbox'::regclass AND contype = 'p'"
        )
        assert key == "PRIMARY KEY (app, tenant, message_id)"
        # After: the same id in another scope is another record; in its own scope it is still taken.
        await con.execute(
            "INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant)"
            " VALUES ('m-1', 'run.start', 'd3', 'applied', 'acme', 't2')"
        )
        with pytest.raises(asyncpg.UniqueViolationError):
            await con.execute(
                "INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant)"
                " VALUES ('m-1', 'run.start', 'd4', 'applied', 'acme', 't1')"
            )
    finally:
        await con.close()
