"""Fixtures shared by every tier, one per resource: a real PostgreSQL with a fresh database per test, an
inspector of its rows, the store over it, a worker and its clients on the test's own RabbitMQ vhost
(``tests/support/amqp.py``), and the tier markers, applied by folder."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from intermission.agent.loop import default_executor
from intermission.engine.core import Engine
from intermission.fleet.settings import Settings
from intermission.fleet.worker import Worker, running_worker
from intermission.publishers.clients import BusClient, HostClient
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support import pg
from tests.support.fleet import fast_settings
from tests.support.inspect import Inspector, inspector

if TYPE_CHECKING:
    # Types only: importing the plugin module here would defeat pytest's assertion rewriting of it.
    from tests.support.amqp import Broker, Vhost

TESTS = Path(__file__).resolve().parent

# RabbitMQ fixtures: a vhost per test, captures, real test users, a broker restart.
pytest_plugins = ["tests.support.amqp", "tests.support.confined"]

# Each folder is a tier, marked as such: run one with -m (``-m "not soak"``, ``-m unit``).
TIERS = {"unit", "integration", "acceptance", "soak", "bench", "cluster", "browser"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.path)).relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


MakeStores = Callable[[int], Awaitable[list[Stores]]]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    dsn = pg.server_dsn()
    if asyncio.run(pg.reachable(dsn)):
        yield dsn
        return
    try:
        # Newer testcontainers warn that this module moved; the suite turns warnings into errors, and a
        # machine without a server must still get the message below rather than a warning's traceback.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from testcontainers.postgres import PostgresContainer
    except ImportError:  # pragma: no cover - the test extra installs it
        pytest.exit(f"no PostgreSQL answers at {dsn} and testcontainers is not installed", 2)
    try:
        container = PostgresContainer("postgres:16-alpine", driver=None)
        container.start()
    except Exception as exc:  # pragma: no cover - only on machines with neither server nor Docker
        pytest.exit(f"no PostgreSQL answers at {dsn}, and no Docker to start one: {exc}", 2)
    try:
        yield pg.with_database(container.get_connection_url(), "postgres")
    finally:
        container.stop()


@pytest.fixture(scope="session")
async def pg_template(pg_server: str) -> AsyncIterator[str]:
    name = await pg.create_template(pg_server)
    yield name
    await pg.drop(pg_server, name)


@pytest.fixture
async def database_url(pg_server: str, pg_template: str) -> AsyncIterator[str]:
    """A fresh, migrated database of this test's own."""
    name = await pg.create_from_template(pg_server, pg_template)
    yield pg.with_database(pg_server, name)
    await pg.drop(pg_server, name)


@pytest.fixture
async def stores(database_url: str) -> AsyncIterator[Stores]:
    # Planned as a worker plans (store/db.py, Database.connect): the transitions under test are a worker's.
    s = await Stores.connect(database_url, min_size=1, max_size=8, generic_plans=True)
    yield s
    await s.close()


@pytest.fixture
def engine(stores: Stores) -> Engine:
    """The engine over ``stores``: every change of a run is applied through it (``engine.at(scope)`` for the
    original package's store API). It holds no lease: a test that applies commands gives one
    (``engine.under(lease=...)``)."""
    return Engine.over(stores)


@pytest.fixture
async def make_stores(database_url: str) -> AsyncIterator[MakeStores]:
    """``await make_stores(n)``: n stores, each over ONE connection of its own, already open. Races use
    them so that every contender is a separate Postgres session from the start."""
    opened: list[Stores] = []

    async def make(n: int) -> list[Stores]:
        batch = await asyncio.gather(
            *(Stores.connect(database_url, min_size=1, max_size=1, generic_plans=True) for _ in range(n))
        )
        opened.extend(batch)
        return list(batch)

    yield make
    await asyncio.gather(*(s.close() for s in opened))


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Inspector]:
    """The test database seen from outside the store: a raw connection of its own."""
    async with inspector(database_url) as i:
        yield i


@pytest.fixture
def settings(database_url: str, amqp_url: str, rabbit: Broker) -> Settings:
    """A worker's settings over the test's database and vhost: short leases, the test bus user."""
    from tests.support.amqp import DELIVERY_LIMIT

    return fast_settings(database_url, amqp_url=amqp_url, bus_user=rabbit.bus.name, delivery_limit=DELIVERY_LIMIT)


@pytest.fixture
async def worker(settings: Settings, stores: Stores) -> AsyncIterator[Worker]:
    """A whole worker (consumers, relay, fleet) in this process, over ``stores``."""
    async with running_worker(settings, executor=default_executor(), stores=stores) as w:
        yield w


@pytest.fixture
async def host(amqp_vhost: Vhost, rabbit: Broker) -> AsyncIterator[HostClient]:
    """A host client connected as the test's host user."""
    async with await HostClient.connect(amqp_vhost.url(rabbit.host), name="test host") as client:
        yield client


@pytest.fixture
async def bus(amqp_vhost: Vhost, rabbit: Broker) -> AsyncIterator[BusClient]:
    """The messaging bus's client, connected as the test's bus user."""
    async with await BusClient.connect(amqp_vhost.url(rabbit.bus), name="test bus") as client:
        yield client


@pytest.fixture
def scope() -> Scope:
    return Scope(app="acme", tenant="t1")


@pytest.fixture
def other_scope() -> Scope:
    return Scope(app="acme", tenant="t2")


async def race(n: int, contender: Callable[[int], Awaitable[Any]]) -> list[Any]:
    """Run ``n`` contenders released at the same instant; each result is its value or its exception."""
    gate = asyncio.Event()
    all_waiting = asyncio.Event()
    waiting = 0

    async def one(i: int) -> Any:
        nonlocal waiting
        waiting += 1
        if waiting == n:
            all_waiting.set()
        await gate.wait()
        return await contender(i)

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await all_waiting.wait()
    gate.set()
    return await asyncio.gather(*tasks, return_exceptions=True)
