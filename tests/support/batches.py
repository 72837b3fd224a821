"""Holding a worker's claims back, so that the commands published meanwhile gather for the next batch (group
commit, engine/committer.py): for the tests of what one batch does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from intermission.agent.loop import default_executor
from intermission.engine.claims import CLAIM
from intermission.fleet.settings import Settings
from intermission.fleet.worker import Worker, running_worker
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from tests.support.waiting import eventually

WAIT = 30.0


def answer(notice: Notice, content: str = "42") -> ResumeCommand:
    """A host's result for the first pending call of ``notice``."""
    return ResumeCommand(
        scope=notice.scope,
        version=version_of(notice),
        results=[ToolAnswer(call_id=notice.pending[0].id, content=content)],
    )


@asynccontextmanager
async def one_batch_at_a_time(settings: Settings, stores: Stores) -> AsyncIterator[Worker]:
    changed = settings.model_copy(update={"command_batches_in_flight": 1, "prefetch": 64})
    async with running_worker(changed, executor=default_executor(), stores=stores) as w:
        yield w


@asynccontextmanager
async def held_back(
    stores: Stores, w: Worker, host: HostClient, blocker: Notice
) -> AsyncIterator[Callable[[int], Awaitable[None]]]:
    """Hold the worker's one batch of claims on the blocker run's row lock. Yields ``gathered(n)``, which returns
    once ``n`` commands' claims wait for the next batch; leaving the block lets the lock go."""
    scheduler = w.fleet.engine.scheduler
    con: asyncpg.Connection[Any] = await asyncpg.connect(stores.db.dsn)
    try:
        tx = con.transaction()
        await tx.start()
        await con.execute("SELECT 1 FROM runs WHERE id = $1 FOR UPDATE", blocker.run_id)
        await host.resume(answer(blocker))

        async def blocked() -> bool:
            # The blocker's claim (a batch of one) waits on the lock. Read on another connection: inside a
            # transaction, pg_stat_activity is read once and kept.
            async with stores.db.connection() as watcher:
                waiting = await watcher.raw.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query LIKE '%intermission_claim_pauses_v2%'"
                )
            return bool(waiting == 1)

        await eventually(blocked, within=WAIT, what="the blocker's claim waiting on its lock")

        async def gathered(n: int) -> None:
            async def enough() -> bool:
                return scheduler.waiting(CLAIM) >= n

            await eventually(enough, within=WAIT, what=f"{n} deliveries waiting for the next batch")

        yield gathered
        await tx.rollback()
    finally:
        await con.close()
