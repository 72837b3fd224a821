"""Real crashes of a worker running the OpenAI Agents SDK example agent.

A worker process (``python -m tests.support.crash worker`` with ``INTERMISSION_EXECUTOR`` naming the
example) SIGKILLs itself at a named point while it continues an approved run; a second worker takes the
run over. The ``demo_charges`` ledger shows whether the approved, non-retry-safe ``charge`` ever ran
twice; the outbox shows one resume per decision.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from intermission import points
from intermission.agent.plugins import load_executor
from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.integrations.openai_agents import OUTCOME_UNKNOWN, Prepared
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import DecideCommand, Decision, StartCommand
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store import Stores
from tests.support.fleet import charges, outbox_keys
from tests.support.waiting import eventually
from tests.support.worker_process import worker_env

ROOT = Path(__file__).resolve().parents[2]
WAIT = 30.0
EXAMPLE = "tests.examples.openai_agents_agent:executor"


def start(scope: Scope, *turns: dict[str, Any]) -> StartCommand:
    return StartCommand(
        scope=scope,
        run_id=f"run-{uuid.uuid4().hex[:12]}",
        agent_id="billing",
        input=json.dumps({"script": list(turns)}),
    )


def crashing_env(settings: Settings, crash_at: str) -> dict[str, str]:
    return worker_env(settings, INTERMISSION_EXECUTOR=EXAMPLE, INTERMISSION_CRASH_AT=crash_at)


async def paused(settings: Settings, stores: Stores, host: HostClient, cmd: StartCommand) -> Notice:
    """Start ``cmd`` in a worker of this process and return its approval Notice; the worker then stops."""
    async with (
        running_worker(settings, executor=load_executor(EXAMPLE), stores=stores),
        host.subscribe(cmd.scope, exclusive=True) as events,
    ):
        await host.start(cmd)
        async with asyncio.timeout(WAIT):
            async for received in events:
                event = received.event
                if isinstance(event, Notice) and event.run_id == cmd.run_id:
                    assert event.reason is SuspendReason.APPROVAL
                    return event
    raise AssertionError("no notice")


async def in_a_worker_that_dies(settings: Settings, crash_at: str, send: Callable[[], Awaitable[object]]) -> None:
    """A worker subprocess gets what ``send`` publishes and SIGKILLs itself at ``crash_at``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.crash",
        "worker",
        cwd=ROOT,
        env=crashing_env(settings, crash_at),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    await send()
    async with asyncio.timeout(WAIT):
        _, err = await proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"rc={proc.returncode}\n{err.decode()[-3000:]}"


async def approve_in_a_worker_that_dies(settings: Settings, host: HostClient, notice: Notice, crash_at: str) -> None:
    """A worker subprocess takes the approval and SIGKILLs itself at ``crash_at``."""
    assert notice.checkpoint_id is not None
    approve = DecideCommand(
        scope=notice.scope, version=version_of(notice), checkpoint_id=notice.checkpoint_id, decision=Decision.APPROVE
    )
    await in_a_worker_that_dies(settings, crash_at, lambda: host.decide(approve))


async def finished_by_a_survivor(settings: Settings, stores: Stores, scope: Scope, run_id: str) -> None:
    async with running_worker(settings, executor=load_executor(EXAMPLE), stores=stores) as survivor:

        async def ended() -> bool:
            return (await stores.at(scope).runs.get_run(run_id)).state.is_terminal

        await eventually(ended, within=WAIT, what="the run ended by the survivor")
        await survivor.drain()


async def test_a_worker_killed_inside_an_approved_charge_never_charges_twice(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    # The script runs out after the charge: the model answers with the last tool result it saw.
    cmd = start(scope, {"call": [{"tool": "charge", "arguments": {"amount": 5}}]})
    notice = await paused(settings, stores, host, cmd)
    await approve_in_a_worker_that_dies(settings, host, notice, points.AFTER_STARTED)

    # The charge ran; its result was never saved; the call is recorded as handed to its tool.
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1}
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.RUNNING
    progress = await stores.at(scope).progress.get_progress(cmd.run_id)
    assert [c.id for c in progress.started] == ["call-0-0-charge"]

    await finished_by_a_survivor(settings, stores, scope, cmd.run_id)
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, f"error: {OUTCOME_UNKNOWN}")
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1}
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert sum(k.startswith("run.resumed.") for k in keys) == 1
    assert keys[-1] == f"run.completed.{scope.app}.{scope.tenant}"


async def test_a_worker_killed_between_committing_a_decision_and_acknowledging_it_charges_once(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    # The claim committed (with its first snapshot) and the worker died before the executor ran: the
    # broker redelivers the decision to the survivor, where it is a duplicate, and the survivor takes the
    # lapsed run over from the claim's snapshot.
    cmd = start(scope, {"call": [{"tool": "charge", "arguments": {"amount": 5}}]}, {"say": "charged"})
    notice = await paused(settings, stores, host, cmd)
    await approve_in_a_worker_that_dies(settings, host, notice, points.AFTER_COMMIT)
    assert await charges(stores, scope, cmd.run_id) == {}
    assert (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.RUNNING

    await finished_by_a_survivor(settings, stores, scope, cmd.run_id)
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output, run.step_count) == (RunState.COMPLETED, "charged", 2)
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1}
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert sum(k.startswith("run.resumed.") for k in keys) == 1  # one effect, for two deliveries


async def test_a_worker_killed_after_saving_a_turn_is_taken_over_from_that_turn(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    # After the approval the charge runs, then the model asks for a price lookup: that turn is saved and
    # the worker dies before the lookup runs.
    cmd = start(
        scope,
        {"call": [{"tool": "charge", "arguments": {"amount": 5}}]},
        {"call": [{"tool": "lookup_price", "arguments": {"item": "tea"}}]},
        {"say": "done"},
    )
    notice = await paused(settings, stores, host, cmd)
    await approve_in_a_worker_that_dies(settings, host, notice, points.BETWEEN_STEPS)

    # The turn after the charge is saved (its lookup not yet run), with the charge's result in ``done``.
    progress = await stores.at(scope).progress.get_progress(cmd.run_id)
    prepared = Prepared.decode(progress.continuation.prepared)
    assert len(prepared.turns) == 1
    assert [r.call_id for r in progress.done] == ["call-0-0-charge"]
    assert progress.done[0].content.endswith("charged 5.0")
    assert progress.continuation.step_index == 2
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1}

    await finished_by_a_survivor(settings, stores, scope, cmd.run_id)
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    # The survivor replayed the saved turn (not counted again), reused the charge's result, and took one
    # more turn: three in all.
    assert (run.state, run.output, run.step_count) == (RunState.COMPLETED, "done", 3)
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1}


async def test_a_worker_killed_right_after_pausing_leaves_one_notice_that_another_worker_publishes(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    cmd = start(scope, {"call": [{"tool": "charge", "arguments": {"amount": 5}}]}, {"say": "charged"})
    async with host.subscribe(scope, exclusive=True) as events:
        await in_a_worker_that_dies(settings, points.AFTER_PAUSE, lambda: host.start(cmd))
        assert (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.PAUSED
        async with running_worker(settings, executor=load_executor(EXAMPLE), stores=stores):
            notice = None
            async with asyncio.timeout(WAIT):
                async for received in events:
                    event = received.event
                    if isinstance(event, Notice) and event.run_id == cmd.run_id:
                        notice = event
                        break
            assert notice is not None
            assert [p.id for p in notice.pending] == ["call-0-0-charge"]
            assert notice.checkpoint_id is not None
            await host.decide(
                DecideCommand(
                    scope=scope,
                    version=version_of(notice),
                    checkpoint_id=notice.checkpoint_id,
                    decision=Decision.APPROVE,
                )
            )

            async def completed() -> bool:
                return (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.COMPLETED

            await eventually(completed, within=WAIT, what="the run completed")
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1}
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert sum(k.startswith("notice.") for k in keys) == 1
