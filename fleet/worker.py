"""``intermission worker``: one process that runs claimed runs under leases and reclaims lapsed ones.

Shutdown order on SIGTERM/SIGINT: stop taking work, let runs stop at their next boundary within the grace
period (their leases are released for another worker), cancel what is left, close the pool.
"""

from __future__ import annotations

import asyncio
import logging

from fleet.plugins import load_executor
from fleet.runtime import Fleet
from fleet.settings import Settings
from fleet.signals import stop_on_signals
from store import Stores

log = logging.getLogger("intermission.worker")


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    executor = load_executor(settings.executor)
    stores = await Stores.connect(settings.database_url, max_size=settings.pool_max_size)
    try:
        fleet = Fleet(stores, settings, executor)
        with stop_on_signals(stop):
            await fleet.start()
            log.info("worker started", extra={"action": "worker_started", "owner": fleet.owner})
            await stop.wait()
            log.info("worker stopping", extra={"action": "worker_stopping", "running": fleet.running})
            await fleet.stop()
    finally:
        await stores.close()
    log.info("worker stopped", extra={"action": "worker_stopped"})
