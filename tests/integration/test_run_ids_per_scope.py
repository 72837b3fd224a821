"""A run id is unique within its scope (migration 0015): two scopes may each have a run of one id, each
working fully and never touching the other's, and a start under another scope's id tells nothing (it creates
the starter's own run); within one scope a repeated start is still a no-op (the same request) or
``run_exists`` (another).

Against the real PostgreSQL (and RabbitMQ where hosts and workers talk through it): starts, pauses, resumes,
decisions, replies, expiries and cancels of "the same" run in two scopes; one worker holding and renewing
both at once; takeovers; pruning; and starts of one id racing in two scopes over many connections. Every
row a run leaves is read back by its whole key, and the other scope's rows are compared whole.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from decimal import Decimal
from typing import Any

import pytest

from intermission.agent.executor import RunContext
from intermission.agent.loop import default_executor
from intermission.engine.commands import Claimed, Start
from intermission.engine.core import Engine
from intermission.engine.holding import ReclaimLapsed
from intermission.engine.starts import RunDefaults
from intermission.fleet.runtime import Fleet
from intermission.fleet.worker import Worker as RunningWorker
from intermission.publishers.clients import HostClient, version_of
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
from intermission.schemas.errors import ResumeAdmissionNotFound, RunConflict, RunExists
from intermission.schemas.llm import Role
from intermission.schemas.run import Lease, NewRun, RunState
from intermission.schemas.scope import Reach, Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import ClaimVersion, Notice, Progress, SuspendReason, Suspension
from intermission.store import Stores
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.store.retention import Kept, Pruner, Retention
from intermission.wire import EVENTS_EXCHANGE
from tests.conftest import MakeStores, race
from tests.support.amqp import Captured, CaptureFactory
from tests.support.control import LocalControl
from tests.support.factories import continuation, lease, paused_run, writes
from tests.support.fleet import Worker, fast_settings, readable, start_command, worker
from tests.support.inspect import Inspector, unexpected
from tests.support.resume import admission_request, agent_reply_pause, closure_request, first_for

# Two scopes that differ in both parts of the key, and a third that differs by tenant only.
A = Scope(app="acme", tenant="t1")
B = Scope(app="globex", tenant="t1")
C = Scope(app="acme", tenant="t2")
DEFAULTS = RunDefaults(pause_ttl_seconds=0, max_steps=8)


async def start_run(
    stores: Stores, cmd: StartCommand, defaults: RunDefaults, held: Lease, *, receipt: Receipt | None = None
) -> Claimed | None:
    """The start command as a worker's handler applies it: under the worker's lease and the fleet's defaults."""
    return await Engine.over(stores).under(lease=held, defaults=defaults).apply(Start(cmd, receipt))


WAIT = 30.0
LOOKUP = {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}

# Every table that names a run besides runs itself; each carries the run's scope (app, tenant, run_id).
RUN_TABLES = (
    "suspensions",
    "checkpoints",
    "progress",
    "run_events",
    "outbox",
    "inbox",
    "resume_admissions",
    "resume_starts",
    "resume_expiries",
    "resume_closures",
    "session_messages",
    "demo_charges",
)

Rows = dict[str, list[tuple[Any, ...]]]


def shared_id() -> str:
    return f"shared-{uuid.uuid4().hex[:10]}"


async def rows_of(db: Inspector, scope: Scope, run_id: str) -> Rows:
    """Every row of the run ``run_id`` of ``scope``, read by its whole key, in a stable order."""
    found: Rows = {}
    runs = await db.con.fetch(
        "SELECT * FROM runs WHERE app = $1 AND tenant = $2 AND id = $3", scope.app, scope.tenant, run_id
    )
    found["runs"] = [tuple(r.values()) for r in runs]
    for table in RUN_TABLES:
        quoted = await db.con.fetchval("SELECT quote_ident($1)", table)
        rows = await db.con.fetch(
            f"SELECT * FROM {quoted} WHERE app = $1 AND tenant = $2 AND run_id = $3", scope.app, scope.tenant, run_id
        )
        found[table] = sorted((tuple(r.values()) for r in rows), key=repr)
    return found


async def scopes_holding(db: Inspector, run_id: str) -> dict[str, set[tuple[str, str]]]:
    """The scopes whose rows name ``run_id``, per table: none but the scopes that ran it may hold any."""
    found = {
        "runs": {
            (r["app"], r["tenant"]) for r in await db.con.fetch("SELECT app, tenant FROM runs WHERE id = $1", run_id)
        }
    }
    for table in RUN_TABLES:
        quoted = await db.con.fetchval("SELECT quote_ident($1)", table)
        rows = await db.con.fetch(f"SELECT DISTINCT app, tenant FROM {quoted} WHERE run_id = $1", run_id)
        found[table] = {(r["app"], r["tenant"]) for r in rows}
    return found


def held_by_both(*tables: str) -> dict[str, set[tuple[str, str]]]:
    """What ``scopes_holding`` finds when A and B ran the id and left rows in ``tables`` (only)."""
    both = {(A.app, A.tenant), (B.app, B.tenant)}
    return {table: (both if table in tables else set()) for table in ("runs", *RUN_TABLES)}


async def run_state(db: Inspector, scope: Scope, run_id: str) -> dict[str, Any]:
    row = await db.con.fetchrow(
        "SELECT state::text AS state, revision, input, output, error, lease_owner FROM runs"
        " WHERE app = $1 AND tenant = $2 AND id = $3",
        scope.app,
        scope.tenant,
        run_id,
    )
    assert row is not None, f"no run {run_id} at {scope}"
    return dict(row)


async def pause_of(stores: Stores, scope: Scope, run_id: str) -> tuple[Suspension, ClaimVersion]:
    at = stores.at(scope)
    pause, run = await at.suspensions.get_suspension(run_id), await at.runs.get_run(run_id)
    assert run.state is RunState.PAUSED
    return pause, ClaimVersion(run_id=run_id, suspension_id=pause.id, run_revision=run.revision)


# --- starts ----------------------------------------------------------------------------------------------


async def test_a_start_under_another_scopes_run_id_creates_its_own_run_and_a_repeat_in_one_scope_is_as_before(
    stores: Stores, db: Inspector
) -> None:
    run_id = shared_id()
    first = StartCommand(scope=A, run_id=run_id, agent_id="demo", input="for acme")
    theirs = StartCommand(scope=B, run_id=run_id, agent_id="demo", input="for globex")
    # Even under the same message id: both the run id and the message id are keys within a scope.
    mine = await start_run(stores, first, DEFAULTS, lease(), receipt=Receipt.of("m-start", "run.start", first))
    other = await start_run(stores, theirs, DEFAULTS, lease(), receipt=Receipt.of("m-start", "run.start", theirs))

    assert mine is not None
    assert other is not None  # not run_exists: A's run says nothing to B
    assert (mine.run.scope, other.run.scope) == (A, B)
    assert (await run_state(db, A, run_id))["input"] == "for acme"
    assert (await run_state(db, B, run_id))["input"] == "for globex"
    assert await scopes_holding(db, run_id) == held_by_both("runs", "progress", "inbox")

    # Within a scope nothing changed: the same start again is a no-op (its new message id is recorded as
    # applied, and nothing else is written) ...
    assert await start_run(stores, first, DEFAULTS, lease(), receipt=Receipt.of("m-again", "run.start", first)) is None
    assert await start_run(stores, theirs, DEFAULTS, lease()) is None
    # ... and another start under that id is run_exists, with nothing written, not even its inbox record.
    before = await db.snapshot()
    with pytest.raises(AlreadyApplied):
        await start_run(stores, first, DEFAULTS, lease(), receipt=Receipt.of("m-start", "run.start", first))
    different = first.model_copy(update={"input": "another start"})
    with pytest.raises(RunExists):
        await start_run(stores, different, DEFAULTS, lease(), receipt=Receipt.of("m-other", "run.start", different))
    with pytest.raises(RunExists):
        await writes(stores, B).runs.create_run(NewRun(run_id=run_id, agent_id="demo", input="another start"))
    assert await db.snapshot() == before
    # And a third scope that differs by tenant only has its own run of the id too.
    assert (await writes(stores, C).runs.create_run(NewRun(run_id=run_id, agent_id="demo"))).fresh is True


async def test_starts_of_one_id_racing_in_two_scopes_each_create_their_own_run(
    make_stores: MakeStores, db: Inspector
) -> None:
    """Over separate connections at once: per scope exactly one start creates the run; the others in that
    scope find it (the same request: a no-op; another: run_exists), and never the other scope's."""
    scopes = (A, B)
    sessions = await make_stores(16)
    for _round in range(3):
        run_id = shared_id()
        # In each scope half the contenders ask for one run, half for another under the same id.
        asked = {
            (s, k): NewRun(run_id=run_id, agent_id="demo", input=f"{k} for {s}") for s in scopes for k in ("one", "two")
        }

        def contend(i: int, asked: dict[tuple[Scope, str], NewRun] = asked) -> Awaitable[Any]:
            scope, kind = scopes[i % 2], ("one", "two")[(i // 2) % 2]
            return writes(sessions[i], scope).runs.create_run(asked[(scope, kind)])

        results = await race(len(sessions), contend)

        assert unexpected(results, (RunExists,)) == []
        for n, scope in enumerate(scopes):
            mine = [(i, r) for i, r in enumerate(results) if i % 2 == n]
            fresh = [(i, r) for i, r in mine if not isinstance(r, BaseException) and r.fresh]
            assert len(fresh) == 1, mine
            won = fresh[0][1].run.input
            assert (await run_state(db, scope, run_id))["input"] == won
            for i, r in mine:
                kind = ("one", "two")[(i // 2) % 2]
                same = asked[(scope, kind)].input == won
                # The same request as the winner's: a no-op; another: run_exists.
                assert isinstance(r, RunExists) != same, (i, r)
        assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id = $1", run_id) == 2


# --- the whole life of a run, through the broker ---------------------------------------------------------


def script(scope: Scope) -> list[ScriptTurn]:
    return [ScriptTurn.model_validate(LOOKUP), ScriptTurn.model_validate({"say": f"done in {scope}"})]


def bodies(got: list[Captured]) -> list[dict[str, Any]]:
    return [json.loads(m.body) for m in got]


def heard(got: list[Captured], prefix: str) -> bool:
    return any((m.routing_key or "").startswith(prefix) for m in got)


def assert_only_its_own(got: list[Captured], scope: Scope, run_id: str) -> None:
    """Every event of a scope's stream names that scope and that run, and goes out under its keys."""
    assert got
    for m, body in zip(got, bodies(got), strict=True):
        assert (m.routing_key or "").endswith(f".{scope.routing_suffix()}"), m.routing_key
        assert body["scope"] == {"app": scope.app, "tenant": scope.tenant}, body
        assert body["run_id"] == run_id, body


async def test_two_scopes_run_one_id_through_the_broker_each_seeing_only_its_own_run(
    worker: RunningWorker,
    host: HostClient,
    stores: Stores,
    db: Inspector,
    capture: CaptureFactory,
    amqp_url: str,
) -> None:
    run_id = shared_id()
    scopes = (A, B)
    streams = {s: await capture(amqp_url, EVENTS_EXCHANGE, f"*.*.{s.routing_suffix()}") for s in scopes}
    for s in scopes:
        await host.start(StartCommand(scope=s, run_id=run_id, agent_id="demo", input=f"for {s}", script=script(s)))

    notices: dict[Scope, Notice] = {}
    for s in scopes:
        got = await streams[s].wait_for(lambda got: heard(got, "notice."), within=WAIT, what=f"the Notice of {s}")
        (notice,) = [Notice.model_validate_json(m.body) for m in got if (m.routing_key or "").startswith("notice.")]
        notices[s] = notice
    assert notices[A].suspension_id != notices[B].suspension_id
    for s in scopes:
        assert (notices[s].run_id, notices[s].scope) == (run_id, s)
        pause = await stores.at(s).suspensions.get_suspension(run_id)
        assert (pause.id, pause.scope) == (notices[s].suspension_id, s)

    for s in scopes:
        answer = ToolAnswer(call_id=notices[s].pending[0].id, content=f"the answer for {s}")
        await host.resume(ResumeCommand(scope=s, version=version_of(notices[s]), results=[answer]))
    for s in scopes:
        await streams[s].wait_for(lambda got: heard(got, "run.completed."), within=WAIT, what=f"the end of {s}")
    await worker.fleet.drain()

    for s in scopes:
        got = streams[s].messages
        assert_only_its_own(got, s, run_id)
        assert sorted(".".join((m.routing_key or "").split(".")[:2]) for m in got) == [
            "notice.external_tool",
            "run.completed",
            "run.resumed",
        ]
        assert await run_state(db, s, run_id) == {
            "state": "completed",
            "revision": 3,  # the start's 0, the pause, the claim, the end
            "input": f"for {s}",
            "output": f"done in {s}",
            "error": None,
            "lease_owner": None,
        }
        # Each run's own answer reached its own model, in its own session.
        tools = [m.content for m in await stores.at(s).sessions.load(run_id) if m.role is Role.TOOL]
        assert tools == [f"the answer for {s}"]
        keys = await db.con.fetch(
            "SELECT routing_key FROM outbox WHERE app = $1 AND tenant = $2 AND run_id = $3", s.app, s.tenant, run_id
        )
        assert len(keys) == 3
        assert all(k["routing_key"].endswith(f".{s.routing_suffix()}") for k in keys)
    assert await scopes_holding(db, run_id) == held_by_both("runs", "run_events", "outbox", "inbox", "session_messages")


async def test_a_cancel_in_one_scope_leaves_the_other_scopes_run_of_that_id_as_it_was(
    worker: RunningWorker,
    host: HostClient,
    stores: Stores,
    db: Inspector,
    capture: CaptureFactory,
    amqp_url: str,
) -> None:
    run_id = shared_id()
    scopes = (A, B)
    streams = {s: await capture(amqp_url, EVENTS_EXCHANGE, f"*.*.{s.routing_suffix()}") for s in scopes}
    for s in scopes:
        await host.start(StartCommand(scope=s, run_id=run_id, agent_id="demo", script=script(s)))
    for s in scopes:
        await streams[s].wait_for(lambda got: heard(got, "notice."), within=WAIT, what=f"the Notice of {s}")
    await worker.fleet.drain()
    # A Notice is marked sent once its publisher confirm is back, which may be after it was heard.
    await db.wait_until("SELECT bool_and(sent_at IS NOT NULL) FROM outbox WHERE run_id = $1", run_id)
    untouched = await rows_of(db, B, run_id)

    await host.cancel(CancelCommand(scope=A, run_id=run_id, reason="no longer needed"))
    await streams[A].wait_for(lambda got: heard(got, "run.cancelled."), within=WAIT, what="A's cancellation")
    await worker.fleet.drain()

    assert (await run_state(db, A, run_id))["state"] == "cancelled"
    assert await rows_of(db, B, run_id) == untouched
    assert not heard(streams[B].messages, "run.cancelled.")
    # B's run still answers to its own pause, and ends its own way.
    (notice,) = [
        Notice.model_validate_json(m.body) for m in streams[B].messages if (m.routing_key or "").startswith("notice.")
    ]
    await host.resume(
        ResumeCommand(scope=B, version=version_of(notice), results=[ToolAnswer(call_id=notice.pending[0].id)])
    )
    await streams[B].wait_for(lambda got: heard(got, "run.completed."), within=WAIT, what="B's end")
    await worker.fleet.drain()
    assert (await run_state(db, B, run_id))["state"] == "completed"
    assert (await run_state(db, A, run_id))["state"] == "cancelled"
    for s in scopes:
        assert_only_its_own(streams[s].messages, s, run_id)


# --- decisions, replies and expiries, applied in this process ---------------------------------------------


@pytest.fixture
async def w(stores: Stores, database_url: str) -> AsyncIterator[Worker]:
    one = worker(stores, fast_settings(database_url, pause_ttl_seconds=0))
    yield one
    await one.fleet.stop(grace=5)


async def test_decisions_on_one_id_in_two_scopes_each_decide_only_their_own_run(
    stores: Stores, db: Inspector, w: Worker
) -> None:
    run_id = shared_id()
    email = {"call": [{"tool": "send_email", "arguments": {"to": "cfo@example.com", "subject": "Q3"}}]}
    for s in (A, B):
        await w.control.start(start_command(s, [email], run_id=run_id))
    await w.drain()
    pauses = {s: await pause_of(stores, s, run_id) for s in (A, B)}
    assert pauses[A][0].checkpoint_id != pauses[B][0].checkpoint_id

    # B's checkpoint named under A's run is no checkpoint of A's run: refused, nothing written.
    theirs = pauses[B][0].checkpoint_id
    assert theirs is not None
    before = await db.snapshot()
    with pytest.raises(RunConflict):
        await w.control.decide(
            DecideCommand(scope=A, version=pauses[A][1], checkpoint_id=theirs, decision=Decision.APPROVE),
            principal="alice",
        )
    assert await db.snapshot() == before

    for s, decision in ((A, Decision.APPROVE), (B, Decision.DENY)):
        pause, version = pauses[s]
        assert pause.checkpoint_id is not None
        await w.control.decide(
            DecideCommand(
                scope=s, version=version, checkpoint_id=pause.checkpoint_id, decision=decision, reason=f"{s} says"
            ),
            principal="alice",
        )
    await w.drain()
    assert (await run_state(db, A, run_id))["state"] == "completed"
    assert (await run_state(db, B, run_id))["error"] == f"{B} says"
    for s, state in ((A, "approved"), (B, "denied")):
        checkpoints = await db.con.fetch(
            "SELECT state, decided_by FROM checkpoints WHERE app = $1 AND tenant = $2 AND run_id = $3",
            s.app,
            s.tenant,
            run_id,
        )
        assert [tuple(c.values()) for c in checkpoints] == [(state, "alice")]


async def test_a_reply_to_one_scopes_run_of_an_id_admits_only_that_run(
    stores: Stores, db: Inspector, w: Worker
) -> None:
    run_id = shared_id()
    ask = {"call": [{"tool": "ask_agent", "arguments": {"agent": "pricer", "question": "how much?"}}]}
    for s in (A, B):
        await w.control.start(start_command(s, [ask, {"say": f"priced in {s}"}], run_id=run_id))
    await w.drain()
    pauses = {s: await pause_of(stores, s, run_id) for s in (A, B)}
    untouched = await rows_of(db, B, run_id)

    pause, version = pauses[A]
    reply = ReplyCommand(scope=A, version=version, reply_with=pause.pending[0].reply_with, input='"twelve"')
    assert await w.control.reply(reply, correlation_id="bus-a") is not None
    await w.drain()
    assert (await run_state(db, A, run_id))["state"] == "completed"
    assert await rows_of(db, B, run_id) == untouched
    # The reply admitted is A's alone: B's run has no admission.
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(B).resume.get_resume_admission(run_id, pauses[B][0].id)

    pause, version = pauses[B]
    reply = ReplyCommand(scope=B, version=version, reply_with=pause.pending[0].reply_with, input='"thirteen"')
    assert await w.control.reply(reply, correlation_id="bus-b") is not None
    await w.drain()
    for s, said in ((A, b'"twelve"'), (B, b'"thirteen"')):
        assert (await run_state(db, s, run_id))["output"] == f"priced in {s}"
        admissions = await db.con.fetch(
            "SELECT suspension_id, input FROM resume_admissions WHERE app = $1 AND tenant = $2 AND run_id = $3",
            s.app,
            s.tenant,
            run_id,
        )
        assert [tuple(a.values()) for a in admissions] == [(pauses[s][0].id, said)]
        starts = await db.con.fetchval(
            "SELECT count(*) FROM resume_starts WHERE app = $1 AND tenant = $2 AND run_id = $3", s.app, s.tenant, run_id
        )
        assert starts == 1


async def test_an_expiry_of_one_scopes_run_of_an_id_fails_only_that_run(
    stores: Stores, db: Inspector, database_url: str
) -> None:
    one = worker(stores, fast_settings(database_url, pause_ttl_seconds=1))
    try:
        run_id = shared_id()
        await one.control.start(start_command(A, [LOOKUP], run_id=run_id))
        await one.control.start(start_command(B, [LOOKUP], run_id=run_id, pause_ttl_seconds=0))
        await one.drain()
        pause, version = await pause_of(stores, A, run_id)
        assert pause.expires_at is not None
        assert (await stores.at(B).suspensions.get_suspension(run_id)).expires_at is None
        await db.wait_until(
            "SELECT expires_at <= now() FROM suspensions WHERE app = $1 AND tenant = $2 AND run_id = $3",
            A.app,
            A.tenant,
            run_id,
        )
        untouched = await rows_of(db, B, run_id)
        # What the sweeper finds (A's pause only) and the command it publishes for it.
        found = await stores.across_scopes.list_expired_paused(await stores.across_scopes.database_now(), None, 10)
        assert [(p.scope, p.run_id) for p in found] == [(A, run_id)]
        await one.control.expire(ExpireCommand(scope=A, version=version, expired_by=pause.expires_at))
        await one.drain()
        failed = await run_state(db, A, run_id)
        assert failed["state"] == "failed"
        assert "suspension_expired" in (failed["error"] or "")
        assert await rows_of(db, B, run_id) == untouched
    finally:
        await one.fleet.stop(grace=5)


# --- one worker, both runs at once; takeovers -------------------------------------------------------------


class Gate:
    """An executor that holds every run it is given until released, then runs it as the demo agent does."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.entered: list[tuple[Scope, str]] = []
        self.all_in = asyncio.Event()
        self.release = asyncio.Event()
        self.inner = default_executor()

    async def execute(self, ctx: RunContext) -> None:
        self.entered.append((ctx.scope, ctx.run.id))
        if len(self.entered) == self.expected:
            self.all_in.set()
        await self.release.wait()
        await self.inner.execute(ctx)


async def lease_expiry(db: Inspector, scope: Scope, run_id: str) -> Any:
    return await db.con.fetchval(
        "SELECT lease_expires_at FROM runs WHERE app = $1 AND tenant = $2 AND id = $3", scope.app, scope.tenant, run_id
    )


async def test_one_worker_holds_and_renews_runs_of_one_id_in_two_scopes_at_once(
    stores: Stores, db: Inspector, database_url: str
) -> None:
    gate = Gate(expected=2)
    fleet = Fleet(stores, fast_settings(database_url), gate)
    one = Worker(fleet=fleet, control=LocalControl(fleet))
    try:
        run_id = shared_id()
        for s in (A, B):
            await one.control.start(start_command(s, [{"say": f"done in {s}"}], run_id=run_id))
        async with asyncio.timeout(WAIT):
            await gate.all_in.wait()
        assert sorted(gate.entered, key=str) == sorted([(A, run_id), (B, run_id)], key=str)
        assert (fleet.running, fleet.keeper.held) == (2, 2)

        # One renewal renews both, each at its own scope.
        before = {s: await lease_expiry(db, s, run_id) for s in (A, B)}
        await fleet.keeper.renew_once()
        after = {s: await lease_expiry(db, s, run_id) for s in (A, B)}
        assert all(after[s] > before[s] for s in (A, B)), (before, after)
        assert fleet.keeper.held == 2

        gate.release.set()
        await one.drain()
        for s in (A, B):
            assert (await run_state(db, s, run_id))["output"] == f"done in {s}"
        assert (fleet.running, fleet.keeper.held) == (0, 0)
    finally:
        gate.release.set()
        await fleet.stop(grace=5)


async def test_takeovers_of_lapsed_runs_of_one_id_in_two_scopes_take_each_with_its_own_snapshot(
    stores: Stores, db: Inspector
) -> None:
    run_id = shared_id()
    dead = Lease(owner="a-worker-that-died", ttl_seconds=0.2)
    for step, s in enumerate((A, B, C), start=3):
        first = Progress(run_id=run_id, owner=dead.owner, continuation=continuation(step))
        await writes(stores, s).runs.create_run(NewRun(run_id=run_id, agent_id="demo", input=f"for {s}"), dead, first)
    for s in (A, B, C):
        await db.wait_until(
            "SELECT lease_expires_at <= now() FROM runs WHERE app = $1 AND tenant = $2 AND id = $3",
            s.app,
            s.tenant,
            run_id,
        )

    # One run at its scope: only that one.
    alone = lease("one-taker")
    taken = await writes(stores, C).runs.claim_continuation_leased(run_id, alone)
    assert (taken.scope, taken.lease_owner) == (C, alone.owner)
    for s in (A, B):
        assert (await run_state(db, s, run_id))["lease_owner"] == dead.owner

    # The sweep: every lapsed run of every scope, each with its own snapshot handed over.
    taker = lease("the-taker")
    swept = readable(await Engine.over(stores).apply(ReclaimLapsed(taker, 10)))
    assert sorted((str(r.run.scope), r.run.id, r.run.input) for r in swept) == [
        (str(A), run_id, f"for {A}"),
        (str(B), run_id, f"for {B}"),
    ]
    for r in swept:
        assert r.progress is not None
        assert (r.progress.scope, r.progress.owner) == (r.run.scope, taker.owner)
        assert r.progress.continuation.step_index == (3 if r.run.scope == A else 4)
    owners = await db.con.fetch(
        "SELECT r.app, r.tenant, r.lease_owner, g.owner FROM runs r"
        " JOIN progress g ON g.app = r.app AND g.tenant = r.tenant AND g.run_id = r.id"
        " WHERE r.id = $1 ORDER BY r.app, r.tenant",
        run_id,
    )
    assert [tuple(o.values()) for o in owners] == [
        ("acme", "t1", taker.owner, taker.owner),
        ("acme", "t2", alone.owner, alone.owner),
        ("globex", "t1", taker.owner, taker.owner),
    ]


async def test_another_worker_takes_over_runs_of_one_id_in_two_scopes_and_ends_each_its_own_way(
    stores: Stores, db: Inspector, w: Worker
) -> None:
    """Runs of one id whose worker died mid-run: the surviving worker's reclaim sweep continues both."""
    run_id = shared_id()
    dead = Lease(owner="a-worker-that-died", ttl_seconds=0.2)
    for s in (A, B):
        started = start_command(s, [{"say": f"done in {s}"}], run_id=run_id)
        assert await start_run(stores, started, DEFAULTS, dead) is not None
    await w.drain(wait_for_lapsed=True)
    for s in (A, B):
        assert await run_state(db, s, run_id) == {
            "state": "completed",
            "revision": 1,
            "input": "please help",
            "output": f"done in {s}",
            "error": None,
            "lease_owner": None,
        }


async def test_the_console_shows_each_scopes_run_of_an_id_only_to_whom_that_scope_is_granted(
    stores: Stores,
) -> None:
    run_id = shared_id()
    mine = await paused_run(stores, A, run_id=run_id, reason=SuspendReason.APPROVAL)
    theirs = await paused_run(stores, B, run_id=run_id, reason=SuspendReason.APPROVAL)
    only_a = stores.granted(Reach(scopes=(A,)))
    both = stores.granted(Reach(scopes=(A, B)))

    seen = await only_a.run(A, run_id)
    assert seen is not None
    assert seen.pause is not None
    assert (seen.run.scope, seen.pause.suspension_id) == (A, mine.suspension.id)
    assert [k.suspension_id for k in seen.checkpoints] == [mine.suspension.id]
    assert await only_a.run(B, run_id) is None  # as if there were no such run
    assert [(x.scope, x.suspension_id) for x in await only_a.approvals()] == [(A, mine.suspension.id)]
    for scope, paused in ((A, mine), (B, theirs)):
        view = await both.run(scope, run_id)
        assert view is not None
        assert view.pause is not None
        assert (view.run.scope, view.pause.suspension_id) == (scope, paused.suspension.id)
        assert [k.suspension_id for k in view.checkpoints] == [paused.suspension.id]
        assert [h.data["suspension_id"] for h in view.history] == [paused.suspension.id]
    assert sorted((x.scope.app, x.suspension_id) for x in await both.approvals()) == sorted(
        [(A.app, mine.suspension.id), (B.app, theirs.suspension.id)]
    )


# --- pruning ---------------------------------------------------------------------------------------------


async def test_pruning_one_scopes_ended_run_leaves_the_other_scopes_runs_of_that_id_whole(
    stores: Stores, db: Inspector
) -> None:
    run_id = shared_id()
    # A: an agent reply admitted, started and closed (the closure ends the run), with a demo charge.
    ended = await agent_reply_pause(stores, A, run_id=run_id)
    admitted = await writes(stores, A).resume.admit_resume(admission_request(ended, A))
    await writes(stores, A).resume.start_resume(run_id, ended.suspension.id, admitted.request_digest)
    await stores.at(A).ledger.charge(run_id, "call-a", Decimal(5))
    await writes(stores, A).resume.close_resume(await closure_request(stores, A, ended))
    assert (await run_state(db, A, run_id))["state"] == "failed"
    # B: the same id, alive: its agent reply admitted under a lease (the pause kept, progress written),
    # with a charge. C: the same id, paused on an approval (a pending checkpoint).
    live = await agent_reply_pause(stores, B, run_id=run_id)
    held = lease()
    admission = await writes(stores, B).resume.admit_resume_leased(
        admission_request(live, B), held, first_for(live, held)
    )
    await stores.at(B).ledger.charge(run_id, "call-b", Decimal(7))
    await paused_run(stores, C, run_id=run_id, reason=SuspendReason.APPROVAL)
    kept = {s: await rows_of(db, s, run_id) for s in (B, C)}
    assert all(kept[B][t] for t in ("runs", "suspensions", "progress", "resume_admissions", "demo_charges"))
    assert all(kept[C][t] for t in ("runs", "suspensions", "checkpoints", "run_events"))
    gone = await rows_of(db, A, run_id)
    assert all(gone[t] for t in ("runs", "resume_admissions", "resume_starts", "resume_closures", "demo_charges"))

    await db.con.execute(
        "UPDATE runs SET ended_at = now() - interval '2 days' WHERE app = $1 AND tenant = $2 AND id = $3",
        A.app,
        A.tenant,
        run_id,
    )
    pruner = Pruner(stores.db, Retention(runs=86400, inbox=86400, outbox=86400, sessions=86400))
    # The dry run counts A's rows only.
    due = await pruner.prunable()
    assert due["runs"] == 1
    for table in PRUNED_WITH_THE_RUN:
        assert due[table] == len(gone[table]), table
    counts = await pruner.prune_batch(Kept.RUNS)
    assert counts == {t: len(gone[t]) for t in ("runs", *PRUNED_WITH_THE_RUN) if gone[t]}

    left = await rows_of(db, A, run_id)
    # The outbox, the inbox and the session keep their own retention; nothing else of A's run is left.
    assert {t: rows for t, rows in left.items() if rows and t not in ("outbox", "inbox", "session_messages")} == {}
    for s in (B, C):
        assert await rows_of(db, s, run_id) == kept[s]
    # B's run goes on: its admitted reply is started, under its lease.
    started = await writes(stores, B).resume.start_resume_leased(
        run_id, live.suspension.id, admission.request_digest, held, first_for(live, held)
    )
    assert started.fresh
    assert (await run_state(db, B, run_id))["lease_owner"] == held.owner


PRUNED_WITH_THE_RUN = (
    "suspensions",
    "checkpoints",
    "progress",
    "resume_admissions",
    "resume_starts",
    "resume_expiries",
    "resume_closures",
    "run_events",
    "demo_charges",
)


async def test_the_stores_plain_claims_take_only_the_pause_of_their_own_scope(stores: Stores, db: Inspector) -> None:
    """The original's claims (by run id, at the handle's scope) never reach another scope's pause of the id."""
    run_id = shared_id()
    mine = await paused_run(stores, A, run_id=run_id)
    await paused_run(stores, B, run_id=run_id, reason=SuspendReason.APPROVAL)
    untouched = await rows_of(db, B, run_id)
    claimed = await writes(stores, A).suspensions.claim_suspension(run_id)
    assert (claimed.run.scope, claimed.suspension.id) == (A, mine.suspension.id)
    assert await rows_of(db, B, run_id) == untouched
