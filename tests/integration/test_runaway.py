"""Runaway runs are bounded and stoppable: progress is written per step, not per call; the tool-call budget
stops a run from its first turn; a cancel ends a RUNNING run within one step, through the RabbitMQ contract
as well; and the run row's step and token counts are right after every boundary.

The database itself counts what the fleet writes: triggers this test installs log every progress write and
the run's step count at the moment a cancel was recorded, so the assertions do not depend on timing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import pytest

from intermission.agent.loop import AgentLoop
from intermission.agent.model import ScriptedModel
from intermission.agent.tools import Tool, ToolEnv, ToolRegistry, demo_tools
from intermission.fleet.runtime import Fleet
from intermission.fleet.worker import Worker as FullWorker
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import CancelCommand, StartCommand
from intermission.schemas.config import Budget, RunConfig
from intermission.schemas.errors import InvalidState
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Role
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.store import Stores
from tests.integration.test_messaging import next_event, run_event
from tests.support.control import LocalControl
from tests.support.fleet import Worker, charges, fast_settings, outbox_keys, start_command, worker
from tests.support.inspect import Inspector
from tests.support.waiting import eventually

COUNTERS = [
    # Every write of a progress row (insert or update), by run.
    "CREATE TABLE test_progress_writes (run_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
    """CREATE FUNCTION test_count_progress_write() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN INSERT INTO test_progress_writes (run_id) VALUES (NEW.run_id); RETURN NULL; END $$""",
    """CREATE TRIGGER test_count_progress_write AFTER INSERT OR UPDATE ON progress
       FOR EACH ROW EXECUTE FUNCTION test_count_progress_write()""",
    # The run's step count in the very transaction that recorded a cancel of it while it ran.
    "CREATE TABLE test_ending_asked (run_id text NOT NULL, step_count integer NOT NULL)",
    """CREATE FUNCTION test_note_ending() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN INSERT INTO test_ending_asked VALUES (NEW.id, NEW.step_count); RETURN NULL; END $$""",
    """CREATE TRIGGER test_note_ending AFTER UPDATE ON runs
       FOR EACH ROW WHEN (OLD.ending IS NULL AND NEW.ending IS NOT NULL) EXECUTE FUNCTION test_note_ending()""",
]


@pytest.fixture
async def counted(db: Inspector) -> Inspector:
    for statement in COUNTERS:
        await db.con.execute(statement)
    return db


@pytest.fixture
async def w(stores: Stores, database_url: str) -> AsyncIterator[Worker]:
    one = worker(stores, fast_settings(database_url))
    yield one
    await one.fleet.stop(grace=5)


def echoes(n: int, step: int = 0) -> dict[str, Any]:
    return {"call": [{"tool": "echo", "arguments": {"step": step, "n": i}} for i in range(n)]}


def budget(calls: int, steps: int = 32) -> RunConfig:
    return RunConfig(max_steps=steps, budget=Budget(max_tool_calls=calls))


async def progress_writes(db: Inspector, run_id: str) -> int:
    return int(await db.con.fetchval("SELECT count(*) FROM test_progress_writes WHERE run_id = $1", run_id))


async def test_a_thousand_retry_safe_calls_in_one_step_are_saved_twice_not_a_thousand_times(
    stores: Stores, scope: Scope, w: Worker, counted: Inspector
) -> None:
    cmd = start_command(scope, [echoes(1000), {"say": "done"}], config=budget(1000))
    await w.control.start(cmd)
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "done")
    tools = [m for m in await stores.at(scope).sessions.load(cmd.run_id) if m.role is Role.TOOL]
    assert len(tools) == 1000  # every call ran and answered
    # The start's first snapshot, the step's turn (before its first call ran) and the step's boundary.
    assert await progress_writes(counted, cmd.run_id) == 3


async def test_a_non_retry_safe_call_among_many_is_still_written_to_started_before_it_runs(
    stores: Stores, scope: Scope, w: Worker, counted: Inspector
) -> None:
    turn = echoes(300)
    turn["call"].insert(150, {"tool": "charge", "arguments": {"amount": 9}})
    cmd = start_command(scope, [turn, {"say": "done"}], config=budget(301))
    await w.control.start(cmd)
    await w.drain()
    assert (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.COMPLETED
    assert await charges(stores, scope, cmd.run_id) == {"call-0-150": 1}
    # First snapshot, the turn, the charge's started save (carrying the 150 results before it), the boundary.
    assert await progress_writes(counted, cmd.run_id) == 4


async def test_the_tool_call_budget_fails_a_runaway_turn_before_any_of_its_calls_runs(
    stores: Stores, scope: Scope, database_url: str, counted: Inspector
) -> None:
    # No budget in the start: the worker's default applies, and is stored with the run. The lease is a long
    # one: checking a turn of 50,000 calls is a stretch of CPU without a pause for the event loop, and on a
    # busy machine it outlasted fast_settings' 1.5 s lease, which the worker's own reclaim sweep then took
    # over (a second first snapshot). Budgets, not leases, are what this test is about.
    w = worker(stores, fast_settings(database_url, max_tool_calls=40, lease_seconds=60, lease_renew_seconds=5))
    try:
        runaway = start_command(scope, [{"call": [{"tool": "charge", "arguments": {"amount": 1}}] * 50_000}])
        await w.control.start(runaway)
        await w.drain()
        run = await stores.at(scope).runs.get_run(runaway.run_id)
        assert run.config.budget.max_tool_calls == 40
        assert run.state is RunState.FAILED
        assert run.error is not None
        assert run.error.startswith("max_tool_calls_reached:")
        assert await charges(stores, scope, runaway.run_id) == {}  # from the first turn: nothing ran
        assert run.step_count == 1
        # The refused turn is not saved into the session, and the start's first snapshot was all it wrote.
        assert [m.role for m in await stores.at(scope).sessions.load(runaway.run_id)] == [Role.USER]
        assert await progress_writes(counted, runaway.run_id) == 1
        assert (await outbox_keys(stores, scope, runaway.run_id))[-1] == f"run.failed.{scope.app}.{scope.tenant}"

        # Per run: calls add up across turns, and the turn that would pass the budget is refused whole.
        stepwise = start_command(scope, [echoes(15, s) for s in range(5)], config=budget(40))
        await w.control.start(stepwise)
        await w.drain()
        run = await stores.at(scope).runs.get_run(stepwise.run_id)
        assert run.state is RunState.FAILED
        assert run.error is not None
        assert run.error.startswith("max_tool_calls_reached:")
        tools = [m for m in await stores.at(scope).sessions.load(stepwise.run_id) if m.role is Role.TOOL]
        assert len(tools) == 30  # two turns of 15 ran; the third (45 > 40) did not
    finally:
        await w.fleet.stop(grace=5)


async def steps_of(db: Inspector, run_id: str) -> int:
    return int(await db.con.fetchval("SELECT step_count FROM runs WHERE id = $1", run_id))


async def test_a_running_run_is_cancelled_within_one_step(
    stores: Stores, scope: Scope, w: Worker, counted: Inspector
) -> None:
    script = [echoes(10, s) for s in range(400)]  # 4,000 local calls
    cmd = start_command(scope, script, config=budget(10_000, steps=500))
    await w.control.start(cmd)
    await eventually(lambda: _at_least(counted, cmd.run_id, 5), what="the run is five steps in")

    assert await w.control.cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="runaway")) is None
    await w.drain()

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.error) == (RunState.CANCELLED, "runaway")
    asked_at = int(await counted.con.fetchval("SELECT step_count FROM test_ending_asked WHERE run_id = $1", cmd.run_id))
    # It ended at the next boundary: at most the one step in flight when the cancel committed.
    assert asked_at <= run.step_count <= asked_at + 1, (asked_at, run.step_count)
    assert run.step_count < len(script)
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert keys == [f"run.cancelled.{scope.app}.{scope.tenant}"]
    assert await counted.progress(cmd.run_id) is None
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT ending FROM runs WHERE id = $1", cmd.run_id) is None
    # Its own messages went into its session up to where it stopped, and no further.
    tools = [m for m in await stores.at(scope).sessions.load(cmd.run_id) if m.role is Role.TOOL]
    assert len(tools) <= 10 * run.step_count
    # A second cancel of the ended run is invalid_state, as for any ended run.
    with pytest.raises(InvalidState):
        await w.control.cancel(CancelCommand(scope=scope, run_id=cmd.run_id))


async def _at_least(db: Inspector, run_id: str, steps: int) -> bool:
    row = await db.con.fetchval("SELECT step_count FROM runs WHERE id = $1", run_id)
    return row is not None and int(row) >= steps


async def test_a_cancel_sent_through_rabbitmq_ends_a_running_run_and_publishes_run_cancelled(
    stores: Stores, scope: Scope, worker: FullWorker, host: HostClient, db: Inspector
) -> None:
    cmd = StartCommand(
        scope=scope,
        run_id=f"run-{uuid.uuid4().hex[:12]}",
        agent_id="demo",
        input="loop",
        script=[ScriptTurn.model_validate(echoes(10, s)) for s in range(400)],
        config=budget(10_000, steps=500),
    )
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        await eventually(lambda: _at_least(db, cmd.run_id, 3), what="the run is three steps in")
        await host.cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="enough"))
        cancelled = await next_event(events, run_event(cmd.run_id, RunEventKind.CANCELLED))
    assert isinstance(cancelled.event, RunEvent)
    assert cancelled.event.error == "enough"
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.revision) == (RunState.CANCELLED, cancelled.event.revision)
    assert 3 <= run.step_count < 400


async def test_the_run_row_counts_are_right_after_every_boundary(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(
        scope,
        [echoes(2, 0), {"call": [{"tool": "sleep", "arguments": {"seconds": 1.5}}]}, {"say": "done"}],
    )
    await w.control.start(cmd)

    async def in_the_sleep_step() -> bool:
        p = await stores.at(scope).progress.get_progress(cmd.run_id)
        return p.continuation.step_index == 2

    await eventually(in_the_sleep_step, what="the run saved the turn of its second step")
    # Saved, not paused: the row already says two steps and the tokens the two turns cost (the old code
    # wrote them at a pause only, so a run that never paused said 0 until its end, and 0 after it too).
    progress = await stores.at(scope).progress.get_progress(cmd.run_id)
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.RUNNING
    assert (run.step_count, run.tokens_used) == (2, progress.continuation.tokens_used)
    assert run.tokens_used > 0

    await w.drain()
    ended = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (ended.state, ended.output, ended.step_count) == (RunState.COMPLETED, "done", 3)
    assert ended.tokens_used > run.tokens_used  # the final turn's tokens too


class Tick(Tool):
    """Retry-safe and slow, and it leaves a trace this test can count: one entry per handler call."""

    name = "tick"
    calls: ClassVar[list[str]] = []

    async def run(self, arguments: dict[str, Any], env: ToolEnv) -> str:
        Tick.calls.append(env.call_id)
        await asyncio.sleep(0.05)
        return "tick"


async def test_a_cancel_reaches_a_run_inside_one_long_step_through_its_lease_renewal(
    stores: Stores, scope: Scope, database_url: str, counted: Inspector
) -> None:
    """One turn of 200 slow retry-safe calls saves nothing between its turn and its boundary, so only the
    lease keeper's renewal can bring the cancel: the run ends before its next call, mid-step."""
    Tick.calls.clear()
    loop = AgentLoop(ScriptedModel(), ToolRegistry([*demo_tools().all(), Tick()]))
    settings = fast_settings(database_url, lease_seconds=3, lease_renew_seconds=0.2)
    fleet = Fleet(stores, settings, loop)
    w = Worker(fleet=fleet, control=LocalControl(fleet))
    try:
        cmd = start_command(scope, [{"call": [{"tool": "tick"}] * 200}, {"say": "done"}], config=budget(200))
        await w.control.start(cmd)
        await eventually(_ticked(5), what="five calls ran")
        assert await w.control.cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="mid-step")) is None
        ran_at_cancel = len(Tick.calls)
        await w.drain()
    finally:
        await fleet.stop(grace=1)
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.error) == (RunState.CANCELLED, "mid-step")
    # Within about one renewal (0.2 s of 0.05 s calls) of the cancel, far from the 200.
    assert ran_at_cancel <= len(Tick.calls) <= ran_at_cancel + 10, (ran_at_cancel, len(Tick.calls))
    # It never reached the step's boundary: the start's snapshot, the turn, and the cancel noting its ending
    # in the snapshot are all the progress writes there were.
    assert await progress_writes(counted, cmd.run_id) == 3


def _ticked(n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return len(Tick.calls) >= n

    return check
