"""The README's host and bus examples run against a real worker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from intermission.agent.loop import default_executor
from intermission.fleet.worker import Worker, running_worker
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import StartCommand
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.store import Stores
from tests.examples.host_and_bus import bus_answers_one_ask, host_runs_a_lookup
from tests.support.amqp import DELIVERY_LIMIT, Broker, Vhost
from tests.support.fleet import fast_settings
from tests.support.waiting import eventually


@pytest.fixture
async def worker(stores: Stores, database_url: str, amqp_url: str, rabbit: Broker) -> AsyncIterator[Worker]:
    settings = fast_settings(database_url, amqp_url=amqp_url, bus_user=rabbit.bus.name, delivery_limit=DELIVERY_LIMIT)
    async with running_worker(settings, executor=default_executor(), stores=stores) as w:
        yield w


async def test_the_host_example(worker: Worker, scope: Scope, amqp_vhost: Vhost, rabbit: Broker) -> None:
    async with asyncio.timeout(30):
        assert await host_runs_a_lookup(amqp_vhost.url(rabbit.host), scope, f"ex-{uuid.uuid4().hex[:8]}") == "Sunny."


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
        return (await stores.runs.get_run(scope, run_id)).state is RunState.COMPLETED

    await eventually(completed, within=30, what="the asked run completed")
