"""Pruning in real processes: the sweeper prunes by default and reports it; a prune killed with SIGKILL in
the middle of its work leaves no run half removed, and the next prune finishes exactly what was due."""

from __future__ import annotations

import asyncio
import os
import signal

from intermission.fleet.settings import Settings
from intermission.schemas.scope import Scope
from tests.acceptance.test_messaging_faults import WAIT
from tests.support.inspect import Inspector
from tests.support.metrics import free_port, samples, scrape
from tests.support.waiting import eventually
from tests.support.worker_process import cli, cli_process, worker_env

DUE = 2000


async def ended_runs(db: Inspector, scope: Scope, n: int, *, days_ago: int) -> None:
    """``n`` completed runs that ended ``days_ago`` days ago, each with two run events (test-only bulk SQL: the
    store's own paths are exercised in tests/integration/test_retention.py)."""
    await db.con.execute(
        "INSERT INTO runs (id, app, tenant, agent_id, state, revision, input, ended_at)"
        " SELECT 'bulk-' || g, $1, $2, 'demo', 'completed', 2, 'hi', now() - make_interval(days => $4)"
        " FROM generate_series(1, $3) g",
        scope.app,
        scope.tenant,
        n,
        days_ago,
    )
    await db.con.execute(
        "INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision)"
        " SELECT gen_random_uuid(), r.id, r.app, r.tenant, k, 2 FROM runs r, unnest(ARRAY['a', 'b']) k"
        " WHERE r.id LIKE 'bulk-%'"
    )


async def whole(db: Inspector) -> None:
    """Every run's rows are there together, or gone together."""
    orphans = await db.con.fetchval(
        "SELECT count(*) FROM run_events e WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = e.run_id)"
    )
    halves = await db.con.fetchval(
        "SELECT count(*) FROM runs r WHERE r.id LIKE 'bulk-%'"
        " AND (SELECT count(*) FROM run_events e WHERE e.run_id = r.id) <> 2"
    )
    assert (orphans, halves) == (0, 0)


async def test_a_prune_killed_midway_leaves_no_run_half_removed(
    settings: Settings, db: Inspector, scope: Scope
) -> None:
    await ended_runs(db, scope, DUE, days_ago=40)
    env = worker_env(settings, INTERMISSION_PRUNE_BATCH="25", INTERMISSION_PRUNE_MAX_ROWS_PER_SECOND="1500")
    proc = await cli_process("prune", env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)

    async def under_way() -> bool:
        left = await db.con.fetchval("SELECT count(*) FROM runs WHERE id LIKE 'bulk-%'")
        return bool(left <= DUE - 100)

    await eventually(under_way, within=WAIT, what="the prune under way")
    os.kill(proc.pid, signal.SIGKILL)
    await asyncio.wait_for(proc.wait(), WAIT)
    left = await db.con.fetchval("SELECT count(*) FROM runs WHERE id LIKE 'bulk-%'")
    assert 0 < left < DUE, "killed in the middle"
    await whole(db)

    # The next prune removes exactly what was left.
    ran = await cli("prune", env=worker_env(settings), within=WAIT)
    assert ran.code == 0, ran.err
    assert f"runs                 removed {left}" in ran.out
    assert f"run_events           removed {2 * left}" in ran.out
    await whole(db)
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id LIKE 'bulk-%'") == 0


async def test_the_sweeper_prunes_by_default_and_reports_it(settings: Settings, db: Inspector, scope: Scope) -> None:
    await ended_runs(db, scope, 50, days_ago=40)
    # Runs ended inside the retention window, which the sweeper must leave.
    await db.con.execute(
        "INSERT INTO runs (id, app, tenant, agent_id, state, revision, input, ended_at)"
        " SELECT 'recent-' || g, $1, $2, 'demo', 'completed', 2, 'hi', now() - interval '1 day'"
        " FROM generate_series(1, 5) g",
        scope.app,
        scope.tenant,
    )
    port = free_port()
    proc = await cli_process(
        "sweeper",
        env=worker_env(settings, INTERMISSION_PRUNE_INTERVAL_SECONDS="0.5", INTERMISSION_METRICS_PORT=str(port)),
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:

        async def reported() -> bool:
            try:
                values = samples(await asyncio.to_thread(scrape, port))
            except OSError:
                return False
            # A prune pass counts its rows first and measures the tables after: wait for both, or a scrape
            # between the two finds the counters without the gauges.
            return (
                values.get(("intermission_rows_pruned_total", (("table", "runs"),))) == 50
                and ("intermission_table_bytes", (("table", "runs"),)) in values
                # Set last of the figures the test reads (it starts at 0).
                and values.get(("intermission_oldest_ended_run_seconds", ()), 0.0) > 0
            )

        await eventually(reported, within=WAIT, what="the sweeper's prune and table measurements in its metrics")
        values = samples(await asyncio.to_thread(scrape, port))
        assert values[("intermission_rows_pruned_total", (("table", "run_events"),))] == 100
        assert values[("intermission_idempotency_window_seconds", ())] == settings.inbox_retention_seconds
        assert values[("intermission_table_bytes", (("table", "runs"),))] > 0
        assert values[("intermission_dead_letters", ())] == 0
        # The recent runs are kept, so the oldest kept ended about a day ago.
        assert 86000 < values[("intermission_oldest_ended_run_seconds", ())] < 87000
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), WAIT)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id LIKE 'bulk-%'") == 0
    assert await db.con.fetchval("SELECT count(*) FROM runs WHERE id LIKE 'recent-%'") == 5
