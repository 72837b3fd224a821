"""The partition fault's machinery on its own: a network namespace whose only addresses are its own, a
relay into it, and a cut that holds bytes both ways until it heals (bench/cluster/partition.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from bench.cluster.partition import Namespace, Relay, _setns, available
from bench.cluster.servers import NETNS_PREFIX

T = TypeVar("T")

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no network namespaces here: {available()}")


async def inside(namespace: Namespace, work: Callable[[], T]) -> T:
    """``work`` on a thread of its own that has entered ``namespace`` (and dies with it)."""
    done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()

    def thread() -> None:
        try:
            _setns(namespace.path)
            result = work()
        except BaseException as exc:  # handed to the test
            loop.call_soon_threadsafe(done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(done.set_result, result)

    threading.Thread(target=thread).start()
    return await asyncio.wait_for(done, 30)


async def test_a_cut_holds_bytes_both_ways_until_it_heals() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(100):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    namespace = Namespace(f"{NETNS_PREFIX}test-{os.getpid()}")
    await asyncio.to_thread(namespace.create)
    relay = Relay(namespace, [port])
    client: socket.socket | None = None
    try:
        await relay.start()

        def connect() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"one")
            assert sock.recv(100) == b"one"
            return sock

        client = await inside(namespace, connect)
        assert relay.connections[port] == 1

        # Only what is relayed exists inside: the machine's own servers are not reachable there.
        def reach_postgres() -> int:
            with socket.socket() as probe:
                probe.settimeout(5)
                return probe.connect_ex(("127.0.0.1", 5432))

        assert await inside(namespace, reach_postgres) != 0

        relay.partition(port)
        cut = client

        def unanswered() -> bool:
            cut.sendall(b"two")
            cut.settimeout(1.0)
            try:
                cut.recv(100)
            except TimeoutError:
                return True
            return False

        # Bounded by its timeout: nothing may come back while the cut lasts.
        assert await asyncio.to_thread(unanswered)
        relay.heal(port)

        def answered() -> bytes:
            cut.settimeout(10.0)
            return cut.recv(100)

        # The held bytes went through once healed, as TCP's retransmissions would.
        assert await asyncio.to_thread(answered) == b"two"
    finally:
        if client is not None:
            client.close()
        await relay.close()
        await asyncio.to_thread(namespace.remove)
        server.close()
        await server.wait_closed()
    assert not namespace.path.exists()
