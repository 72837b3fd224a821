"""A TCP proxy between one test's clients and the real broker, to freeze or cut the network under them.

Nothing is simulated: the client speaks AMQP to the real RabbitMQ, through this proxy, and only this
test's connections are affected (the broker is shared with other engineers' tests, so it is never stopped
for a fault one client should see). ``freeze`` stops forwarding in both directions, as a link that stopped
delivering: what the client sends waits here, and the broker's confirms never arrive. ``thaw`` forwards
again. ``cut`` closes every connection through the proxy at once, as a lost link; it keeps listening, so a
robust connection connects again through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from yarl import URL

CHUNK = 65536


class NetProxy:
    def __init__(self, target: URL) -> None:
        self._target_host = target.host or "127.0.0.1"
        self._target_port = target.port or 5672
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        # Set when a client sent bytes while the link was frozen (they wait here, unforwarded).
        self.held = asyncio.Event()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    def url(self, amqp_url: str) -> str:
        """``amqp_url`` (user, password, vhost) through the proxy."""
        assert self._server is not None, "start the proxy first"
        port: int = self._server.sockets[0].getsockname()[1]
        return str(URL(amqp_url).with_host("127.0.0.1").with_port(port))

    def freeze(self) -> None:
        self.held.clear()
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    async def cut(self) -> None:
        """Close every proxied connection, both ends."""
        for writer in list(self._writers):
            writer.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self._writers.clear()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.thaw()
        await self.cut()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            broker_reader, broker_writer = await asyncio.open_connection(self._target_host, self._target_port)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, broker_writer}
        for pump in (
            self._pump(client_reader, broker_writer, from_client=True),
            self._pump(broker_reader, client_writer, from_client=False),
        ):
            task = asyncio.create_task(pump)
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, from_client: bool) -> None:
        try:
            while data := await reader.read(CHUNK):
                if from_client and not self._flowing.is_set():
                    self.held.set()
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            # One side ended: end the other, as a real link would.
            writer.close()
            self._writers.discard(writer)


@asynccontextmanager
async def net_proxy(target_url: str) -> AsyncIterator[NetProxy]:
    proxy = NetProxy(URL(target_url))
    await proxy.start()
    try:
        yield proxy
    finally:
        with contextlib.suppress(Exception):
            await proxy.close()
