"""A worker cut off from one RabbitMQ node, by a network namespace the harness makes itself.

The worker runs in a namespace of its own (``ip netns add``) whose only interface is its loopback: the
addresses it sees exist only inside it. On that loopback the harness listens at the very ports the
cluster's servers use (three RabbitMQ nodes, the two PostgreSQL servers), from sockets it opens inside the
namespace (a thread enters it with ``setns`` just to create them; a socket stays in the namespace it was
made in), and relays every connection to the real server in the harness's own namespace. The worker
is given the same URLs as every other process and cannot tell.

A partition stops the relay for one node's port, both ways: bytes in flight wait as packets would (TCP
would retransmit them), a connection attempted meanwhile is accepted by the kernel but never answered (so
the AMQP handshake times out, as it would when SYNs go unanswered). Nothing is closed: the worker must find
out by itself (heartbeats, connect timeouts) and move to another node. Healing lets the held bytes through;
connections that a side gave up on meanwhile are then closed.

Nothing outside the namespace changes: no address, route or firewall rule of the machine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import socket
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

log = logging.getLogger("cluster.partition")

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
CHUNK = 1 << 16


def _setns(path: Path) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def available() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        _ip("netns", "list")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns is not usable: {exc}"
    return None


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=10)  # noqa: S603, S607


class Namespace:
    """A network namespace with only its loopback, up; removed by ``remove``."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    def create(self) -> None:
        self.remove()
        _ip("netns", "add", self.name)
        _ip("-n", self.name, "link", "set", "lo", "up")

    def remove(self) -> None:
        if self.path.exists():
            _ip("netns", "del", self.name, check=False)

    def enter(self) -> Callable[[], None]:
        """For a child process (``preexec_fn``): enter this namespace before it runs anything."""
        path = self.path
        return lambda: _setns(path)

    def listen(self, port: int) -> socket.socket:
        """A listening socket at 127.0.0.1:``port`` INSIDE the namespace, for this process to serve."""
        made: list[socket.socket] = []
        failed: list[BaseException] = []

        def make() -> None:
            try:
                # Only this short-lived thread moves; the socket keeps the namespace it was made in.
                _setns(self.path)
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(128)
                sock.setblocking(False)
                made.append(sock)
            except BaseException as exc:  # handed to the caller's thread
                failed.append(exc)

        thread = threading.Thread(target=make, name=f"netns-listen-{port}")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return made[0]


class Relay:
    """Relays ``ports`` from inside ``namespace`` to the same ports on this machine's 127.0.0.1, and cuts
    any one of them on demand (``partition``/``heal``)."""

    def __init__(self, namespace: Namespace, ports: list[int]) -> None:
        self.namespace = namespace
        self.ports = ports
        self._servers: list[asyncio.Server] = []
        self._open: dict[int, asyncio.Event] = {}
        self._streams: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Connections relayed, by port, since the start (the proof the worker used the relay).
        self.connections: dict[int, int] = dict.fromkeys(ports, 0)
        self.active: dict[int, int] = dict.fromkeys(ports, 0)

    async def start(self) -> None:
        for port in self.ports:
            gate = asyncio.Event()
            gate.set()
            self._open[port] = gate
            sock = self.namespace.listen(port)
            server = await asyncio.start_server(self._handler(port), sock=sock)
            self._servers.append(server)

    def partition(self, port: int) -> None:
        self._open[port].clear()

    def heal(self, port: int) -> None:
        self._open[port].set()

    def _handler(self, port: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._tasks.add(task)
            self._streams.add(writer)
            self.connections[port] += 1
            self.active[port] += 1
            upstream: asyncio.StreamWriter | None = None
            try:
                # A connection made during a partition is held, unanswered, until the partition heals.
                await self._open[port].wait()
                up_reader, upstream = await asyncio.open_connection("127.0.0.1", port)
                self._streams.add(upstream)
                await asyncio.gather(self._pump(port, reader, upstream), self._pump(port, up_reader, writer))
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                self.active[port] -= 1
                for stream in (writer, upstream):
                    if stream is not None:
                        self._streams.discard(stream)
                        with contextlib.suppress(Exception):
                            stream.close()
                if task is not None:
                    self._tasks.discard(task)

        return handle

    async def _pump(self, port: int, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        gate = self._open[port]
        try:
            while True:
                # Cut: read nothing and pass nothing on, so neither side hears from the other.
                await gate.wait()
                data = await source.read(CHUNK)
                await gate.wait()
                if not data:
                    break
                sink.write(data)
                await sink.drain()
        finally:
            with contextlib.suppress(Exception):
                sink.close()

    async def close(self) -> None:
        for gate in self._open.values():
            gate.set()
        for server in self._servers:
            server.close()
        for stream in list(self._streams):
            with contextlib.suppress(Exception):
                stream.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
