"""RabbitMQ for the tests: a fresh virtual host per test on the real broker, real test users, queues that
capture what was published, and a broker restart.

Every test gets a vhost of its own, so exchanges, queues and messages never leak between tests. Making one
with ``rabbitmqctl`` is slow because every call boots an Erlang VM: measured on the development machine,
``add_vhost`` plus ``set_permissions`` take about 2 s and ``delete_vhost`` about 0.7 s, which would cost
more than the tests themselves. So vhosts are made in batches by ONE ``rabbitmqctl import_definitions``
call (about 1.1 s for a batch of any size, the test users and their permissions included) and each is
deleted in the background once its test is done; the session waits for the last deletions at its end.
The management HTTP API would be faster still, but the plugin is not enabled on every machine.

The broker is ``INTERMISSION_TEST_AMQP_URL`` (default ``amqp://guest:guest@127.0.0.1:5672/``) and is
administered with ``INTERMISSION_TEST_RABBITMQCTL`` (default ``rabbitmqctl``, which must reach the same
node). Use the fixtures by importing them (``from tests.support.amqp import amqp_url  # noqa: F401``) or by
listing ``tests.support.amqp`` in ``pytest_plugins``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import secrets
import shlex
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection
from yarl import URL

from intermission.publishers.amqp import connect
from intermission.wire import declare
from tests.support.rabbitctl import (
    BrokerBroken,
    delete_vhosts,
    full_rights,
    rabbitmqctl,
    restart_app,
    settle_dead_lettering,
    user_definition,
    write_definitions,
)

log = logging.getLogger("tests.support.amqp")

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
VHOST_PREFIX = "intermission-test"
VHOST_BATCH = 16
# Test connections come back quickly after a broker restart (aio-pika's default waits 5 s).
RECONNECT_SECONDS = 0.3
WAIT_SECONDS = 15.0
DELIVERY_LIMIT = 5
CTL_SECONDS = 120.0


@dataclass(frozen=True)
class AmqpUser:
    name: str
    password: str


@dataclass(frozen=True)
class Vhost:
    name: str
    base_url: str

    def url(self, user: AmqpUser | None = None) -> str:
        """The vhost's URL as ``user`` (the base URL's user, guest by default, when None)."""
        parsed = URL(self.base_url).with_path("/" + self.name)
        if user is not None:
            parsed = parsed.with_user(user.name).with_password(user.password)
        return str(parsed)


@dataclass
class Broker:
    """The test broker: its URL, ``rabbitmqctl`` serialised through one lock, and a pool of fresh vhosts."""

    base_url: str
    ctl: list[str]
    # Real RabbitMQ users (not guest) with full rights on every test vhost: the bus, and a host.
    bus: AmqpUser
    host: AmqpUser
    # How many tests of this session still need a vhost, so a batch makes no more than will be used.
    expected: int = VHOST_BATCH
    admin: asyncio.Lock = field(default_factory=asyncio.Lock)
    fresh: list[str] = field(default_factory=list)
    condemned: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    deleter: asyncio.Task[None] | None = None

    async def _run(self, *args: str) -> str:
        return await rabbitmqctl(self.ctl, *args)

    async def run(self, *args: str) -> str:
        async with self.admin:
            return await self._run(*args)

    async def take_vhost(self) -> str:
        async with self.admin:
            if not self.fresh:
                count = max(1, min(self.expected, VHOST_BATCH))
                names = [f"{VHOST_PREFIX}-{uuid.uuid4().hex[:12]}" for _ in range(count)]
                await self._import(names)
                self.fresh.extend(names)
            self.expected -= 1
            return self.fresh.pop()

    async def _import(self, vhosts: Sequence[str]) -> None:
        users = (self.bus, self.host)
        definitions = {
            "users": [user_definition(u.name, u.password) for u in users],
            "vhosts": [{"name": v} for v in vhosts],
            "permissions": [full_rights(who, v) for v in vhosts for who in ("guest", *(u.name for u in users))],
        }
        with tempfile.TemporaryDirectory() as folder:
            await self._run("import_definitions", str(write_definitions(Path(folder), definitions)))

    def discard_vhost(self, name: str) -> None:
        """Delete ``name`` in the background; the session waits for it at its end."""
        self.condemned.put_nowait(name)
        if self.deleter is None:
            self.deleter = asyncio.create_task(self._delete_forever(), name="vhost-deleter")

    async def _delete_forever(self) -> None:
        done = False
        while not done:
            names = [await self.condemned.get()]
            while not self.condemned.empty():
                names.append(self.condemned.get_nowait())
            done = None in names
            await self.delete_vhosts([n for n in names if n is not None])

    async def delete_vhosts(self, names: Sequence[str]) -> None:
        """Delete ``names`` (one ``eval``, after RabbitMQ's dead-letter workers settled: bench/rabbitctl.py)."""
        async with self.admin:
            for problem in await delete_vhosts(self.ctl, names, who="intermission-tests"):
                log.warning("not deleted: %s", problem)

    @asynccontextmanager
    async def stopped(self) -> AsyncIterator[None]:
        """``rabbitmqctl stop_app`` for the length of the block, ``start_app`` ALWAYS after it. It stops the
        whole broker (every connection of every test on it is dropped), so keep the block short."""
        async with self.admin:
            # If this process dies inside the block (a pytest timeout, a kill of the event loop), the
            # broker must not stay down for everybody else on the machine.
            atexit.register(self._start_app_now)
            await self._run("stop_app")
            try:
                yield
            finally:
                # Back only once the recovered queues' dead-letter workers have started: a vhost deleted
                # before that can break the node for everybody (bench/rabbitctl.py).
                await restart_app(self.ctl)
                atexit.unregister(self._start_app_now)

    def _start_app_now(self) -> None:
        subprocess.run([*self.ctl, "-q", "start_app"], check=False, timeout=CTL_SECONDS)  # noqa: S603 - our argv

    async def close(self) -> None:
        if self.deleter is not None:
            self.condemned.put_nowait(None)
            await self.deleter
        await self.delete_vhosts(self.fresh)
        async with self.admin:
            users = [self.bus.name, self.host.name]
            for problem in await delete_vhosts(self.ctl, [], users=users, who="intermission-tests"):
                log.warning("not deleted: %s", problem)


async def _reachable(url: str) -> bool:
    try:
        connection = await aio_pika.connect(url, timeout=3)
    except (OSError, TimeoutError, aio_pika.exceptions.AMQPError):
        return False
    await connection.close()
    return True


@pytest.fixture(scope="session")
async def rabbit(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    url = os.environ.get("INTERMISSION_TEST_AMQP_URL", DEFAULT_URL)
    ctl = shlex.split(os.environ.get("INTERMISSION_TEST_RABBITMQCTL", "rabbitmqctl"))
    if not await _reachable(url):
        pytest.exit(f"no RabbitMQ answers at {URL(url).with_password(None)}", 2)
    suffix = uuid.uuid4().hex[:8]
    broker = Broker(
        base_url=url,
        ctl=ctl,
        bus=AmqpUser(f"intermission-test-bus-{suffix}", secrets.token_urlsafe(16)),
        host=AmqpUser(f"intermission-test-host-{suffix}", secrets.token_urlsafe(16)),
        expected=sum("amqp_vhost" in getattr(item, "fixturenames", ()) for item in request.session.items),
    )
    try:
        # Also proves the node can still declare the topology's queues (bench/rabbitctl.py).
        await settle_dead_lettering(ctl)
    except BrokerBroken as exc:
        pytest.exit(str(exc), 2)
    except (RuntimeError, OSError) as exc:
        pytest.exit(f"rabbitmqctl ({shlex.join(ctl)}) cannot administer the test broker: {exc}", 2)
    yield broker
    await broker.close()


@pytest.fixture
async def amqp_vhost(rabbit: Broker) -> AsyncIterator[Vhost]:
    """A fresh, empty vhost of this test's own; guest and the two test users may do anything in it."""
    name = await rabbit.take_vhost()
    yield Vhost(name=name, base_url=rabbit.base_url)
    rabbit.discard_vhost(name)


async def declare_topology(url: str, label: str = "topology") -> None:
    """The whole topology (fleet.topology.declare) in the vhost of ``url``."""
    connection = await aio_pika.connect(url, client_properties={"connection_name": label})
    try:
        channel = await connection.channel()
        await declare(channel, delivery_limit=DELIVERY_LIMIT)
    finally:
        await connection.close()


@pytest.fixture
async def amqp_url(amqp_vhost: Vhost, request: pytest.FixtureRequest) -> str:
    """guest's URL of a fresh vhost where the whole topology (fleet.topology.declare) is declared."""
    url = amqp_vhost.url()
    await declare_topology(url, f"topology {request.node.nodeid}")
    return url


ConnectionFactory = Callable[..., Awaitable[AbstractRobustConnection]]


@pytest.fixture
async def amqp_connect(request: pytest.FixtureRequest) -> AsyncIterator[ConnectionFactory]:
    """``await amqp_connect(url, label)``: a robust connection named after the test, closed after it."""
    opened: list[AbstractRobustConnection] = []

    async def make(url: str, label: str = "test") -> AbstractRobustConnection:
        connection = await connect(url, f"{label} {request.node.nodeid}", reconnect_interval=RECONNECT_SECONDS)
        opened.append(connection)
        return connection

    yield make
    for connection in reversed(opened):
        await connection.close()


@dataclass(frozen=True)
class Captured:
    """One message as a queue received it."""

    message_id: str | None
    routing_key: str | None
    body: bytes
    type: str | None
    content_type: str | None
    delivery_mode: int | None
    headers: dict[str, Any]
    correlation_id: str | None
    user_id: str | None
    redelivered: bool | None

    def json(self) -> Any:
        return json.loads(self.body)


class Capture:
    """A durable queue bound to an exchange, recording every message delivered to it, in order.

    Durable (and read with a robust connection) so that it keeps what is routed to it across a broker
    restart and hands it over once the connection is back.
    """

    def __init__(self) -> None:
        self.messages: list[Captured] = []
        self._changed = asyncio.Condition()

    async def consume(self, queue: AbstractQueue) -> None:
        """Record (and acknowledge) what ``queue`` holds and receives from now on: a queue the test made
        for other reasons, such as a subscriber's queue."""
        await queue.consume(self._arrived)

    async def _arrived(self, message: AbstractIncomingMessage) -> None:
        await message.ack()
        self.messages.append(
            Captured(
                message_id=message.message_id,
                routing_key=message.routing_key,
                body=message.body,
                type=message.type,
                content_type=message.content_type,
                delivery_mode=int(message.delivery_mode) if message.delivery_mode is not None else None,
                headers=dict(message.headers),
                correlation_id=message.correlation_id,
                user_id=message.user_id,
                redelivered=message.redelivered,
            )
        )
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(
        self, check: Callable[[list[Captured]], bool], *, within: float = WAIT_SECONDS, what: str = "messages"
    ) -> list[Captured]:
        """Wait (woken by each arrival, bounded by ``within``) until ``check`` holds for what arrived."""
        try:
            async with asyncio.timeout(within), self._changed:
                await self._changed.wait_for(lambda: check(self.messages))
        except TimeoutError:
            raise AssertionError(
                f"{what} did not arrive within {within} s; got {len(self.messages)} messages"
            ) from None
        return self.messages

    async def wait_count(self, n: int, *, within: float = WAIT_SECONDS) -> list[Captured]:
        return await self.wait_for(lambda got: len(got) >= n, within=within, what=f"{n} messages")

    async def wait_ids(self, ids: set[str], *, within: float = WAIT_SECONDS) -> list[Captured]:
        return await self.wait_for(
            lambda got: ids <= {m.message_id for m in got}, within=within, what=f"{len(ids)} message ids"
        )

    def ids(self) -> list[str | None]:
        return [m.message_id for m in self.messages]


CaptureFactory = Callable[..., Awaitable[Capture]]


@pytest.fixture
async def capture(amqp_connect: ConnectionFactory) -> CaptureFactory:
    """``await capture(url, exchange, *keys)``: a Capture bound to ``exchange`` with ``keys`` in that vhost."""

    async def make(url: str, exchange: str, *keys: str) -> Capture:
        connection = await amqp_connect(url, "capture")
        channel = await connection.channel()
        queue = await channel.declare_queue(f"capture-{uuid.uuid4().hex[:12]}", durable=True)
        for key in keys:
            await queue.bind(exchange, key)
        recorder = Capture()
        await recorder.consume(queue)
        return recorder

    return make
