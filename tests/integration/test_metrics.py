"""A worker serves Prometheus metrics of what it did, on INTERMISSION_METRICS_PORT."""

from __future__ import annotations

import asyncio
import uuid

from intermission.agent.loop import default_executor
from intermission.fleet.worker import running_worker
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import StartCommand
from intermission.schemas.errors import RunNotFound
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.store import Stores
from tests.support.amqp import DELIVERY_LIMIT, Broker, Vhost
from tests.support.fleet import fast_settings
from tests.support.metrics import free_port, listening_addresses, samples, scrape
from tests.support.waiting import eventually


async def test_a_worker_counts_commands_and_runs(
    stores: Stores, scope: Scope, database_url: str, amqp_url: str, amqp_vhost: Vhost, rabbit: Broker
) -> None:
    port = free_port()
    settings = fast_settings(
        database_url, amqp_url=amqp_url, bus_user=rabbit.bus.name, delivery_limit=DELIVERY_LIMIT, metrics_port=port
    )
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    async with (
        running_worker(settings, executor=default_executor(), stores=stores),
        await HostClient.connect(amqp_vhost.url(rabbit.host)) as host,
    ):
        script = [ScriptTurn.model_validate({"call": [{"tool": "lookup"}]})]
        await host.start(StartCommand(scope=scope, run_id=run_id, agent_id="demo", script=script))

        async def paused() -> bool:
            try:
                return (await stores.at(scope).runs.get_run(run_id)).state is RunState.PAUSED
            except RunNotFound:  # the start is not consumed yet
                return False

        await eventually(paused, what="the run paused")

        async def counted() -> bool:
            text = await asyncio.to_thread(scrape, port)
            return (
                'intermission_commands_total{code="",command="run.start",outcome="applied"} 1.0' in text
                and 'intermission_runs_left_total{how="paused"} 1.0' in text
            )

        await eventually(counted, what="the worker's metrics")
        values = samples(await asyncio.to_thread(scrape, port))
        assert (
            values[("intermission_commands_total", (("code", ""), ("command", "run.start"), ("outcome", "applied")))]
            == 1
        )
        assert values[("intermission_runs_left_total", (("how", "paused"),))] == 1
        # The run paused, so nothing runs here any more; the gauge says so (it is not merely present).
        assert values[("intermission_runs_running", ())] == 0
        # Only this machine can read it, unless INTERMISSION_METRICS_HOST says otherwise.
        assert listening_addresses(port) == {"127.0.0.1"}
