"""What the publishers read and write: the outbox relay's batches and wake-ups, and the expiry sweeper's
cross-scope read.

The relay claims a batch of unsent outbox rows with ``FOR UPDATE SKIP LOCKED`` inside one transaction,
publishes them, and marks the confirmed ones sent in that same transaction. The row locks are what keep
two relays (one per worker) from publishing the same row at the same time; the transaction lasts one
batch's publication, never a reconnect or a back-off.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final

import asyncpg

from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion
from intermission.store.db import Conn, Database, is_transient
from intermission.wire import HeaderValue

log = logging.getLogger("intermission.store.relay")

# The channel the outbox_notify trigger (migration 0001) signals on.
OUTBOX_CHANNEL: Final = "intermission_outbox"

# The keyset cursor's start: before every deadline the database can hold.
_BEFORE_EVERY_DEADLINE: Final = datetime(1, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class OutboxRow:
    """One event to publish, exactly as its writer stored it."""

    id: int
    message_id: str
    routing_key: str
    body: str
    correlation_id: str | None
    headers: dict[str, HeaderValue]


def _headers(raw: str | None) -> dict[str, HeaderValue]:
    decoded: object = json.loads(raw) if raw else {}
    if not isinstance(decoded, dict):
        return {}
    # AMQP header tables take scalars; the outbox only ever stores scalars (the schema version, a
    # traceparent), so anything else is a foreign row and is left out rather than failing the batch.
    return {str(k): v for k, v in decoded.items() if isinstance(v, str | int | float | bool)}


class OutboxBatch:
    """Rows locked by the current relay transaction."""

    def __init__(self, con: Conn, rows: list[OutboxRow]) -> None:
        self._con = con
        self.rows = rows

    async def mark_sent(self, ids: Sequence[int]) -> None:
        """Mark rows sent: call only with the ids whose publisher confirm arrived."""
        if ids:
            await self._con.execute("mark_outbox_sent", list(ids))


class OutboxStore:
    """The relay's side of the outbox."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[OutboxBatch]:
        """Lock up to ``limit`` unsent rows, oldest first, for the length of the block, skipping rows another
        relay holds. The block's ``mark_sent`` commits with it; an error in the block rolls it back and
        leaves every row unsent."""
        async with self.db.transaction() as con:
            found = await con.fetch("claim_unsent_outbox", limit)
            yield OutboxBatch(
                con,
                [
                    OutboxRow(
                        id=r["id"],
                        message_id=str(r["message_id"]),
                        routing_key=r["routing_key"],
                        body=r["body"],
                        correlation_id=r["correlation_id"],
                        headers=_headers(r["headers"]),
                    )
                    for r in found
                ],
            )

    async def count_unsent(self) -> int:
        async with self.db.connection() as con:
            return int(await con.fetchval("count_unsent_outbox"))


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


@dataclass(frozen=True)
class ExpiredPause:
    """A pause whose deadline passed while its run is paused, found by the cross-scope sweep."""

    scope: Scope
    run_id: str
    suspension_id: int
    run_revision: int
    expires_at: datetime

    @property
    def version(self) -> ClaimVersion:
        return ClaimVersion(run_id=self.run_id, suspension_id=self.suspension_id, run_revision=self.run_revision)

    @property
    def cursor(self) -> tuple[datetime, int]:
        return (self.expires_at, self.suspension_id)


class ExpirySweepStore:
    """The expiry sweeper's reads. It is process infrastructure with no request scope, so its one read
    spans every scope; it only lists, and every command it sends names the row's own scope."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def database_now(self) -> datetime:
        """The database clock: every deadline is judged by it, never by this process's clock."""
        async with self.db.connection() as con:
            now: datetime = await con.fetchval("sweeper_database_now")
        return now

    async def list_expired_paused_across_scopes(
        self, cutoff: datetime, after: tuple[datetime, int] | None, limit: int
    ) -> list[ExpiredPause]:
        """CROSS-SCOPE: up to ``limit`` pauses of paused runs, in every scope, whose deadline passed at or
        before ``cutoff`` (and the database clock), in (expires_at, id) order after the keyset cursor
        ``after`` (None: from the first)."""
        after_expires, after_id = after if after is not None else (_BEFORE_EVERY_DEADLINE, 0)
        async with self.db.connection() as con:
            found = await con.fetch("list_expired_paused_across_scopes", cutoff, after_expires, after_id, limit)
        return [
            ExpiredPause(
                scope=Scope(app=r["app"], tenant=r["tenant"]),
                run_id=r["run_id"],
                suspension_id=r["suspension_id"],
                run_revision=r["run_revision"],
                expires_at=r["expires_at"],
            )
            for r in found
        ]
