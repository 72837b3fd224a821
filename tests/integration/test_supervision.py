"""No background loop dies silently, and no bad row stops one.

- A progress row that does not decode: that run is quarantined (ended ``failed`` with
  ``invalid_continuation`` and its event) and every other lapsed run of the batch is still taken over.
- A statement cancelled by an operator (``pg_cancel_backend``) in the reclaim sweep, the relay and the
  expiry sweeper, and a killed LISTEN connection of the relay: each loop comes back, and the log says why.
- A loop that raises something it does not expect is restarted by the supervisor, with its traceback
  logged; one that keeps failing makes the supervisor give up, which stops the process non-zero.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest

from intermission.fleet.supervisor import SupervisedTaskFailed, Supervisor
from intermission.fleet.worker import Worker
from intermission.publishers.sweeper import ExpirySweeper
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Progress
from intermission.store import Stores
from intermission.wire import EVENTS_EXCHANGE
from tests.support.amqp import CaptureFactory, ConnectionFactory
from tests.support.factories import continuation, paused_run, running_run, writes
from tests.support.fleet import fast_settings
from tests.support.fleet import worker as fleet_worker
from tests.support.inspect import Inspector
from tests.support.waiting import eventually

WAIT = 30.0


async def lapse(db: Inspector, run_id: str) -> None:
    await db.con.execute("UPDATE runs SET lease_expires_at = now() WHERE id = $1", run_id)


async def test_an_undecodable_snapshot_is_quarantined_and_the_rest_of_the_batch_is_taken_over(
    stores: Stores, scope: Scope, db: Inspector, database_url: str
) -> None:
    runs = []
    for _ in range(5):
        run, held = await running_run(stores, scope)
        await writes(stores, scope).progress.save_progress(
            Progress(run_id=run.id, owner=held.owner, continuation=continuation(step=1))
        )
        runs.append(run)
    bad = runs[0]
    # Valid JSON, wrong shape: no decoder accepts it, however lenient.
    await db.con.execute("UPDATE progress SET continuation = '{\"messages\": 5}'::jsonb WHERE run_id = $1", bad.id)
    for run in runs:
        await lapse(db, run.id)

    fleet = fleet_worker(stores, fast_settings(database_url)).fleet
    taken = await fleet.reclaim_once()
    assert taken == 5
    # Every other run was taken over by this fleet: it holds them now, or they already left running.
    rest = await db.con.fetch("SELECT state, lease_owner FROM runs WHERE id = ANY($1)", [r.id for r in runs[1:]])
    assert len(rest) == 4
    assert all(r["lease_owner"] == fleet.owner or r["state"] != RunState.RUNNING.value for r in rest), rest
    await fleet.stop(grace=0)

    quarantined = await db.con.fetchrow("SELECT state, error FROM runs WHERE id = $1", bad.id)
    assert quarantined is not None
    assert quarantined["state"] == RunState.FAILED.value
    assert quarantined["error"].startswith("invalid_continuation: stored progress continuation is malformed")
    assert await db.count("progress", bad.id) == 0
    failed_key = f"run.{RunEventKind.FAILED.value}.{scope.routing_suffix()}"
    sent = await db.con.fetchval(
        "SELECT count(*) FROM outbox WHERE run_id = $1 AND routing_key = $2", bad.id, failed_key
    )
    assert sent == 1
    assert fleet.metrics.quarantined._value.get() == 1
    assert not [r for r in rest if r["state"] == RunState.FAILED.value]


async def blocked_statement(db: Inspector, fragment: str) -> int:
    """The pid of the backend whose statement containing ``fragment`` waits on a lock."""
    pid: int | None = None

    async def waiting() -> bool:
        nonlocal pid
        pid = await db.con.fetchval(
            "SELECT pid FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND query LIKE $1 AND pid <> pg_backend_pid()",
            f"%{fragment}%",
        )
        return pid is not None

    await eventually(waiting, within=WAIT, what=f"a statement with {fragment!r} waiting on the lock")
    assert pid is not None
    return pid


async def cancel_while_locked(database_url: str, db: Inspector, table: str, fragment: str) -> None:
    """Lock ``table`` in a transaction of the test's own until the loop's statement waits on it, cancel that
    statement as an operator would, then let go."""
    other = await asyncpg.connect(database_url)
    try:
        async with other.transaction():
            await other.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            pid = await blocked_statement(db, fragment)
            assert await db.con.fetchval("SELECT pg_cancel_backend($1)", pid)
    finally:
        await other.close()


def said(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


async def logged(caplog: pytest.LogCaptureFixture, action: str) -> logging.LogRecord:
    """The first record of ``action``, waiting for it (the loop logs it from its own task)."""

    async def there() -> bool:
        return bool(said(caplog, action))

    await eventually(there, within=WAIT, what=f"a log record of {action}")
    return said(caplog, action)[0]


async def test_a_cancelled_statement_in_the_reclaim_sweep_is_logged_and_the_sweep_goes_on(
    worker: Worker,
    stores: Stores,
    scope: Scope,
    db: Inspector,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    await cancel_while_locked(database_url, db, "runs", "intermission_take_over_v2")
    assert (await logged(caplog, "reclaim_retry")).__dict__["error"] == "store_unavailable"
    # The sweep still takes over a lapsed run.
    run, _ = await running_run(stores, scope)
    await lapse(db, run.id)

    async def taken() -> bool:
        owner = await db.con.fetchval("SELECT lease_owner FROM runs WHERE id = $1", run.id)
        state: str = await db.con.fetchval("SELECT state FROM runs WHERE id = $1", run.id)
        return owner == worker.fleet.owner or state != RunState.RUNNING.value

    await eventually(taken, within=WAIT, what="the lapsed run taken over after the cancel")
    assert worker.fleet.reclaiming


async def test_a_cancelled_statement_and_a_killed_listen_connection_in_the_relay_are_survived(
    worker: Worker,
    stores: Stores,
    scope: Scope,
    db: Inspector,
    amqp_url: str,
    capture: CaptureFactory,
    caplog: pytest.LogCaptureFixture,
    database_url: str,
) -> None:
    caplog.set_level(logging.INFO)
    events = await capture(amqp_url, EVENTS_EXCHANGE, "#")
    relay = worker.relay
    await relay.wait_listening(1)

    async with stores.db.connection() as con:  # a row for the relay to look at, so its claim runs
        await con.raw.execute("SELECT 1")
    await cancel_while_locked(database_url, db, "outbox", "outbox")
    await logged(caplog, "relay_retry")

    killed = await db.con.fetchval(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE query LIKE 'LISTEN%' AND datname = current_database()"
    )
    assert killed
    await relay.wait_listening(2)  # listening again on a new connection

    # Events still flow: a run that pauses publishes its notice.
    paused = await paused_run(stores, scope)
    await events.wait_for(
        lambda got: any(m.json().get("run_id") == paused.run.id for m in got), within=WAIT, what="the notice"
    )
    assert worker.supervisor.failure is None


async def test_a_cancelled_statement_in_the_expiry_sweeper_is_logged_and_the_sweep_goes_on(
    stores: Stores,
    scope: Scope,
    db: Inspector,
    database_url: str,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    connection = await amqp_connect(amqp_url, "sweeper")
    sweeper = ExpirySweeper(
        stores.db, connection, interval_seconds=0.1, batch=10, max_rate=1000, max_backoff_seconds=0.2
    )
    stop = asyncio.Event()
    supervisor = Supervisor()
    supervisor.start("expiry-sweeper", lambda: sweeper.serve(stop))
    try:
        await cancel_while_locked(database_url, db, "suspensions", "suspensions")
        await logged(caplog, "sweep_retry")
        await paused_run(stores, scope, ttl_seconds=0.001)

        async def swept() -> bool:
            return sweeper.published >= 1

        await eventually(swept, within=WAIT, what="the expired pause swept after the cancel")
        assert supervisor.running("expiry-sweeper")
    finally:
        stop.set()
        await supervisor.stop()
        await sweeper.close()


async def test_a_loop_that_raises_is_restarted_and_one_that_keeps_raising_stops_the_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    supervisor = Supervisor(max_failures=3, window_seconds=60, first_backoff_seconds=0.01, max_backoff_seconds=0.02)
    calls = 0
    healed = asyncio.Event()

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise KeyError("a bug")
        healed.set()
        await asyncio.Event().wait()

    supervisor.start("flaky", flaky)
    async with asyncio.timeout(WAIT):
        await healed.wait()
    assert supervisor.restarts["flaky"] == 2
    restarting = said(caplog, "task_restarting")
    assert [r.__dict__["task"] for r in restarting] == ["flaky", "flaky"]
    assert all(r.exc_info is not None for r in restarting)  # with the traceback
    assert supervisor.failure is None

    async def broken() -> None:
        raise RuntimeError("broken for good")

    supervisor.start("broken", broken)
    async with asyncio.timeout(WAIT):
        failure = await supervisor.wait_given_up()
    assert isinstance(failure, SupervisedTaskFailed)
    assert "broken failed 3 times" in failure.detail
    assert said(caplog, "task_gave_up")
    await supervisor.stop(grace=0)
