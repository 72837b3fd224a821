"""Faults across the broker: a worker killed between a command's commit and its acknowledgement, and a
RabbitMQ restart while runs pause."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from intermission import points
from intermission.agent.loop import default_executor
from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from tests.support.amqp import Broker
from tests.support.fleet import outbox_keys
from tests.support.waiting import eventually
from tests.support.worker_process import worker_env

ROOT = Path(__file__).resolve().parents[2]
WAIT = 30.0


def start(scope: Scope, *turns: dict[str, Any]) -> StartCommand:
    return StartCommand(
        scope=scope,
        run_id=f"run-{uuid.uuid4().hex[:12]}",
        agent_id="demo",
        input="hi",
        script=[ScriptTurn.model_validate(t) for t in turns],
    )


async def paused_through_a_worker(settings: Settings, stores: Stores, host: HostClient, cmd: StartCommand) -> Notice:
    scope = cmd.scope
    async with running_worker(settings, executor=default_executor(), stores=stores), host.subscribe(scope) as events:
        await host.start(cmd)
        async with asyncio.timeout(WAIT):
            async for received in events:
                if isinstance(received.event, Notice) and received.event.run_id == cmd.run_id:
                    return received.event
    raise AssertionError("no notice")


async def test_a_command_redelivered_after_its_worker_died_between_commit_and_ack_has_one_effect(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    cmd = start(
        scope,
        {"call": [{"tool": "lookup", "arguments": {}}]},
        {"call": [{"tool": "charge", "arguments": {"amount": 1}}]},
    )
    notice = await paused_through_a_worker(settings, stores, host, cmd)

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.crash",
        "worker",
        cwd=ROOT,
        env=worker_env(settings, INTERMISSION_CRASH_AT=points.AFTER_COMMIT),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    resume_id = await host.resume(
        ResumeCommand(scope=scope, version=version_of(notice), results=[ToolAnswer(call_id=notice.pending[0].id)])
    )
    async with asyncio.timeout(WAIT):
        _, err = await proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    # The effect committed (the claim, its lease, the inbox record) and the message was never acknowledged.
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.RUNNING

    async with running_worker(settings, executor=default_executor(), stores=stores) as survivor:

        async def completed() -> bool:
            return (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.COMPLETED

        await eventually(completed, within=WAIT, what="the run completed by the survivor")
        await survivor.drain()

    async with stores.db.connection() as con:
        raw = con.raw
        assert await raw.fetchval("SELECT count(*) FROM inbox WHERE message_id = $1", resume_id) == 1
        charged = await raw.fetchval("SELECT count(*) FROM demo_charges WHERE run_id = $1", cmd.run_id)
    assert charged == 1
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 1  # one effect, for two deliveries
    assert keys[-1] == f"run.completed.{scope.app}.{scope.tenant}"


async def test_every_notice_arrives_after_a_rabbitmq_restart_while_runs_pause(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, rabbit: Broker
) -> None:
    # Each run sleeps a moment before it pauses, so the pauses commit while the broker is down.
    commands = [
        start(scope, {"call": [{"tool": "sleep", "arguments": {"seconds": 3}}]}, {"call": [{"tool": "lookup"}]})
        for _ in range(6)
    ]
    queue = f"test-notices-{uuid.uuid4().hex[:8]}"
    async with (
        running_worker(settings, executor=default_executor(), stores=stores),
        host.subscribe(scope, durable_queue=queue) as events,
    ):
        for cmd in commands:
            await host.start(cmd)

        async def all_started() -> bool:
            async with stores.db.connection() as con:
                n = await con.raw.fetchval("SELECT count(*) FROM runs WHERE id = ANY($1)", [c.run_id for c in commands])
            return bool(n == len(commands))

        await eventually(all_started, within=WAIT, what="every start consumed")
        async with rabbit.stopped():

            async def all_paused() -> bool:
                async with stores.db.connection() as con:
                    n = await con.raw.fetchval(
                        "SELECT count(*) FROM runs WHERE id = ANY($1) AND state = 'paused'",
                        [c.run_id for c in commands],
                    )
                return bool(n == len(commands))

            await eventually(all_paused, within=WAIT, what="every run paused during the outage")
            async with stores.db.connection() as con:
                unsent = await con.raw.fetchval(
                    "SELECT count(*) FROM outbox"
                    " WHERE run_id = ANY($1) AND sent_at IS NULL AND routing_key LIKE 'notice.%'",
                    [c.run_id for c in commands],
                )
            assert unsent > 0  # the pauses committed with the broker down: their notices wait in the outbox

        heard: dict[str, int] = {}
        async with asyncio.timeout(WAIT * 2):
            async for received in events:
                if isinstance(received.event, Notice):
                    heard[received.event.run_id] = heard.get(received.event.run_id, 0) + 1
                    if set(heard) == {c.run_id for c in commands}:
                        break
    assert set(heard) == {c.run_id for c in commands}
    assert all(times == 1 for times in heard.values())  # the subscription deduplicates re-publications
    async with stores.db.connection() as con:
        assert (
            await con.raw.fetchval(
                "SELECT count(*) FROM outbox WHERE run_id = ANY($1) AND sent_at IS NULL", [c.run_id for c in commands]
            )
            == 0
        )
