"""The sweeper's retention loop: every ``PRUNE_INTERVAL_SECONDS`` it prunes what is past retention (paced,
``store/retention.py``) and reports the storage it keeps bounded, the open pauses and their deadlines, the
outbox's lag, and the dead-letter queue's depth and age.

Any number of sweepers run it at once: each batch skips the rows another holds. A loop that fails is
restarted by the process's supervisor like every background loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from aio_pika.abc import AbstractRobustConnection

from intermission.fleet.metrics import SweeperMetrics
from intermission.fleet.settings import Settings
from intermission.publishers.amqp import RETRYABLE
from intermission.publishers.dead_queue import dead_stats
from intermission.store.across_scopes import AcrossScopes
from intermission.store.db import Database
from intermission.store.retention import Counts, Kept, Pruner, Retention

log = logging.getLogger("intermission.pruning")

PRUNER_TASK = "pruner"

# What a robust connection raises while it reconnects: aio-pika's "Connection was not opened" is a bare
# RuntimeError, beside the AMQP errors every publisher retries.
BROKER_AWAY: Final[tuple[type[BaseException], ...]] = (*RETRYABLE, RuntimeError)


def retention_of(settings: Settings) -> Retention:
    return Retention(
        runs=settings.retention_seconds,
        inbox=settings.inbox_retention_seconds,
        outbox=settings.outbox_retention_seconds,
        sessions=settings.session_retention_seconds,
    )


def pruner_for(db: Database, settings: Settings) -> Pruner:
    return Pruner(
        db, retention_of(settings), batch=settings.prune_batch, max_rows_per_second=settings.prune_max_rows_per_second
    )


class PruneLoop:
    def __init__(
        self,
        db: Database,
        connection: AbstractRobustConnection,
        settings: Settings,
        metrics: SweeperMetrics,
    ) -> None:
        self.pruner = pruner_for(db, settings)
        self.figures = AcrossScopes(db)
        self.connection = connection
        self.interval = settings.prune_interval_seconds
        self.metrics = metrics
        metrics.idempotency_window.set(settings.inbox_retention_seconds)

    def _counted(self, kept: Kept, counts: Counts) -> None:
        for table, n in counts.items():
            self.metrics.pruned.labels(table).inc(n)

    async def once(self) -> Counts:
        """One prune of everything due, then the figures the metrics show."""
        removed = await self.pruner.prune(on_batch=self._counted)
        if removed:
            log.info("pruned", extra={"action": "pruned", "rows": removed})
        await self.report()
        return removed

    async def report(self) -> None:
        for table in await self.pruner.storage():
            self.metrics.table_bytes.labels(table.name).set(table.bytes)
            self.metrics.table_rows.labels(table.name).set(table.live_rows)
        ended, inbox = await self.pruner.oldest_kept()
        self.metrics.oldest_ended_run.set(ended or 0.0)
        self.metrics.oldest_inbox.set(inbox or 0.0)
        # What operators look at first, fleet-wide: open pauses and their deadlines, the outbox's lag.
        self.metrics.report_pauses(await self.figures.pause_figures())
        self.metrics.report_outbox(await self.figures.outbox_lag())
        try:
            dead = await dead_stats(self.connection)
        except BROKER_AWAY as exc:
            # The figures wait for the broker; pruning, which needs only the database, must not.
            log.warning(
                "dead-letter figures skipped: the broker is away",
                extra={"action": "report_skipped", "error": repr(exc)},
            )
            return
        self.metrics.dead_letters.set(dead.depth)
        self.metrics.dead_letter_age.set(dead.oldest_seconds or 0.0)

    async def serve(self, stop: asyncio.Event) -> None:
        """Prune every interval until ``stop``; an interval of 0 only reports, never prunes."""
        while not stop.is_set():
            try:
                if self.interval > 0:
                    await self.once()
                else:
                    await self.report()
            except RETRYABLE as exc:
                # The database or the broker is away: what is due stays due until the next interval, and
                # an outage must not count as this loop failing (the supervisor would stop the process).
                log.warning(
                    "prune skipped: a server is unavailable", extra={"action": "prune_skipped", "error": repr(exc)}
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval or 60.0)
