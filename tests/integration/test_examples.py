"""The README's host and bus examples run against a real worker."""

from __future__ import annotations

import asyncio
import uuid

from intermission.fleet.worker import Worker
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import StartCommand
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.store import Stores
from tests.examples.host_and_bus import bus_answers_one_ask, host_runs_a_lookup, watch_a_run
from tests.support.amqp import Broker, Vhost
from tests.support.waiting import eventually


async def test_the_host_example(worker: Worker, scope: Scope, amqp_vhost: Vhost, rabbit: Broker) -> None:
    run_id = f"ex-{uuid.uuid4().hex[:8]}"
    listening = asyncio.Event()
    watching = asyncio.create_task(watch_a_run(amqp_vhost.url(rabbit.host), scope, run_id, listening))
    async with asyncio.timeout(30):
        await listening.wait()
        assert await host_runs_a_lookup(amqp_vhost.url(rabbit.host), scope, run_id) == "Sunny."
        # The throwaway listener heard the same run beside the host's own durable subscription.
        assert await watching == [
            f"notice.external_tool.{scope.app}.{scope.tenant}",
            f"run.resumed.{scope.app}.{scope.tenant}",
            f"run.completed.{scope.app}.{scope.tenant}",
        ]


async def test_the_bus_example(worker: Worker, stores: Stores, scope: Scope, amqp_vhost: Vhost, rabbit: Broker) -> None:
    run_id = f"ask-{uuid.uuid4().hex[:8]}"
    listening = asyncio.Event()
    answering = asyncio.create_task(bus_answers_one_ask(amqp_vhost.url(rabbit.bus), listening))
    async with asyncio.timeout(30):
        await listening.wait()
    async with await HostClient.connect(amqp_vhost.url(rabbit.host)) as host:
        await host.start(
            StartCommand(
                scope=scope,
                run_id=run_id,
                agent_id="demo",
                script=[ScriptTurn.model_validate({"call": [{"tool": "ask_agent", "arguments": {"agent": "p"}}]})],
            )
        )
        async with asyncio.timeout(30):
            assert await answering == run_id

    async def completed() -> bool:
        return (await stores.at(scope).runs.get_run(run_id)).state is RunState.COMPLETED

    await eventually(completed, within=30, what="the asked run completed")
