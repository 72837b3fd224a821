"""Real crashes of a worker process running the pydantic-ai example agent: the worker SIGKILLs itself at a
named point (tests/support/crash.py), a second worker process takes the run over, and the ``demo_charges``
ledger shows that no non-retry-safe call ran twice; the run row, its pauses and the published events show
that the run ended once, with one Notice per pause."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from intermission import points
from intermission.fleet.settings import Settings
from intermission.integrations.pydantic_ai import OUTCOME_UNKNOWN
from intermission.publishers.clients import HostClient, Received, Subscription, version_of
from intermission.schemas.commands import DecideCommand, Decision, ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Role
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store import Stores
from tests.support.fleet import charges, outbox_keys, suspension_count
from tests.support.waiting import eventually
from tests.support.worker_process import WorkerProcess, worker_process

WAIT = 30.0
EXECUTOR = "tests.examples.pydantic_ai_agent:executor"


def start(scope: Scope, *turns: Any) -> StartCommand:
    return StartCommand(
        scope=scope, run_id=f"pyd-{uuid.uuid4().hex[:12]}", agent_id="pydantic-ai", input=json.dumps(list(turns))
    )


async def next_event(events: Subscription[Any], wanted: Callable[[Received[Any]], bool]) -> Any:
    async with asyncio.timeout(WAIT):
        async for received in events:
            if wanted(received):
                return received.event
    raise AssertionError("the subscription ended")


def notice_of(run_id: str) -> Callable[[Received[Any]], bool]:
    return lambda r: isinstance(r.event, Notice) and r.event.run_id == run_id


def end_of(run_id: str) -> Callable[[Received[Any]], bool]:
    terminal = {RunEventKind.COMPLETED, RunEventKind.FAILED, RunEventKind.CANCELLED}
    return lambda r: isinstance(r.event, RunEvent) and r.event.run_id == run_id and r.event.kind in terminal


@asynccontextmanager
async def crashing(settings: Settings, tmp_path: Path, point: str, after: int = 0) -> AsyncIterator[WorkerProcess]:
    """A worker process that SIGKILLs itself at ``point`` (after ``after`` earlier passes); the block must
    make it get there, and leaving it requires that it died exactly so."""
    async with worker_process(
        settings, EXECUTOR, tmp_path / f"crash-{point}.log", crash_at=point, crash_after=after
    ) as w:
        yield w
        code = await w.died(within=WAIT)
        assert code == -signal.SIGKILL, f"the worker did not die at {point}: rc={code}\n{w.stderr()}"


def survivor(settings: Settings, tmp_path: Path) -> Any:
    return worker_process(settings, EXECUTOR, tmp_path / "survivor.log")


async def assert_ended_once(stores: Stores, scope: Scope, run_id: str) -> None:
    run = await stores.at(scope).runs.get_run(run_id)
    assert run.state is RunState.COMPLETED, (run.state, run.error)
    assert await suspension_count(stores, scope, run_id) == 0
    keys = await outbox_keys(stores, scope, run_id)
    assert sum(k.startswith("run.completed.") for k in keys) == 1, keys
    assert sum(k.startswith("notice.") for k in keys) == sum(k.startswith("run.resumed.") for k in keys), keys
    assert all(times == 1 for times in (await charges(stores, scope, run_id)).values())


async def running_with_started(stores: Stores, scope: Scope, run_id: str) -> list[str]:
    """The dead worker's run: still running (its lease lapses), its snapshot naming the call it died in."""
    run = await stores.at(scope).runs.get_run(run_id)
    assert run.state is RunState.RUNNING
    progress = await stores.at(scope).progress.get_progress(run_id)
    return [c.id for c in progress.started]


async def test_killed_inside_an_approved_non_retry_safe_call(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, tmp_path: Path
) -> None:
    cmd = start(scope, [["send_payment", {"to": "bob", "amount": 5}]], "done: {results}")
    async with host.subscribe(scope) as events:
        async with crashing(settings, tmp_path, points.AFTER_STARTED):
            await host.start(cmd)
            n = await next_event(events, notice_of(cmd.run_id))
            assert n.reason is SuspendReason.APPROVAL
            assert n.checkpoint_id is not None
            await host.decide(
                DecideCommand(
                    scope=scope, version=version_of(n), checkpoint_id=n.checkpoint_id, decision=Decision.APPROVE
                )
            )
        # The payment ran once, and the worker died before its result was saved.
        assert await charges(stores, scope, cmd.run_id) == {"send_payment-0-0": 1}
        assert await running_with_started(stores, scope, cmd.run_id) == ["send_payment-0-0"]
        async with survivor(settings, tmp_path):
            done = await next_event(events, end_of(cmd.run_id))
    assert done.kind is RunEventKind.COMPLETED, done
    assert done.output == f'done: send_payment={{"error":"{OUTCOME_UNKNOWN}"}}'
    assert await charges(stores, scope, cmd.run_id) == {"send_payment-0-0": 1}
    await assert_ended_once(stores, scope, cmd.run_id)
    session = await stores.at(scope).sessions.load(cmd.run_id)
    assert [m.tool_call_id for m in session if m.role is Role.TOOL and OUTCOME_UNKNOWN in m.content] == [
        "send_payment-0-0"
    ]


async def test_killed_after_a_non_retry_safe_call_ran_in_a_new_turn(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, tmp_path: Path
) -> None:
    # The takeover is shown the saved turn's tools node again: its ledger must be kept, not reset.
    cmd = start(scope, [["charge", {"amount": 3}], ["echo", {"text": "b"}]], "done: {results}")
    async with host.subscribe(scope) as events:
        async with crashing(settings, tmp_path, points.AFTER_STARTED):
            await host.start(cmd)
        assert await charges(stores, scope, cmd.run_id) == {"charge-0-0": 1}
        assert await running_with_started(stores, scope, cmd.run_id) == ["charge-0-0"]
        async with survivor(settings, tmp_path):
            done = await next_event(events, end_of(cmd.run_id))
    assert done.output == f'done: charge={{"error":"{OUTCOME_UNKNOWN}"}}; echo=b'
    assert await charges(stores, scope, cmd.run_id) == {"charge-0-0": 1}
    await assert_ended_once(stores, scope, cmd.run_id)


async def test_killed_right_after_a_saved_turn(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, tmp_path: Path
) -> None:
    # The first boundary: the model's turn is saved, none of its calls has run.
    cmd = start(scope, [["echo", {"text": "a"}], ["charge", {"amount": 3}]], "done: {results}")
    async with host.subscribe(scope) as events:
        async with crashing(settings, tmp_path, points.BETWEEN_STEPS):
            await host.start(cmd)
        assert await charges(stores, scope, cmd.run_id) == {}
        assert await running_with_started(stores, scope, cmd.run_id) == []
        async with survivor(settings, tmp_path):
            done = await next_event(events, end_of(cmd.run_id))
    assert done.output is not None
    assert done.output.startswith("done: echo=a; charge=receipt ")
    assert await charges(stores, scope, cmd.run_id) == {"charge-0-1": 1}
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.step_count == 2  # the saved turn was not asked of the model again
    await assert_ended_once(stores, scope, cmd.run_id)


async def test_killed_after_a_turns_results_were_saved(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, tmp_path: Path
) -> None:
    # The second boundary: the turn's results are saved, the next model request has not been made.
    cmd = start(scope, [["charge", {"amount": 4}]], [["echo", {"text": "x"}]], "done: {results}")
    async with host.subscribe(scope) as events:
        async with crashing(settings, tmp_path, points.BETWEEN_STEPS, after=1):
            await host.start(cmd)
        assert await charges(stores, scope, cmd.run_id) == {"charge-0-0": 1}
        async with survivor(settings, tmp_path):
            done = await next_event(events, end_of(cmd.run_id))
    assert done.output == "done: echo=x"
    assert await charges(stores, scope, cmd.run_id) == {"charge-0-0": 1}
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.step_count == 3
    await assert_ended_once(stores, scope, cmd.run_id)


async def test_killed_right_after_a_pause_committed(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, tmp_path: Path
) -> None:
    cmd = start(scope, [["charge", {"amount": 1}], ["lookup", {"query": "q"}]], "done: {results}")
    async with host.subscribe(scope) as events:
        async with crashing(settings, tmp_path, points.AFTER_PAUSE):
            await host.start(cmd)
        run = await stores.at(scope).runs.get_run(cmd.run_id)
        assert run.state is RunState.PAUSED
        assert await suspension_count(stores, scope, cmd.run_id) == 1

        async def one_notice() -> bool:
            return sum(k.startswith("notice.") for k in await outbox_keys(stores, scope, cmd.run_id)) == 1

        await eventually(one_notice, within=WAIT, what="the pause's Notice")
        async with survivor(settings, tmp_path):
            n = await next_event(events, notice_of(cmd.run_id))
            await host.resume(
                ResumeCommand(
                    scope=scope, version=version_of(n), results=[ToolAnswer(call_id=n.pending[0].id, content="42")]
                )
            )
            done = await next_event(events, end_of(cmd.run_id))
    assert done.output is not None
    assert done.output.startswith("done: charge=receipt ")
    assert done.output.endswith("; lookup=42")
    assert await charges(stores, scope, cmd.run_id) == {"charge-0-0": 1}
    await assert_ended_once(stores, scope, cmd.run_id)


async def test_killed_between_a_resumes_commit_and_its_acknowledgement(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, tmp_path: Path
) -> None:
    # The start's commit passes; the resume's kills: its claim and first snapshot (the host's answer) are
    # committed, its message is not acknowledged and comes again to the survivor.
    cmd = start(scope, [["lookup", {"query": "q"}]], [["charge", {"amount": 3}]], "done: {results}")
    async with host.subscribe(scope) as events:
        async with crashing(settings, tmp_path, points.AFTER_COMMIT, after=1):
            await host.start(cmd)
            n = await next_event(events, notice_of(cmd.run_id))
            resume_id = await host.resume(
                ResumeCommand(
                    scope=scope, version=version_of(n), results=[ToolAnswer(call_id=n.pending[0].id, content="42")]
                )
            )
        assert await running_with_started(stores, scope, cmd.run_id) == []
        progress = await stores.at(scope).progress.get_progress(cmd.run_id)
        assert [(r.call_id, r.content) for r in progress.done] == [("lookup-0-0", "42")]
        async with survivor(settings, tmp_path):
            done = await next_event(events, end_of(cmd.run_id))
    assert done.output is not None
    assert done.output.startswith("done: charge=receipt ")
    assert await charges(stores, scope, cmd.run_id) == {"charge-1-0": 1}
    await assert_ended_once(stores, scope, cmd.run_id)
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 1  # one effect, for two deliveries
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM inbox WHERE message_id = $1", resume_id) == 1
    session = await stores.at(scope).sessions.load(cmd.run_id)
    assert next((m.tool_call_id, m.content) for m in session if m.role is Role.TOOL) == ("lookup-0-0", "42")


async def test_sigterm_releases_the_run_at_its_next_boundary_and_another_worker_continues_it(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, tmp_path: Path
) -> None:
    cmd = start(scope, [["wait", {"seconds": 1}]], [["charge", {"amount": 4}]], "done: {results}")
    async with host.subscribe(scope) as events:
        async with worker_process(settings, EXECUTOR, tmp_path / "stopped.log") as first:

            async def turn_saved() -> bool:
                async with stores.db.connection() as con:
                    found = await con.raw.fetchval("SELECT count(*) FROM progress WHERE run_id = $1", cmd.run_id)
                return bool(found)

            await host.start(cmd)
            await eventually(turn_saved, within=WAIT, what="the first turn saved")
            first.proc.send_signal(signal.SIGTERM)
            assert await first.died(within=WAIT) == 0, first.stderr()
        # Released at the boundary after the wait: the lease is gone, the next turn not begun.
        run = await stores.at(scope).runs.get_run(cmd.run_id)
        assert run.state is RunState.RUNNING
        progress = await stores.at(scope).progress.get_progress(cmd.run_id)
        assert (progress.continuation.step_index, progress.started) == (1, [])
        async with stores.db.connection() as con:
            assert await con.raw.fetchval("SELECT lease_expires_at <= now() FROM runs WHERE id = $1", cmd.run_id)
        assert await charges(stores, scope, cmd.run_id) == {}
        async with survivor(settings, tmp_path):
            done = await next_event(events, end_of(cmd.run_id))
    assert done.output is not None
    assert done.output.startswith("done: charge=receipt ")
    assert await charges(stores, scope, cmd.run_id) == {"charge-1-0": 1}
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.step_count == 3  # no turn was asked of the model twice
    await assert_ended_once(stores, scope, cmd.run_id)
