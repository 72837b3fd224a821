"""Leases in the fleet: a worker whose lease was taken over writes nothing more; the keeper renews and
notices a lost lease; a graceful stop releases runs at a boundary for another worker to continue."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from intermission.agent.executor import RunContext
from intermission.engine.core import Engine
from intermission.engine.runs import Pause
from intermission.fleet.lease import LeaseKeeper
from intermission.fleet.supervisor import Supervisor
from intermission.schemas.errors import RunLeaseLost
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import Lease, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import PendingCall, Progress, SuspendReason
from intermission.store import Stores
from intermission.store.leases import LeaseLine
from tests.support.factories import continuation, running_run, writes
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


async def test_a_worker_whose_lease_was_taken_over_writes_nothing_more(
    stores: Stores, engine: Engine, scope: Scope
) -> None:
    old = Lease(owner="worker-old", ttl_seconds=30)
    run, _ = await running_run(stores, scope, holder=old)
    ctx = RunContext(
        engine,
        run,
        Progress(run_id=run.id, owner=old.owner, continuation=continuation()),
        old,
        correlation_id=None,
        stopping=asyncio.Event(),
    )
    await ctx.save_progress(Progress(run_id=run.id, owner=old.owner, continuation=continuation(step=2)))

    await lapse(stores, run.id)
    new = Lease(owner="worker-new", ttl_seconds=30)
    await writes(stores, scope).runs.claim_continuation_leased(
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
        engine, run, Progress(run_id=run.id, owner=old.owner), old, correlation_id=None, stopping=asyncio.Event()
    )
    with pytest.raises(RunLeaseLost):
        await fresh_ctx.complete("stolen")
    with pytest.raises(RunLeaseLost):
        await stores.at(scope).runs.renew_lease(run.id, old)

    assert await table_state(stores, run.id) == before
    progress = await stores.at(scope).progress.get_progress(run.id)
    assert (progress.owner, progress.continuation.step_index) == ("worker-new", 3)


def keeper_for(stores: Stores, owner: str, *, ttl: float = 2.0, every: float = 0.05) -> LeaseKeeper:
    return LeaseKeeper(
        LeaseLine(stores.db, timeout=1.0), owner, ttl_seconds=ttl, renew_every=every, supervisor=Supervisor()
    )


async def expiries(stores: Stores, run_ids: list[str]) -> dict[str, Any]:
    async with stores.db.connection() as con:
        found = await con.raw.fetch("SELECT id, lease_expires_at FROM runs WHERE id = ANY($1)", run_ids)
    return {r["id"]: r["lease_expires_at"] for r in found}


def never(_: object) -> None:
    raise AssertionError("no end was asked of this run")


async def test_the_keeper_renews_and_reports_a_lost_lease(stores: Stores, scope: Scope) -> None:
    held = Lease(owner="keeper-test", ttl_seconds=2)
    run, _ = await running_run(stores, scope, holder=held)
    lost = asyncio.Event()
    keeper = keeper_for(stores, held.owner)
    keeper.hold(run.id, scope, on_lost=lost.set, on_ending=never)
    first = (await expiries(stores, [run.id]))[run.id]

    async def renewed() -> bool:  # a renewal moves the expiry forward
        return bool((await expiries(stores, [run.id]))[run.id] != first)

    await eventually(renewed, what="a lease renewal")
    assert not lost.is_set()

    await lapse(stores, run.id)
    await writes(stores, scope).runs.claim_continuation_leased(run.id, Lease(owner="thief", ttl_seconds=30))
    async with asyncio.timeout(10):
        await lost.wait()
    assert keeper.held == 0
    await keeper.stop()
    assert (await stores.at(scope).runs.get_run(run.id)).lease_owner == "thief"


async def test_one_statement_renews_every_lease_of_the_worker_across_scopes(
    stores: Stores, scope: Scope, other_scope: Scope
) -> None:
    held = Lease(owner="keeper-many", ttl_seconds=30)
    runs = [(await running_run(stores, s, holder=held))[0] for s in [scope, other_scope] * 10]
    someone_elses, _ = await running_run(stores, scope, holder=Lease(owner="another-worker", ttl_seconds=30))
    keeper = keeper_for(stores, held.owner, ttl=30)
    for r in runs:
        keeper.hold(r.id, r.scope, on_lost=lambda: None, on_ending=never)
    ids = [r.id for r in runs]
    before = await expiries(stores, [*ids, someone_elses.id])
    await keeper.renew_once()
    after = await expiries(stores, [*ids, someone_elses.id])
    assert all(after[i] > before[i] for i in ids)
    # One statement: every expiry is the same now() + ttl, which only one transaction's clock gives.
    assert len({after[i] for i in ids}) == 1
    assert after[someone_elses.id] == before[someone_elses.id]
    await keeper.stop()


async def test_leases_are_renewed_while_every_pool_connection_is_taken(
    stores: Stores, scope: Scope, database_url: str
) -> None:
    settings = fast_settings(database_url, lease_seconds=3, lease_renew_seconds=0.1)
    w = worker(stores, settings)
    cmd = start_command(scope, [{"call": [{"tool": "sleep", "arguments": {"seconds": 30}}]}, {"say": "late"}])
    await w.control.start(cmd)
    await eventually(lambda: in_first_step(stores, scope, cmd.run_id), what="the sleep step began")
    inspect = await asyncpg.connect(database_url)
    # Every connection of the pool the fleet's commands and runs share is held by this test.
    size = stores.db.pool.get_max_size()
    borrowed = [await stores.db.pool.acquire() for _ in range(size)]
    try:
        with pytest.raises(TimeoutError):
            await stores.db.pool.acquire(timeout=0.05)  # it is exhausted: nothing else gets one
        first = await inspect.fetchval("SELECT lease_expires_at FROM runs WHERE id = $1", cmd.run_id)
        seen = first
        async with asyncio.timeout(10):
            for _ in range(3):  # three renewals in a row, each moving the expiry forward
                while seen == first or seen is None:
                    await asyncio.sleep(0.02)
                    seen = await inspect.fetchval("SELECT lease_expires_at FROM runs WHERE id = $1", cmd.run_id)
                first = seen
        # Longer than the lease, and the run is still held by its worker: nobody could have taken it.
        row = await inspect.fetchrow(
            "SELECT lease_owner, lease_expires_at > now() AS live FROM runs WHERE id = $1", cmd.run_id
        )
        assert row is not None
        assert (row["lease_owner"], row["live"]) == (w.fleet.owner, True)
    finally:
        for con in borrowed:
            await stores.db.pool.release(con)
        await inspect.close()
        await w.fleet.stop(grace=0.1)


async def test_the_keeper_reconnects_after_its_connection_is_killed(stores: Stores, scope: Scope) -> None:
    held = Lease(owner="keeper-reconnects", ttl_seconds=5)
    run, _ = await running_run(stores, scope, holder=held)
    lost = asyncio.Event()
    keeper = LeaseKeeper(
        LeaseLine(stores.db, timeout=1.0, application_name="test-lease-line"),
        held.owner,
        ttl_seconds=5,
        renew_every=0.05,
        supervisor=Supervisor(),
    )
    keeper.hold(run.id, scope, on_lost=lost.set, on_ending=never)
    async with stores.db.connection() as con:

        async def line_pid() -> int | None:
            pid: int | None = await con.raw.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'test-lease-line'"
            )
            return pid

        await eventually(lambda: _present(line_pid), what="the lease line connected")
        old_pid = await line_pid()
        await con.raw.execute("SELECT pg_terminate_backend($1)", old_pid)
        mark = (await expiries(stores, [run.id]))[run.id]

        async def renewed_on_a_new_connection() -> bool:
            pid = await line_pid()
            return pid is not None and pid != old_pid and (await expiries(stores, [run.id]))[run.id] > mark

        await eventually(renewed_on_a_new_connection, what="a renewal over a new connection")
    assert not lost.is_set()
    await keeper.stop()


async def _present(probe: Any) -> bool:
    return await probe() is not None


async def test_a_renewal_that_keeps_failing_gives_the_run_up_once_its_lease_may_have_lapsed(
    stores: Stores, scope: Scope, database_url: str
) -> None:
    held = Lease(owner="keeper-blocked", ttl_seconds=1.0)
    run, _ = await running_run(stores, scope, holder=held)
    lost = asyncio.Event()
    keeper = LeaseKeeper(
        LeaseLine(stores.db, timeout=0.1), held.owner, ttl_seconds=1.0, renew_every=0.1, supervisor=Supervisor()
    )
    blocker = await asyncpg.connect(database_url)
    try:
        # Every renewal waits on this row lock until its statement times out: a database that does not
        # answer, by the keeper's account.
        transaction = blocker.transaction()
        await transaction.start()
        await blocker.execute("SELECT 1 FROM runs WHERE id = $1 FOR UPDATE", run.id)
        started = asyncio.get_running_loop().time()
        keeper.hold(run.id, scope, on_lost=lost.set, on_ending=never)
        async with asyncio.timeout(10):
            await lost.wait()
        # Not at the first failure: only once the ttl had passed by this process's clock.
        assert asyncio.get_running_loop().time() - started >= held.ttl_seconds
        await transaction.rollback()
    finally:
        await blocker.close()
        await keeper.stop()


async def test_a_lost_lease_cancels_the_run_in_the_fleet(stores: Stores, scope: Scope, database_url: str) -> None:
    settings = fast_settings(database_url, lease_seconds=5, lease_renew_seconds=0.1)
    w = worker(stores, settings)
    cmd = start_command(scope, [{"call": [{"tool": "sleep", "arguments": {"seconds": 30}}]}, {"say": "late"}])
    await w.control.start(cmd)
    task = next(iter(w.fleet._tasks.values()))
    await eventually(lambda: in_first_step(stores, scope, cmd.run_id), what="the sleep step began")
    await lapse(stores, cmd.run_id)
    await writes(stores, scope).runs.claim_continuation_leased(cmd.run_id, Lease(owner="thief", ttl_seconds=30))
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
    assert await charges(stores, scope, cmd.run_id) == {"call-1-0": 1}
    await second.fleet.stop(grace=1)
