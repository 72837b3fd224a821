"""Real crashes: a worker subprocess is SIGKILLed at a named point, and a second worker finishes every run.

The `demo_charges` ledger shows whether any non-retry-safe call ran twice; the outbox shows one Notice per
pause; every run ends, or waits paused with exactly one live suspension.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from intermission import points
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.llm import Role
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion
from intermission.store import Stores
from tests.support.fleet import (
    Worker,
    charges,
    fast_settings,
    outbox_keys,
    start_command,
    suspension_count,
    worker,
)

ROOT = Path(__file__).resolve().parents[2]
RUNS = 4

CHARGE_THEN_LOOKUP: list[dict[str, Any]] = [
    {"call": [{"tool": "charge", "arguments": {"amount": 5}}]},
    {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]},
    {"call": [{"tool": "echo", "arguments": {"n": 1}}, {"tool": "charge", "arguments": {"amount": 7}}]},
    {"say": "done"},
]
LOOKUP_THEN_CHARGE: list[dict[str, Any]] = [
    {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]},
    {"call": [{"tool": "charge", "arguments": {"amount": 3}}]},
    {"say": "done"},
]
ECHO_THEN_CHARGE: list[dict[str, Any]] = [
    {"call": [{"tool": "echo", "arguments": {"n": 1}}]},
    {"call": [{"tool": "charge", "arguments": {"amount": 2}}]},
    {"say": "done"},
]


@pytest.fixture
async def survivor(stores: Stores, database_url: str) -> AsyncIterator[Worker]:
    w = worker(stores, fast_settings(database_url))
    yield w
    await w.fleet.stop(grace=5)


async def crash_worker(database_url: str, plan: list[dict[str, Any]], crash_at: str) -> None:
    """Run the plan in a worker subprocess and require that it died by SIGKILL at ``crash_at``."""
    env = {**os.environ, "INTERMISSION_CRASH_AT": crash_at}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.acceptance.crash_worker",
        database_url,
        json.dumps(plan),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        _, err = await proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"worker did not die at {crash_at}: rc={proc.returncode}\n{err.decode()}"


def start_steps(scope: Scope, script: list[dict[str, Any]]) -> tuple[list[StartCommand], list[dict[str, Any]]]:
    commands = [start_command(scope, script) for _ in range(RUNS)]
    return commands, [{"kind": "start", "command": c.model_dump(mode="json")} for c in commands]


async def created(stores: Stores, scope: Scope, commands: list[StartCommand]) -> list[str]:
    """The runs whose start committed before the worker died. The plan starts runs one after another
    while earlier ones already execute, so the crash can come before the last starts were applied: those
    runs never existed, which is correct, and there is nothing to finish for them."""
    async with stores.db.connection() as con:
        found = await con.raw.fetch(
            "SELECT id FROM runs WHERE id = ANY($1) AND app = $2 AND tenant = $3",
            [c.run_id for c in commands],
            scope.app,
            scope.tenant,
        )
    existing = {r["id"] for r in found}
    assert existing, "the worker died before any run started"
    return [c.run_id for c in commands if c.run_id in existing]


async def settle(stores: Stores, scope: Scope, survivor: Worker, run_ids: list[str]) -> None:
    """Let the survivor take over everything the dead worker held, check every run is ended or paused
    with exactly one pause and one Notice per pause, answer the pauses, and repeat until all ended."""
    for _ in range(10):
        await survivor.drain(wait_for_lapsed=True)
        paused = []
        for run_id in run_ids:
            run = await stores.at(scope).runs.get_run(run_id)
            keys = await outbox_keys(stores, scope, run_id)
            notices = sum(k.startswith("notice.") for k in keys)
            resumed = sum(k.startswith("run.resumed.") for k in keys)
            assert run.state is not RunState.RUNNING, f"{run_id} left running"
            if run.state is RunState.PAUSED:
                assert await suspension_count(stores, scope, run_id) == 1
                assert notices == resumed + 1, keys
                paused.append(run)
            else:
                assert run.state.is_terminal
                assert await suspension_count(stores, scope, run_id) == 0
                assert notices == resumed, keys
        if not paused:
            return
        for run in paused:
            s = await stores.at(scope).suspensions.get_suspension(run.id)
            await survivor.control.resume(
                ResumeCommand(
                    scope=scope,
                    version=ClaimVersion(run_id=run.id, suspension_id=s.id, run_revision=run.revision),
                    results=[ToolAnswer(call_id=p.id, content=f"answer to {p.id}") for p in s.pending],
                )
            )
    pytest.fail("runs did not settle")


async def assert_no_call_ran_twice(stores: Stores, scope: Scope, run_ids: list[str]) -> dict[str, dict[str, int]]:
    ledger: dict[str, dict[str, int]] = {}
    for run_id in run_ids:
        counts = await charges(stores, scope, run_id)
        assert all(times == 1 for times in counts.values()), f"{run_id} charged twice: {counts}"
        ledger[run_id] = counts
        run = await stores.at(scope).runs.get_run(run_id)
        assert run.state is RunState.COMPLETED, (run_id, run.state, run.error)
    return ledger


async def unknown_outcomes(stores: Stores, scope: Scope, run_id: str) -> set[str]:
    return {
        m.tool_call_id
        for m in await stores.at(scope).sessions.load(run_id)
        if m.role is Role.TOOL and "outcome unknown" in m.content
    }


async def test_killed_right_after_a_resume_claim_committed(
    stores: Stores, scope: Scope, database_url: str, survivor: Worker
) -> None:
    commands = [start_command(scope, LOOKUP_THEN_CHARGE) for _ in range(RUNS)]
    for c in commands:
        await survivor.control.start(c)
    await survivor.drain()
    plan = []
    for c in commands:
        s = await stores.at(scope).suspensions.get_suspension(c.run_id)
        run = await stores.at(scope).runs.get_run(c.run_id)
        resume = ResumeCommand(
            scope=scope,
            version=ClaimVersion(run_id=c.run_id, suspension_id=s.id, run_revision=run.revision),
            results=[ToolAnswer(call_id=s.pending[0].id, content="looked up")],
        )
        plan.append({"kind": "resume", "command": resume.model_dump(mode="json")})

    await crash_worker(database_url, plan, points.AFTER_CLAIM)

    first = await stores.at(scope).runs.get_run(commands[0].run_id)
    assert first.state is RunState.RUNNING  # claimed by the dead worker, held by nobody alive
    progress = await stores.at(scope).progress.get_progress(first.id)
    assert [r.content for r in progress.done] == ["looked up"]  # the snapshot already carries the answer
    await settle(stores, scope, survivor, [c.run_id for c in commands])
    ledger = await assert_no_call_ran_twice(stores, scope, [c.run_id for c in commands])
    assert all(counts == {"call-1-0": 1} for counts in ledger.values())


async def test_killed_after_a_non_retry_safe_call_started(
    stores: Stores, scope: Scope, database_url: str, survivor: Worker
) -> None:
    commands, plan = start_steps(scope, CHARGE_THEN_LOOKUP)
    await crash_worker(database_url, plan, points.AFTER_STARTED)
    run_ids = await created(stores, scope, commands)
    # The worker died with its first charge handed over and the result unsaved.
    died_in = [r for r in run_ids if (await charges(stores, scope, r)).get("call-0-0")]
    assert died_in, "no charge ran before the crash"
    await settle(stores, scope, survivor, run_ids)
    await assert_no_call_ran_twice(stores, scope, run_ids)
    unknown = {r: await unknown_outcomes(stores, scope, r) for r in run_ids}
    # At least the call the worker died in was reported as unknown instead of being run again.
    assert any("call-0-0" in calls for calls in unknown.values())
    for run_id in run_ids:
        for call_id in unknown[run_id]:
            assert (await charges(stores, scope, run_id)).get(call_id, 0) <= 1


async def test_killed_between_two_steps(stores: Stores, scope: Scope, database_url: str, survivor: Worker) -> None:
    commands, plan = start_steps(scope, ECHO_THEN_CHARGE)
    await crash_worker(database_url, plan, points.BETWEEN_STEPS)
    run_ids = await created(stores, scope, commands)
    await settle(stores, scope, survivor, run_ids)
    ledger = await assert_no_call_ran_twice(stores, scope, run_ids)
    for run_id in run_ids:
        if "call-1-0" not in await unknown_outcomes(stores, scope, run_id):
            assert ledger[run_id] == {"call-1-0": 1}


async def test_killed_right_after_a_pause_committed(
    stores: Stores, scope: Scope, database_url: str, survivor: Worker
) -> None:
    commands, plan = start_steps(scope, CHARGE_THEN_LOOKUP)
    await crash_worker(database_url, plan, points.AFTER_PAUSE)
    run_ids = await created(stores, scope, commands)
    paused = [r for r in run_ids if (await stores.at(scope).runs.get_run(r)).state is RunState.PAUSED]
    assert paused, "no run had paused when the worker died"
    for run_id in paused:
        assert await suspension_count(stores, scope, run_id) == 1
        assert sum(k.startswith("notice.") for k in await outbox_keys(stores, scope, run_id)) == 1
    await settle(stores, scope, survivor, run_ids)
    await assert_no_call_ran_twice(stores, scope, run_ids)
