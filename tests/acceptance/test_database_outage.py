"""A PostgreSQL outage of the length of a managed failover loses no command.

Twelve runs pause; their server (a PostgreSQL of this test's own, ``tests/support/pg_cluster.py``) is
stopped; the twelve resumes arrive while it is down and the worker holds them; 30 s later the server is
started again. Every run completes, exactly once, with nothing dead-lettered or refused, through the same
worker, whose background tasks all survived.

Before outages were waited out, each held resume was retried a few times within seconds, requeued,
redelivered at once, and dead-lettered by the broker after the queue's delivery limit: none of the twelve
completed.
"""

from __future__ import annotations

import asyncio

import pytest

from intermission.agent.loop import default_executor
from intermission.fleet.worker import RELAY_TASK, running_worker
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from intermission.wire import DEAD_EXCHANGE, EVENTS_EXCHANGE, Command
from tests.integration.test_messaging import LOOKUP, start
from tests.support import pg_cluster
from tests.support.amqp import DELIVERY_LIMIT, Broker, CaptureFactory, Vhost
from tests.support.fleet import fast_settings
from tests.support.waiting import eventually

RUNS = 12
# The fault's length, not a wait for anything: a managed failover typically takes 30-120 s.
OUTAGE_SECONDS = 30.0
WAIT = 90.0

pytestmark = pytest.mark.skipif(pg_cluster.binaries() is None, reason="needs initdb and pg_ctl for a stoppable server")


async def held_deliveries(rabbit: Broker, vhost: Vhost, queue: str) -> int:
    out = await rabbit.run("list_queues", "-p", vhost.name, "name", "messages_unacknowledged", "--no-table-headers")
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == queue:
            return int(parts[1])
    return 0


async def test_resumes_that_arrive_while_the_database_is_down_all_complete_once_it_is_back(
    scope: Scope, host: HostClient, amqp_url: str, amqp_vhost: Vhost, rabbit: Broker, capture: CaptureFactory
) -> None:
    dead = await capture(amqp_vhost.url(), DEAD_EXCHANGE, "")
    refused = await capture(amqp_vhost.url(), EVENTS_EXCHANGE, "command.rejected.#")
    async with pg_cluster.private_cluster() as server:
        settings = fast_settings(
            server.dsn,
            amqp_url=amqp_url,
            bus_user=rabbit.bus.name,
            delivery_limit=DELIVERY_LIMIT,
            command_retry_seconds=WAIT,
        )
        stores = await Stores.connect(server.dsn, max_size=settings.pool_max_size, relayed=True)
        try:
            async with (
                running_worker(settings, executor=default_executor(), stores=stores) as worker,
                host.subscribe(scope) as events,
            ):
                commands = [start(scope, LOOKUP, {"say": "done"}) for _ in range(RUNS)]
                for cmd in commands:
                    await host.start(cmd)
                notices: dict[str, Notice] = {}
                async with asyncio.timeout(WAIT):
                    async for received in events:
                        if isinstance(received.event, Notice):
                            notices[received.event.run_id] = received.event
                            if len(notices) == RUNS:
                                break

                await server.stop()
                for cmd in commands:
                    n = notices[cmd.run_id]
                    await host.resume(
                        ResumeCommand(
                            scope=scope,
                            version=version_of(n),
                            results=[ToolAnswer(call_id=n.pending[0].id, content="v")],
                        )
                    )

                async def all_held() -> bool:
                    return await held_deliveries(rabbit, amqp_vhost, Command.RESUME.queue) == RUNS

                await eventually(all_held, within=WAIT, what="every resume delivered and held by the worker")
                await asyncio.sleep(OUTAGE_SECONDS)
                # Still held, none given up on: the outage is not counted against the delivery limit.
                assert await held_deliveries(rabbit, amqp_vhost, Command.RESUME.queue) == RUNS
                await server.start()

                async def all_completed() -> bool:
                    try:
                        runs = [await stores.at(scope).runs.get_run(c.run_id) for c in commands]
                    except Exception:
                        return False
                    return all(r.state is RunState.COMPLETED for r in runs)

                await eventually(all_completed, within=WAIT, what="all twelve runs completed")
                # No background task died or gave up on the way.
                assert worker.supervisor.running(RELAY_TASK)
                assert worker.fleet.reclaiming
                assert worker.supervisor.failure is None
            async with stores.db.connection() as con:
                completed = await con.raw.fetch(
                    "SELECT run_id, count(*) AS n FROM run_events WHERE kind = $1 GROUP BY run_id",
                    RunEventKind.COMPLETED.value,
                )
                resumes = await con.raw.fetchval("SELECT count(*) FROM inbox WHERE routing_key = 'run.resume'")
            assert {r["run_id"]: r["n"] for r in completed} == {c.run_id: 1 for c in commands}
            assert resumes == RUNS
        finally:
            await stores.close()
    assert dead.messages == []
    assert refused.messages == []
