"""A broker given as a list of nodes, on the real RabbitMQ: every connect and reconnect tries the nodes in
turn, so a connection whose node dies moves to another one, and the worker and hosts carry on there.

The "nodes" are TCP proxies (tests/support/netproxy.py) in front of the one local broker: closing a proxy is
its node dying, for the connections through it and for every later connect to its port. Also the
PostgreSQL side: a multi-host DSN whose first host is dead connects to the second and says where it is.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import aio_pika
import pytest
from yarl import URL

from intermission.agent.loop import default_executor
from intermission.fleet.worker import running_worker
from intermission.publishers.amqp import NodesConnection, amqp_nodes, connect
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import StartCommand
from intermission.schemas.errors import RunNotFound
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.store import Stores
from intermission.store.db import Database
from tests.support.amqp import DELIVERY_LIMIT, Broker, Vhost
from tests.support.fleet import fast_settings
from tests.support.netproxy import NetProxy, net_proxy
from tests.support.waiting import eventually

WITHIN = 20.0
RECONNECT = 0.3
NODE_TIMEOUT = 1.0


def port_of(proxy: NetProxy) -> int:
    return URL(proxy.url("amqp://x@127.0.0.1/")).port or 0


@asynccontextmanager
async def nodes(broker_url: str, n: int) -> AsyncIterator[list[NetProxy]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(net_proxy(broker_url)) for _ in range(n)]


def node_list(url: str, ports: list[int]) -> str:
    """``url`` (credentials, vhost) as a node list over ``ports`` on the loopback."""
    single = URL(url)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"amqp://{single.raw_user}:{single.raw_password}@{hosts}{single.raw_path}"


def dead_port() -> int:
    """A loopback port nothing listens on (connecting is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def reconnected(connection: NodesConnection) -> asyncio.Event:
    happened = asyncio.Event()
    connection.reconnect_callbacks.add(lambda *_: happened.set())
    return happened


def proxy_of(proxies: list[NetProxy], connection: NodesConnection) -> NetProxy:
    (proxy,) = [p for p in proxies if port_of(p) == connection.node_url.port]
    return proxy


async def test_a_dead_node_is_left_for_another_and_the_fleet_carries_on(
    database_url: str,
    stores: Stores,
    amqp_url: str,
    amqp_vhost: Vhost,
    rabbit: Broker,
    scope: Scope,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="intermission.publishers")
    async with nodes(amqp_url, 3) as proxies:
        ports = [port_of(p) for p in proxies]
        settings = fast_settings(
            database_url,
            amqp_url=node_list(amqp_url, ports),
            bus_user=rabbit.bus.name,
            delivery_limit=DELIVERY_LIMIT,
            amqp_reconnect_seconds=RECONNECT,
            amqp_connect_timeout_seconds=NODE_TIMEOUT,
        )
        host_url = node_list(amqp_vhost.url(rabbit.host), ports)
        async with (
            running_worker(settings, executor=default_executor(), stores=stores) as worker,
            await HostClient.connect(host_url, reconnect_interval=RECONNECT, connect_timeout=NODE_TIMEOUT) as host,
        ):
            worker_connection, host_connection = worker.connection, host.connection
            assert isinstance(worker_connection, NodesConnection)
            assert isinstance(host_connection, NodesConnection)

            async def completes() -> None:
                run_id = f"run-{uuid.uuid4().hex[:8]}"
                await host.start(
                    StartCommand(
                        scope=scope, run_id=run_id, agent_id="demo", script=[ScriptTurn.model_validate({"say": "ok"})]
                    )
                )

                async def done() -> bool:
                    try:
                        return (await stores.at(scope).runs.get_run(run_id)).state is RunState.COMPLETED
                    except RunNotFound:
                        return False

                await eventually(done, within=WITHIN, what=f"{run_id} completed")

            await completes()

            # Both nodes die (one, if worker and host share it): each connection moves to a live one.
            worker_was, host_was = worker_connection.node_url, host_connection.node_url
            worker_back, host_back = reconnected(worker_connection), reconnected(host_connection)
            for proxy in {proxy_of(proxies, worker_connection), proxy_of(proxies, host_connection)}:
                await proxy.close()
            async with asyncio.timeout(WITHIN):
                await worker_back.wait()
                await host_back.wait()
            assert worker_connection.node_url != worker_was
            assert host_connection.node_url != host_was
            dead = {worker_was.port, host_was.port}
            assert worker_connection.node_url.port not in dead
            assert host_connection.node_url.port not in dead

            # The host publishes (with its confirm) and the worker consumes on the new nodes.
            await completes()

    moved = [r for r in caplog.records if getattr(r, "action", None) == "amqp_moved"]
    assert len(moved) >= 2
    ours = [r for r in caplog.records if str(getattr(r, "action", "")).startswith("amqp_")]
    for record in ours:
        said = " ".join(str(getattr(record, key, "")) for key in ("url", "node", "from_node", "first_node"))
        assert "guest:guest" not in said
    assert all(re.match(r"amqp://[^:@]+:\*\*\*@127\.0\.0\.1:\d+/", str(getattr(r, "node", ""))) for r in moved)


async def test_a_node_down_at_the_start_is_skipped_within_its_timeout(amqp_url: str) -> None:
    # A refused node, then a silent one (accepts TCP, never speaks AMQP: a broker hung in its handshake),
    # then the live one.
    silent_sockets: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent_sockets.append(writer)

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    silent_port: int = silent.sockets[0].getsockname()[1]
    try:
        async with nodes(amqp_url, 1) as (live,):
            url = node_list(amqp_url, [dead_port(), silent_port, port_of(live)])
            timeout = 0.5
            started = time.monotonic()
            connection = await connect(url, "skips dead nodes", connect_timeout=timeout, offset=0)
            elapsed = time.monotonic() - started
            try:
                assert connection.node_url.port == port_of(live)
                # The refused node costs nothing, the silent one one attempt: all nodes' transports plus
                # one handshake, each within the per-node timeout.
                assert elapsed < timeout * (3 + 1) + 1.0
                channel = await connection.channel()
                await channel.declare_queue(exclusive=True)
            finally:
                await connection.close()

            # A refused node alone costs well under one per-node timeout.
            slow = 3.0
            started = time.monotonic()
            connection = await connect(
                node_list(amqp_url, [dead_port(), port_of(live)]), "skips", connect_timeout=slow, offset=0
            )
            try:
                assert time.monotonic() - started < slow
                assert connection.node_url.port == port_of(live)
            finally:
                await connection.close()
    finally:
        for writer in silent_sockets:
            writer.close()
        silent.close()
        await silent.wait_closed()


async def test_processes_at_different_offsets_land_on_different_nodes(amqp_url: str) -> None:
    async with nodes(amqp_url, 3) as proxies:
        url = node_list(amqp_url, [port_of(p) for p in proxies])
        connections = [await connect(url, f"offset {i}", offset=i) for i in range(3)]
        try:
            assert {c.node_url.port for c in connections} == {port_of(p) for p in proxies}
        finally:
            for c in connections:
                await c.close()


async def test_a_single_url_connects_as_before(amqp_url: str) -> None:
    connection = await connect(amqp_url, "single")
    try:
        assert connection.node_url == amqp_nodes(amqp_url)[0]
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(exclusive=True)
        await channel.default_exchange.publish(aio_pika.Message(b"x"), routing_key=queue.name)
    finally:
        await connection.close()


async def test_a_dsn_listing_a_dead_host_first_connects_to_the_next_and_says_so(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="intermission.store")
    real = URL(database_url)
    dsn = (
        f"postgresql://{real.raw_user}@127.0.0.1:{dead_port()},{real.host}:{real.port}{real.raw_path}"
        "?target_session_attrs=read-write"
    )
    database = await Database.connect(dsn, min_size=1, max_size=2, connect_timeout=10)
    try:
        async with database.connection() as conn:
            assert await conn.fetchval("database_now") is not None
        connected = [r for r in caplog.records if getattr(r, "action", None) == "pg_connected"]
        assert [getattr(r, "server", None) for r in connected] == [f"{real.host}:{real.port}"]
    finally:
        await database.close()
