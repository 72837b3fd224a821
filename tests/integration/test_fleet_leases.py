"""Leases in the fleet: a worker whose lease was taken over writes nothing more; the keeper renews and
notices a lost lease; a graceful stop releases runs at a boundary for another worker to continue."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from intermission.agent.executor import RunContext
from intermission.fleet.lease import LeaseKeeper
from intermission.schemas.errors import RunLeaseLost
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import Lease, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import PendingCall, Progress, SuspendReason
from intermission.store import Stores
from intermission.store.runs import Pause
from tests.support.factories import continuation, running_run
from tests.support.fleet import charges, fast_settings, start_command, worker
from tests.support.waiting import eventually


async def table_state(stores: Stores, run_id: str) -> dict[str, Any]:
    """Everything a worker could write for a run."""
    async with stores.db.connection() as con:
        raw = con.raw
        return {
            "run": dict(
                await raw.fetchrow(
                    "SELECT state, revision, lease_owner, output, error, updated_at FROM runs WHERE id = $1", run_id
                )
                or {}
            ),
            "progress": [dict(r) for r in await raw.fetch("SELECT * FROM progress WHERE run_id = $1", run_id)],
            "suspensions": [dict(r) for r in await raw.fetch("SELECT * FROM suspensions WHERE run_id = $1", run_id)],
            "outbox": [dict(r) for r in await raw.fetch("SELECT * FROM outbox WHERE run_id = $1", run_id)],
            "events": [dict(r) for r in await raw.fetch("SELECT * FROM run_events WHERE run_id = $1", run_id)],
            "session": await raw.fetchval("SELECT count(*) FROM session_messages WHERE run_id = $1", run_id),
        }


async def in_first_step(stores: Stores, scope: Scope, run_id: str) -> bool:
    """The step that calls sleep is saved; its handler is sleeping."""
    return (await stores.at(scope).progress.get_progress(run_id)).continuation.step_index == 1


async def lapse(stores: Stores, run_id: str) -> None:
    """Make a lease lapse now, by the database clock (as if its holder stopped renewing long ago)."""
    async with stores.db.connection() as con:
        await con.raw.execute("UPDATE runs SET lease_expires_at = now() WHERE id = $1", run_id)


async def test_a_worker_whose_lease_was_taken_over_writes_nothing_more(stores: Stores, scope: Scope) -> None:
    old = Lease(owner="worker-old", ttl_seconds=30)
    run, _ = await running_run(stores, scope, holder=old)
    ctx = RunContext(
        stores,
        run,
        Progress(run_id=run.id, owner=old.owner, continuation=continuation()),
        old,
        correlation_id=None,
        stopping=asyncio.Event(),
    )
    await ctx.save_progress(Progress(run_id=run.id, owner=old.owner, continuation=continuation(step=2)))

    await lapse(stores, run.id)
    new = Lease(owner="worker-new", ttl_seconds=30)
    await stores.at(scope).runs.claim_continuation_leased(
        run.id, new, Progress(run_id=run.id, owner=new.owner, continuation=continuation(step=3))
    )
    before = await table_state(stores, run.id)

    with pytest.raises(RunLeaseLost):
        await ctx.save_progress(Progress(run_id=run.id, owner=old.owner, continuation=continuation(step=9)))
    assert ctx.handle.lost
    # Once lost, nothing is even attempted: every later write refuses at once.
    for write in (
        ctx.save_progress(Progress(run_id=run.id, owner=old.owner, continuation=continuation(step=10))),
        ctx.pause(Pause(SuspendReason.EXTERNAL_TOOL, [PendingCall(id="c", name="lookup")], continuation())),
        ctx.complete("stolen"),
        ctx.fail("stolen"),
        ctx.end(RunEventKind.CANCELLED),
    ):
        with pytest.raises(RunLeaseLost):
            await write
    # And the database agrees even for a context that did not know yet.
    fresh_ctx = RunContext(
        stores, run, Progress(run_id=run.id, owner=old.owner), old, correlation_id=None, stopping=asyncio.Event()
    )
    with pytest.raises(RunLeaseLost):
        await fresh_ctx.complete("stolen")
    with pytest.raises(RunLeaseLost):
        await stores.at(scope).runs.renew_lease(run.id, old)

    assert await table_state(stores, run.id) == before
    progress = await stores.at(scope).progress.get_progress(run.id)
    assert (progress.owner, progress.continuation.step_index) == ("worker-new", 3)


async def test_the_keeper_renews_and_reports_a_lost_lease(stores: Stores, scope: Scope) -> None:
    held = Lease(owner="keeper-test", ttl_seconds=2)
    run, _ = await running_run(stores, scope, holder=held)
    lost = asyncio.Event()
    keeper = LeaseKeeper(stores.at(scope).runs, run.id, held, renew_every=0.05, on_lost=lost.set)
    keeping = asyncio.create_task(keeper.keep())

    async def expiry() -> Any:
        async with stores.db.connection() as con:
            return await con.raw.fetchval("SELECT lease_expires_at FROM runs WHERE id = $1", run.id)

    first = await expiry()

    async def renewed() -> bool:  # a renewal moves the expiry forward
        return bool(await expiry() != first)

    await eventually(renewed, what="a lease renewal")
    assert not lost.is_set()

    await lapse(stores, run.id)
    await stores.at(scope).runs.claim_continuation_leased(run.id, Lease(owner="thief", ttl_seconds=30))
    async with asyncio.timeout(10):
        await lost.wait()
    await keeping
    assert (await stores.at(scope).runs.get_run(run.id)).lease_owner == "thief"


async def test_a_lost_lease_cancels_the_run_in_the_fleet(stores: Stores, scope: Scope, database_url: str) -> None:
    settings = fast_settings(database_url, lease_seconds=5, lease_renew_seconds=0.1)
    w = worker(stores, settings)
    cmd = start_command(scope, [{"call": [{"tool": "sleep", "arguments": {"seconds": 30}}]}, {"say": "late"}])
    await w.control.start(cmd)
    task = next(iter(w.fleet._tasks.values()))
    await eventually(lambda: in_first_step(stores, scope, cmd.run_id), what="the sleep step began")
    await lapse(stores, cmd.run_id)
    await stores.at(scope).runs.claim_continuation_leased(cmd.run_id, Lease(owner="thief", ttl_seconds=30))
    before = await table_state(stores, cmd.run_id)
    async with asyncio.timeout(10):
        await task  # cancelled by its keeper, not by the 30 s sleep ending
    assert await table_state(stores, cmd.run_id) == before
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.lease_owner) == (RunState.RUNNING, "thief")
    await w.fleet.stop(grace=1)


async def test_a_graceful_stop_releases_runs_at_a_boundary_for_another_worker(
    stores: Stores, scope: Scope, database_url: str
) -> None:
    first = worker(stores, fast_settings(database_url, lease_seconds=30, lease_renew_seconds=5))
    cmd = start_command(
        scope,
        [
            {"call": [{"tool": "sleep", "arguments": {"seconds": 0.3}}]},
            {"call": [{"tool": "charge", "arguments": {"amount": 1}}]},
            {"say": "finished"},
        ],
    )
    await first.control.start(cmd)
    await eventually(lambda: in_first_step(stores, scope, cmd.run_id), what="the sleep step began")
    await first.fleet.stop(grace=10)  # the sleep step finishes, then the run stops at its boundary
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.RUNNING
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT lease_expires_at <= now() FROM runs WHERE id = $1", cmd.run_id)
    progress = await stores.at(scope).progress.get_progress(cmd.run_id)
    assert progress.continuation.step_index == 1
    assert not progress.started

    second = worker(stores, fast_settings(database_url))
    await second.drain()  # the released lease is taken over at once: no 30 s wait
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "finished")
    assert await charges(stores, cmd.run_id) == {"call-1-0": 1}
    await second.fleet.stop(grace=1)
