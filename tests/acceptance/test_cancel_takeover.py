"""A cancel of a RUNNING run survives the death of the run's worker: the end is recorded on the run, the
worker is SIGKILLed before it gets to finish it, and the worker that takes the run over finishes the cancel
(invariant 7) instead of continuing the run."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from intermission.schemas.commands import CancelCommand
from intermission.schemas.llm import Role
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support.fleet import charges, fast_settings, outbox_keys, start_command, worker
from tests.support.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]


async def test_a_cancelled_run_whose_worker_dies_is_finished_as_cancelled_by_the_worker_that_takes_it_over(
    stores: Stores, scope: Scope, database_url: str
) -> None:
    cmd = start_command(
        scope,
        [
            {"call": [{"tool": "sleep", "arguments": {"seconds": 60}}]},
            {"call": [{"tool": "charge", "arguments": {"amount": 5}}]},
            {"say": "finished"},
        ],
    )
    plan = [{"kind": "start", "command": cmd.model_dump(mode="json")}]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.acceptance.crash_worker",
        database_url,
        json.dumps(plan),
        "serve",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:

        async def sleeping_in_the_first_step() -> bool:
            async with stores.db.connection() as con:
                steps = await con.raw.fetchval(
                    "SELECT step_count FROM runs WHERE id = $1 AND state = 'running'", cmd.run_id
                )
            return bool(steps == 1)

        await eventually(sleeping_in_the_first_step, within=30, what="the run entered its first step")
        holder = (await stores.at(scope).runs.get_run(cmd.run_id)).lease_owner
        # The cancel is recorded; the holder is asleep in a handler and would end the run after it.
        canceller = worker(stores, fast_settings(database_url))
        assert await canceller.control.cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="stop")) is None
        assert (await stores.at(scope).runs.get_run(cmd.run_id)).ending is not None
        proc.kill()  # SIGKILL: nothing of the dead worker runs again
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    async with asyncio.timeout(30):
        await canceller.drain(wait_for_lapsed=True)  # its lease lapses, and this worker takes the run over
    await canceller.fleet.stop(grace=1)

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.error, run.ending) == (RunState.CANCELLED, "stop", None)
    assert holder is not None
    assert holder != canceller.fleet.owner
    assert run.step_count == 1  # finished where it stood: the next step never ran
    assert await charges(stores, scope, cmd.run_id) == {}
    assert await outbox_keys(stores, scope, cmd.run_id) == [f"run.cancelled.{scope.app}.{scope.tenant}"]
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM progress WHERE run_id = $1", cmd.run_id) == 0
    # Its session holds what it had done: its input and the turn it was in.
    session = await stores.at(scope).sessions.load(cmd.run_id)
    assert [m.role for m in session] == [Role.USER, Role.ASSISTANT]
