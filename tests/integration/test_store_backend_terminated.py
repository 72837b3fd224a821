"""Backends terminated under a busy pool (``pg_terminate_backend``, a restarting server) surface as the
typed, transient ``StoreUnavailable`` and nothing else. Found by the soak (bench/soak): asyncpg can hand out
a pooled connection whose backend was just terminated while its protocol still consumes the server's
error, and the next statement on it fails with ``InternalClientError`` ("cannot switch to state 12;
another operation (2) is in progress"). That error left ``store/`` untyped, so no retry loop knew it: the
sweeper process exited, a worker's reclaim sweep died silently, and a run could be failed as
``executor_error``."""

from __future__ import annotations

import asyncio
from collections import Counter

import asyncpg
import pytest

from intermission.schemas.errors import StoreUnavailable
from intermission.store.db import Database, translated

TERMINATIONS = 40
USERS = 4
ROUND_SECONDS = 10.0


def test_an_internal_client_error_is_a_transient_store_error() -> None:
    with pytest.raises(StoreUnavailable) as raised, translated():
        raise asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress")
    assert isinstance(raised.value.__cause__, asyncpg.InternalClientError)


async def test_every_failure_of_a_pool_whose_backends_are_terminated_is_store_unavailable(
    database_url: str, pg_server: str
) -> None:
    database = database_url.rsplit("/", 1)[1]
    db = await Database.connect(database_url, min_size=USERS, max_size=USERS)
    admin = await asyncpg.connect(pg_server)
    failures: Counter[str] = Counter()
    done = 0
    progressed = asyncio.Condition()
    stop = asyncio.Event()

    async def user() -> None:
        nonlocal done
        while not stop.is_set():
            try:
                async with db.connection() as con:
                    await con.raw.fetchval("SELECT 1")
            except Exception as exc:  # every kind is counted: only StoreUnavailable may appear
                failures[type(exc).__name__] += 1
            else:
                done += 1
                async with progressed:
                    progressed.notify_all()
            await asyncio.sleep(0)

    users = [asyncio.create_task(user()) for _ in range(USERS)]
    try:
        for _ in range(TERMINATIONS):
            await admin.fetchval(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = $1 AND pid <> pg_backend_pid()",
                database,
            )
            # The pool must serve again (reconnecting) before the next round of terminations.
            before = done
            async with asyncio.timeout(ROUND_SECONDS), progressed:
                await progressed.wait_for(lambda: done >= before + USERS)  # noqa: B023 - read at once
    finally:
        stop.set()
        await asyncio.gather(*users)
        await admin.close()
        await db.close()
    assert set(failures) <= {"StoreUnavailable"}, failures
    assert done > TERMINATIONS * USERS
