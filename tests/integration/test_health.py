"""``/healthz`` and ``/readyz`` beside ``/metrics`` on the metrics port of a worker and of a sweeper, over
real servers: ready once consuming, not ready while its database is away (a PostgreSQL of the test's own,
stopped and started: the shared one is never touched), ready again once it is back."""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import pytest

from intermission.agent.loop import default_executor
from intermission.fleet.health import Readiness, task_checks
from intermission.fleet.runtime import RECLAIM_TASK
from intermission.fleet.settings import Settings
from intermission.fleet.supervisor import Supervisor
from intermission.fleet.worker import RELAY_TASK, running_worker
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import StartCommand
from intermission.schemas.errors import RunNotFound
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.store import Stores
from tests.support import pg_cluster
from tests.support.amqp import DELIVERY_LIMIT, Broker, Vhost
from tests.support.fleet import fast_settings
from tests.support.metrics import free_port, get, readiness, samples, scrape
from tests.support.waiting import eventually
from tests.support.worker_process import cli_process, worker_env

PROBE_SECONDS = 0.2
WAIT = 60.0
WORKER_CHECKS = {"database", "rabbitmq", "consumers", "event_loop", f"task:{RELAY_TASK}", f"task:{RECLAIM_TASK}"}
APPLIED_STARTS = ("intermission_commands_total", (("code", ""), ("command", "run.start"), ("outcome", "applied")))


async def status_becomes(port: int, status: int, *, what: str) -> dict[str, Any]:
    """Poll ``/readyz`` until it answers ``status``; its JSON then."""
    found: dict[str, Any] = {}

    async def answered() -> bool:
        nonlocal found
        got, found = await asyncio.to_thread(readiness, port)
        return got == status

    await eventually(answered, within=WAIT, what=what)
    return found


async def start_and_pause(host: HostClient, stores: Stores, scope: Scope) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    script = [ScriptTurn.model_validate({"call": [{"tool": "lookup"}]})]
    await host.start(StartCommand(scope=scope, run_id=run_id, agent_id="demo", script=script))

    async def paused() -> bool:
        try:
            return (await stores.at(scope).runs.get_run(run_id)).state is RunState.PAUSED
        except RunNotFound:  # the start is not consumed yet
            return False

    await eventually(paused, within=WAIT, what="the run paused")


async def test_a_worker_is_alive_ready_once_consuming_and_still_serves_its_metrics(
    stores: Stores, scope: Scope, database_url: str, amqp_url: str, amqp_vhost: Vhost, rabbit: Broker
) -> None:
    port = free_port()
    settings = fast_settings(
        database_url,
        amqp_url=amqp_url,
        bus_user=rabbit.bus.name,
        delivery_limit=DELIVERY_LIMIT,
        metrics_port=port,
        health_probe_seconds=PROBE_SECONDS,
    )
    async with (
        running_worker(settings, executor=default_executor(), stores=stores) as worker,
        await HostClient.connect(amqp_vhost.url(rabbit.host)) as host,
    ):
        assert await asyncio.to_thread(get, port, "/healthz") == (200, "ok\n")
        ready = await status_becomes(port, 200, what="the worker ready")
        assert ready["ready"] is True
        assert ready["not_ready"] == []
        assert set(ready["checks"]) >= WORKER_CHECKS
        assert all(ready["checks"].values())
        assert worker.consumers.consuming

        before = samples(await asyncio.to_thread(scrape, port)).get(APPLIED_STARTS, 0.0)
        await start_and_pause(host, stores, scope)

        async def counted() -> bool:
            return samples(await asyncio.to_thread(scrape, port)).get(APPLIED_STARTS, 0.0) != before

        await eventually(counted, within=WAIT, what="the applied start in /metrics")
        assert samples(await asyncio.to_thread(scrape, port))[APPLIED_STARTS] == before + 1
        # Still ready after the run: the lease keeper came and is running too.
        after = await status_becomes(port, 200, what="the worker still ready")
        assert all(after["checks"].values())
    # Stopped: the port is released with the worker.
    status, _ = await asyncio.to_thread(readiness, port)
    assert status == 0


@pytest.mark.skipif(pg_cluster.binaries() is None, reason="needs initdb and pg_ctl for a stoppable server")
async def test_a_worker_is_not_ready_while_its_database_is_away_and_ready_again_once_it_is_back(
    amqp_url: str, rabbit: Broker
) -> None:
    port = free_port()
    async with pg_cluster.private_cluster() as server:
        settings = fast_settings(
            server.dsn,
            amqp_url=amqp_url,
            bus_user=rabbit.bus.name,
            delivery_limit=DELIVERY_LIMIT,
            metrics_port=port,
            health_probe_seconds=PROBE_SECONDS,
        )
        stores = await Stores.connect(server.dsn, max_size=settings.pool_max_size, relayed=True)
        try:
            async with running_worker(settings, executor=default_executor(), stores=stores):
                await status_becomes(port, 200, what="the worker ready")
                await server.stop()
                away = await status_becomes(port, 503, what="the worker not ready without its database")
                assert away["checks"]["database"] is False
                assert "database" in away["not_ready"]
                # The rest of the process is fine: only the database is named.
                assert away["checks"]["rabbitmq"] is True
                assert away["checks"]["consumers"] is True
                # Alive all along: only readiness follows the database.
                assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
                await server.start()
                back = await status_becomes(port, 200, what="the worker ready again")
                assert all(back["checks"].values())
        finally:
            await stores.close()


async def test_a_running_sweeper_is_ready(settings: Settings) -> None:
    port = free_port()
    proc = await cli_process(
        "sweeper",
        env=worker_env(
            settings, INTERMISSION_METRICS_PORT=str(port), INTERMISSION_HEALTH_PROBE_SECONDS=str(PROBE_SECONDS)
        ),
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        ready = await status_becomes(port, 200, what="the sweeper ready")
        assert set(ready["checks"]) == {
            "database",
            "rabbitmq",
            "event_loop",
            "task:expiry-sweeper",
            "task:pruner",
        }
        assert all(ready["checks"].values())
        assert await asyncio.to_thread(get, port, "/healthz") == (200, "ok\n")
        assert "intermission_idempotency_window_seconds" in await asyncio.to_thread(scrape, port)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), WAIT)
    assert proc.returncode == 0, err.decode()[-2000:]


def test_readiness_is_not_ready_before_its_first_refresh_and_names_what_fails() -> None:
    fresh = Readiness(["database", "rabbitmq"], stale_after=60.0)
    ready, body = fresh.report()
    assert not ready
    assert body["not_ready"] == ["database", "event_loop", "rabbitmq"]
    fresh.update({"database": True, "rabbitmq": False})
    ready, body = fresh.report()
    assert not ready
    assert body["not_ready"] == ["rabbitmq"]
    fresh.update({"database": True, "rabbitmq": True})
    assert fresh.report()[0]


async def test_a_loop_waiting_out_its_restart_or_given_up_on_is_not_ready() -> None:
    supervisor = Supervisor(max_failures=2, first_backoff_seconds=60.0, max_backoff_seconds=60.0)

    async def fails() -> None:
        raise RuntimeError("a bug")

    async def waits() -> None:
        await asyncio.Event().wait()

    supervisor.start("failing", fails)
    supervisor.start("fine", waits)

    async def restarting() -> bool:
        return supervisor.states().get("failing") == "restarting"

    await eventually(restarting, what="the failing loop in its backoff")
    checks = task_checks(supervisor.states(), ["fine", "failing", "absent"])
    assert checks == {"task:fine": True, "task:failing": False, "task:absent": False}
    await supervisor.stop(grace=0.1)

    given_up = Supervisor(max_failures=1)
    given_up.start("failing", fails)
    await asyncio.wait_for(given_up.wait_given_up(), WAIT)
    assert given_up.states() == {"failing": "failed"}
