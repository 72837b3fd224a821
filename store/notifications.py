"""Wake-ups for the outbox relay: ``LISTEN intermission_outbox`` on a connection of its own.

The ``outbox_notify`` trigger (migrations 0001 and 0004) signals once per transaction that adds outbox
rows, unless the writing session says its own process relays them (``intermission.relayed = on``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

import asyncpg

from intermission.store.db import Conn, is_transient

log = logging.getLogger("intermission.store.notifications")

# The channel the outbox_notify trigger signals on.
OUTBOX_CHANNEL: Final = "intermission_outbox"


class OutboxListener:
    """``LISTEN intermission_outbox`` on a connection of its own, calling ``on_wake`` for each notification.

    The connection is NOT taken from the pool: the pool resets a connection with ``UNLISTEN *`` when it is
    released, and a listener would hold a pool slot for the life of the process. When the connection
    drops (or stops answering the periodic ping) the listener reconnects and listens again, and calls
    ``on_wake`` once after every (re)connection, because notifications sent while it was not listening
    are lost for good.

    Usage::

        async with OutboxListener(dsn, wake.set):
            ...
    """

    def __init__(
        self,
        dsn: str,
        on_wake: Callable[[], None],
        *,
        application_name: str = "intermission-relay",
        retry_seconds: float = 0.5,
        max_retry_seconds: float = 10.0,
        ping_seconds: float = 30.0,
    ) -> None:
        self._dsn = dsn
        self._on_wake = on_wake
        self._application_name = application_name
        self._retry_seconds = retry_seconds
        self._max_retry_seconds = max_retry_seconds
        self._ping_seconds = ping_seconds
        self._task: asyncio.Task[None] | None = None
        # How many times LISTEN succeeded: 1, plus one per re-listen after a lost connection.
        self.listens = 0
        self._listened = asyncio.Condition()

    async def __aenter__(self) -> OutboxListener:
        self._task = asyncio.create_task(self._run(), name=f"{self._application_name}-listen")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def wait_listening(self, count: int = 1) -> None:
        """Wait until LISTEN has succeeded ``count`` times (health checks and tests)."""
        async with self._listened:
            await self._listened.wait_for(lambda: self.listens >= count)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The listening task; it ends only by cancellation or a bug, which its owner should watch for."""
        return self._task

    def _notified(self, *_: Any) -> None:
        self._on_wake()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._listen_until_lost()
                failures = 0
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
                failures += 1
                log.warning(
                    "outbox listener lost its connection",
                    extra={"action": "outbox_listen_lost", "error": type(exc).__name__, "transient": is_transient(exc)},
                )
            await asyncio.sleep(min(self._retry_seconds * 2 ** min(failures, 16), self._max_retry_seconds))

    async def _listen_until_lost(self) -> None:
        con: asyncpg.Connection[Any] = await asyncpg.connect(
            self._dsn, timeout=10, server_settings={"application_name": self._application_name}
        )
        lost = asyncio.Event()
        con.add_termination_listener(lambda _con: lost.set())
        try:
            await con.add_listener(OUTBOX_CHANNEL, self._notified)
            self.listens += 1
            async with self._listened:
                self._listened.notify_all()
            log.info("listening for outbox rows", extra={"action": "outbox_listen", "listens": self.listens})
            self._on_wake()
            while not lost.is_set():
                try:
                    async with asyncio.timeout(self._ping_seconds):
                        await lost.wait()
                except TimeoutError:
                    # A connection that died without a FIN never reports it; a ping finds out.
                    async with asyncio.timeout(self._ping_seconds):
                        await Conn(con).fetchval("outbox_listener_ping")
        finally:
            con.terminate()
