"""A deployment of the version before scoped routing, with commands waiting in its queues, converted by
``intermission topology upgrade``: a worker of this version refuses to start on it and names the command;
after the upgrade the queues still hold every command, and a worker applies each of them."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika

from intermission.schemas.commands import StartCommand
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.store import Stores
from intermission.wire import (
    COMMAND_QUEUES,
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_QUEUE,
    EVENTS_EXCHANGE,
    Command,
    command_queue_arguments,
    message,
)
from tests.acceptance.test_messaging_faults import WAIT
from tests.support.amqp import DELIVERY_LIMIT, Broker, Vhost
from tests.support.confined import Confiner
from tests.support.fleet import fast_settings
from tests.support.waiting import eventually
from tests.support.worker_process import cli, cli_process, worker_env

QUEUED = 20


async def declare_previous_topology(url: str) -> None:
    """The topology as the version before scoped routing declared it: a direct commands exchange, each
    queue bound with its bare key."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        commands = await channel.declare_exchange(COMMANDS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True)
        await channel.declare_exchange(EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
        dead = await channel.declare_exchange(DEAD_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
        dead_queue = await channel.declare_queue(DEAD_QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
        await dead_queue.bind(dead)
        for command, name in COMMAND_QUEUES.items():
            queue = await channel.declare_queue(name, durable=True, arguments=command_queue_arguments(DELIVERY_LIMIT))
            await queue.bind(commands, routing_key=command.value)
    finally:
        await connection.close()


async def publish_starts(url: str, scope: Scope) -> list[str]:
    """Starts as an old host sent them: the bare key, through the direct exchange, confirmed."""
    run_ids = [f"queued-{i:02d}-{uuid.uuid4().hex[:8]}" for i in range(QUEUED)]
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
        for run_id in run_ids:
            body = StartCommand(
                scope=scope, run_id=run_id, agent_id="demo", input="hi", script=[ScriptTurn(say="done")]
            )
            await exchange.publish(
                message(body.model_dump_json(), message_id=f"start-{run_id}", routing_key=Command.START.value),
                routing_key=Command.START.value,
            )
    finally:
        await connection.close()
    return run_ids


async def intermission(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    ran = await cli(*args, env=env, within=WAIT)
    return ran.code, ran.out, ran.err


async def queued_starts(url: str) -> int:
    """Messages in intermission.start, as a passive declaration counts them (``list_queues`` lags behind
    on quorum queues)."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(Command.START.queue, passive=True)
        count = queue.declaration_result.message_count
    finally:
        await connection.close()
    assert count is not None
    return count


async def test_upgrade_converts_a_running_direct_deployment_and_keeps_every_queued_command(
    database_url: str, stores: Stores, amqp_vhost: Vhost, rabbit: Broker, confiner: Confiner, scope: Scope
) -> None:
    url = amqp_vhost.url()
    await declare_previous_topology(url)
    run_ids = await publish_starts(url, scope)
    assert await queued_starts(url) == QUEUED
    settings = fast_settings(database_url, amqp_url=url, bus_user=rabbit.bus.name, delivery_limit=DELIVERY_LIMIT)
    env = worker_env(settings)

    # A worker of this version will not run on it, and says how to convert it.
    code, _, said = await intermission("worker", env=env)
    assert code == 1, said[-3000:]
    assert "is not a topic exchange" in said, said[-3000:]
    assert "intermission topology upgrade" in said, said[-3000:]
    assert await queued_starts(url) == QUEUED

    code, out, said = await intermission("topology", "upgrade", env=env)
    assert code == 0, said[-3000:]
    assert "converted intermission.commands to a topic exchange" in out
    assert await confiner.exchange_type(COMMANDS_EXCHANGE) == "topic"
    assert await queued_starts(url) == QUEUED
    # Running it again finds nothing to do.
    code, out, said = await intermission("topology", "upgrade", env=env)
    assert (code, out.strip()) == (0, "the topology is up to date"), said[-3000:]

    # A worker now applies every command that waited, old bare-keyed ones and a new scoped one alike.
    newer = f"after-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
        body = StartCommand(scope=scope, run_id=newer, agent_id="demo", script=[ScriptTurn(say="done")])
        key = Command.START.key(scope)
        await exchange.publish(message(body.model_dump_json(), message_id=newer, routing_key=key), routing_key=key)
    finally:
        await connection.close()
    proc = await cli_process("worker", env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        wanted = {*run_ids, newer}

        async def all_completed() -> bool:
            async with stores.db.connection() as con:
                done = await con.raw.fetchval(
                    "SELECT count(*) FROM runs WHERE id = ANY($1) AND state = $2",
                    list(wanted),
                    RunState.COMPLETED.value,
                )
            return bool(done == len(wanted))

        await eventually(all_completed, within=WAIT, what=f"all {len(wanted)} runs completed")
    finally:
        proc.terminate()
        async with asyncio.timeout(WAIT):
            await proc.wait()
    assert await queued_starts(url) == 0
