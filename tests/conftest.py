"""Fixtures shared by every tier: a real PostgreSQL, a fresh database per test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support import pg

# RabbitMQ fixtures: a vhost per test, captures, real test users, a broker restart.
pytest_plugins = ["tests.support.amqp"]

MakeStores = Callable[[int], Awaitable[list[Stores]]]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    dsn = pg.server_dsn()
    if asyncio.run(pg.reachable(dsn)):
        yield dsn
        return
    try:
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
    s = await Stores.connect(database_url, min_size=1, max_size=8)
    yield s
    await s.close()


@pytest.fixture
async def make_stores(database_url: str) -> AsyncIterator[MakeStores]:
    """``await make_stores(n)``: n stores, each over ONE connection of its own, already open. Races use
    them so that every contender is a separate Postgres session from the start."""
    opened: list[Stores] = []

    async def make(n: int) -> list[Stores]:
        batch = await asyncio.gather(*(Stores.connect(database_url, min_size=1, max_size=1) for _ in range(n)))
        opened.extend(batch)
        return list(batch)

    yield make
    await asyncio.gather(*(s.close() for s in opened))


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
