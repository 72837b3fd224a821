"""The one way store code talks to Postgres: a pool, transactions, and statements by name.

``Conn`` accepts query NAMES, never SQL text, so every statement that runs is one of the reviewed
statements in ``store/queries/``, by name. Driver errors
are translated here into Intermission's typed errors (``store_unavailable`` for what a retry may cure);
asyncpg types never leave ``store/``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from intermission.schemas.errors import (
    IntermissionError,
    InvalidArgument,
    InvalidState,
    StoreContention,
    StoreUnavailable,
)
from intermission.store.queries import QUERIES

log = logging.getLogger("intermission.store")

# SQLSTATEs a retry may cure. By class: 08 (connection exception) and 53 (insufficient resources: too many
# connections, out of memory or disk). By code: the server going away or refusing connections while it
# starts, stops or recovers (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now); a
# statement cancelled by an operator or a timeout (57014), which a fresh transaction may well finish; and a
# read-only transaction (25006), which is what a connection to a former primary sees after a failover until
# the pool reconnects to the new one.
_UNAVAILABLE_CLASSES = ("08", "53")
_UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "57014", "25006"})
# The database is up but this transaction lost to another one: serialization_failure, deadlock_detected,
# lock_not_available.
_CONTENTION_SQLSTATES = frozenset({"40001", "40P01", "55P03"})


# Raised by a transition function (store/migrations/0005_transitions.sql) that found a state it refuses to
# write over; everything else it refuses is an outcome it returns.
INVALID_STATE_SQLSTATE = "IM409"

_BAD_TEXT_SQLSTATES = frozenset(
    {
        "22P05",  # untranslatable_character (U+0000 in text or jsonb)
        "22021",  # character_not_in_repertoire (invalid UTF-8)
    }
)


class StoreError(IntermissionError):
    """The database refused a statement for a reason the store did not expect."""

    code = "store_error"


def is_contention(exc: BaseException) -> bool:
    return isinstance(exc, asyncpg.PostgresError) and exc.sqlstate in _CONTENTION_SQLSTATES


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, asyncpg.PostgresError):
        state = exc.sqlstate or ""
        return (
            state.startswith(_UNAVAILABLE_CLASSES) or state in _UNAVAILABLE_SQLSTATES or state in _CONTENTION_SQLSTATES
        )
    # InternalClientError: a pooled connection whose backend was terminated can be handed out while its
    # protocol still consumes the server's error ("cannot switch to state ..."); another connection cures it.
    return isinstance(
        exc,
        OSError
        | asyncpg.InterfaceError
        | asyncpg.InternalClientError
        | asyncpg.exceptions.ConnectionDoesNotExistError
        | TimeoutError,
    )


@contextmanager
def translated() -> Iterator[None]:
    """Re-raise driver errors as typed Intermission errors, cause chained."""
    try:
        yield
    except IntermissionError:
        raise
    except (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError, TimeoutError) as exc:
        if is_contention(exc):
            raise StoreContention(f"transaction lost to another: {type(exc).__name__}") from exc
        if is_transient(exc):
            raise StoreUnavailable(f"database unavailable: {type(exc).__name__}") from exc
        if getattr(exc, "sqlstate", None) in _BAD_TEXT_SQLSTATES:
            # PostgreSQL text cannot hold U+0000 and must be valid UTF-8: the caller's input, not a fault.
            raise InvalidArgument("text must be valid UTF-8 without U+0000 (NUL)") from exc
        sqlstate = getattr(exc, "sqlstate", None)
        if sqlstate == INVALID_STATE_SQLSTATE:
            # A transition function found a state the fleet never produces and rolled itself back.
            raise InvalidState(str(getattr(exc, "message", exc))) from exc
        raise StoreError(f"database error {sqlstate or type(exc).__name__}") from exc


class Conn:
    """A connection that runs named statements."""

    __slots__ = ("raw",)

    def __init__(self, raw: asyncpg.Connection[Any] | PoolConnectionProxy[Any]) -> None:
        self.raw = raw

    async def fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        return await self.raw.fetch(QUERIES[name].sql, *args)

    async def fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        return await self.raw.fetchrow(QUERIES[name].sql, *args)

    async def fetchval(self, name: str, *args: Any) -> Any:
        return await self.raw.fetchval(QUERIES[name].sql, *args)

    async def execute(self, name: str, *args: Any) -> str:
        return await self.raw.execute(QUERIES[name].sql, *args)


async def _forget_types(raw: asyncpg.Connection[Any] | PoolConnectionProxy[Any]) -> None:
    """A migration changed a row type this connection had cached (transitions hand back whole rows, which
    asyncpg decodes by the type it once looked up): drop what the connection knows of types and statements,
    so the caller's retry (the error is StoreUnavailable, a transient one) reads the new type."""
    await raw.reload_schema_state()


async def _keep_session(_raw: asyncpg.Connection[Any]) -> None:
    """The pool's reset on release: nothing beyond what asyncpg always does.

    asyncpg's default reset sends ``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`` on every
    release: a round trip that costs more than most of the statements it follows. Store code never leaves
    session state on a pooled connection (no session advisory locks, cursors, LISTEN or SET: the migrator
    and the outbox listener use connections of their own), so there is nothing to undo. asyncpg still rolls
    back a transaction left open and drops listeners before calling this.
    """


class _ServerTracker:
    """The pool's ``init`` hook: on every new connection, asks which server it reached and logs
    ``pg_connected`` when that is another one than the last (the first one too).

    With a multi-host DSN (``postgresql://h1:5432,h2:5432/db?target_session_attrs=read-write``) asyncpg
    picks the host per connection, so a failover shows up only as new connections landing elsewhere. One
    round trip per NEW connection, which a pool opens rarely.
    """

    def __init__(self) -> None:
        self.server: str | None = None

    async def __call__(self, raw: asyncpg.Connection[Any]) -> None:
        row = await raw.fetchrow(QUERIES["server_address"].sql)
        server = f"{row['address'] or 'local socket'}:{row['port']}" if row is not None else "unknown"
        if server != self.server:
            log.info(
                "database connected",
                extra={"action": "pg_connected", "server": server, "previous_server": self.server},
            )
            self.server = server


class Database:
    """One asyncpg pool per process, and the transactions store code runs in.

    ``relayed``: this process runs an outbox relay, which the engine hands every event it commits
    (``engine/sink.py``). Its sessions then set ``intermission.relayed = on``, which tells the
    ``outbox_notify`` trigger not to NOTIFY (migration 0004): the relay learns of this process's rows
    in-process instead, and no other worker's relay is woken for them.
    """

    def __init__(
        self, pool: asyncpg.Pool, *, dsn: str | None = None, server_settings: dict[str, str] | None = None
    ) -> None:
        self.pool = pool
        # Kept for the connections a process needs beside the pool (``connect_dedicated``).
        self.dsn = dsn
        self.server_settings = dict(server_settings or {})
        # Which server the pool's connections reach (set by ``connect``, which installs the init hook).
        self.tracker: _ServerTracker | None = None

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        command_timeout: float = 30.0,
        application_name: str = "intermission",
        relayed: bool = False,
        connect_timeout: float = 60.0,
        generic_plans: bool = False,
    ) -> Database:
        """A pool over ``dsn``, which may list several hosts (asyncpg tries them in order) and ask for
        ``target_session_attrs=read-write`` so that only the primary is taken.

        ``connect_timeout`` bounds one connection attempt over the WHOLE host list, not each host: asyncpg
        spends one budget across them, so a host that drops packets (no RST) can use it up before the next
        host is tried. Give it room for every host.

        ``generic_plans``: the sessions plan each statement once and keep that plan (``plan_cache_mode =
        force_generic_plan``), for a worker. Its statements are the transitions, whose statements inside the
        functions are large data-modifying CTEs probing by key; with the default the planner compares a plan
        made for the call's own values with a generic one, and because values such as ``p_checkpoint_id IS
        NULL`` fold whole branches away in the former, it keeps choosing it: every call planned its CTE
        again. Measured side by side (bench.resume), a fifth of PostgreSQL's CPU per resume went to that.
        Every such statement probes unique keys, whose plan does not depend on the values; the sweeper's
        and the operators' range scans keep the default.
        """
        settings = {"application_name": application_name}
        if generic_plans:
            settings["plan_cache_mode"] = "force_generic_plan"
        if relayed:
            settings["intermission.relayed"] = "on"
        tracker = _ServerTracker()
        with translated():
            pool = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                command_timeout=command_timeout,
                server_settings=settings,
                reset=_keep_session,
                init=tracker,
                timeout=connect_timeout,
            )
        database = cls(pool, dsn=dsn, server_settings=settings)
        database.tracker = tracker
        return database

    async def connect_dedicated(self, application_name: str, *, command_timeout: float) -> Conn:
        """A connection of its own, outside the pool, to the same database with the same session settings:
        for work that must never queue behind the pool's borrowers (lease renewal, ``store/leases.py``).
        The caller closes it (``Conn.raw``)."""
        if self.dsn is None:
            raise StoreError("this database was not opened from a DSN, so it cannot open a connection of its own")
        settings = {**self.server_settings, "application_name": application_name}
        with translated():
            # The connect is bounded too: a caller that must act by its own clock cannot wait out a minute.
            raw = await asyncpg.connect(
                self.dsn, timeout=command_timeout, command_timeout=command_timeout, server_settings=settings
            )
        return Conn(raw)

    async def close(self, grace: float = 10.0) -> None:
        """Wait for connections to be released, up to ``grace`` seconds, then terminate the rest."""
        try:
            await asyncio.wait_for(self.pool.close(), grace)
        except TimeoutError:
            self.pool.terminate()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Conn]:
        """A connection inside one transaction; it commits when the block ends without an error."""
        with translated():
            async with self.pool.acquire() as raw:
                try:
                    async with raw.transaction():
                        yield Conn(raw)
                except asyncpg.OutdatedSchemaCacheError:
                    await _forget_types(raw)
                    raise

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        """A connection in autocommit mode: each statement is its own transaction."""
        with translated():
            async with self.pool.acquire() as raw:
                try:
                    yield Conn(raw)
                except asyncpg.OutdatedSchemaCacheError:
                    await _forget_types(raw)
                    raise
