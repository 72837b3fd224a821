"""SIGTERM stops a worker gracefully: it takes no more work, lets its runs reach a boundary, releases
them, and exits; another worker continues them at once from their snapshots."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support.fleet import charges, fast_settings, start_command, worker
from tests.support.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]


async def test_sigterm_releases_runs_at_their_next_boundary(stores: Stores, scope: Scope, database_url: str) -> None:
    cmd = start_command(
        scope,
        [
            {"call": [{"tool": "sleep", "arguments": {"seconds": 0.5}}]},
            {"call": [{"tool": "charge", "arguments": {"amount": 4}}]},
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
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        assert (await proc.stdout.readline()).strip() == b"serving"

    async def inside_first_step() -> bool:
        # The sleep call is saved as the step's assistant turn; its handler is sleeping.
        return (await stores.at(scope).progress.get_progress(cmd.run_id)).continuation.step_index == 1

    await eventually(inside_first_step, what="the run entered its first step")
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.RUNNING
    progress = await stores.at(scope).progress.get_progress(cmd.run_id)
    assert progress.continuation.step_index == 1  # stopped at the boundary after the sleep step
    assert not progress.started
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT lease_expires_at <= now() FROM runs WHERE id = $1", cmd.run_id)

    survivor = worker(stores, fast_settings(database_url, lease_seconds=30, lease_renew_seconds=5))
    async with asyncio.timeout(30):
        await survivor.fleet.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "finished")
    assert await charges(stores, scope, cmd.run_id) == {"call-1-0": 1}
    await survivor.fleet.stop(grace=1)
