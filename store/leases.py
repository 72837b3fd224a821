"""Lease renewal over a connection of its own: a worker renews every lease it holds in ONE statement per
tick (``renew_leases``, ``store/queries/leases.sql``).

The shared pool serves commands, claims and every run's saves; with up to ``PREFETCH`` commands in flight
on ``POOL_MAX_SIZE`` connections, a renewal that borrowed from it waited behind them, its lease lapsed, and
another worker took a run that was alive and well. A lease line is one connection outside the pool, so a
renewal waits for nothing but the database, and one statement renews all of a worker's runs, however many.

The statement names every run by its id AND its stored scope, so it touches nothing but the runs this
worker holds, at their exact scopes; it crosses scopes only as far as one worker's own runs do.

A connection that fails is dropped (terminated, not closed: a broken one may never answer a close) and the
next renewal opens a new one; a renewal that fails raises ``StoreUnavailable``, and the caller decides,
by its own clock, which runs it must give up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from intermission.schemas.errors import StoreUnavailable
from intermission.schemas.run import Ending
from intermission.schemas.scope import Scope
from intermission.store import rows
from intermission.store.db import Conn, Database, translated


@dataclass(frozen=True)
class HeldRun:
    """A run whose lease this worker holds, and the scope it is stored under: together its key (a run id
    is unique only within its scope, so one worker may hold runs of one id in two scopes)."""

    run_id: str
    scope: Scope


@dataclass(frozen=True)
class Renewed:
    """A run still held after a renewal, and the end asked of it while it ran (None: none was)."""

    run_id: str
    scope: Scope
    ending: Ending | None


class LeaseLine:
    """One connection of its own for a worker's lease renewals, opened when first needed."""

    def __init__(self, db: Database, *, timeout: float, application_name: str = "intermission-leases") -> None:
        self._db = db
        self._timeout = timeout
        self._application_name = application_name
        self._con: Conn | None = None
        # One renewal or close at a time: the connection runs one statement at a time anyway.
        self._lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return self._con is not None

    async def renew(self, owner: str, ttl_seconds: float, held: Sequence[HeldRun]) -> dict[HeldRun, Renewed]:
        """Renew ``owner``'s lease on each run of ``held`` (by the database clock, ``now() + ttl``). Returns
        the runs still held, by their key; a run missing from the answer is no longer held by ``owner`` (it
        lapsed and passed to someone else, or it left running). StoreUnavailable when the renewal itself
        failed: then nothing is known of any of them."""
        if not held:
            return {}
        async with self._lock:
            try:
                if self._con is None:
                    self._con = await self._db.connect_dedicated(self._application_name, command_timeout=self._timeout)
                with translated():
                    found = await self._con.fetch(
                        "renew_leases",
                        owner,
                        ttl_seconds,
                        [h.run_id for h in held],
                        [h.scope.app for h in held],
                        [h.scope.tenant for h in held],
                    )
            except StoreUnavailable:
                self._drop()
                raise
        # Each row answers for one of the runs asked about: the statement matched it on the whole key.
        asked = {(h.scope.app, h.scope.tenant, h.run_id): h for h in held}
        answered = ((asked[(r["app"], r["tenant"], r["id"])], r["ending"]) for r in found)
        return {
            h: Renewed(h.run_id, h.scope, None if ending is None else rows.load_model(Ending, ending, "run ending"))
            for h, ending in answered
        }

    def _drop(self) -> None:
        con, self._con = self._con, None
        if con is not None:
            con.raw.terminate()

    async def close(self) -> None:
        """Close the connection (the next renewal would open another)."""
        async with self._lock:
            con, self._con = self._con, None
        if con is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(con.raw.close(), self._timeout)
            if not con.raw.is_closed():
                con.raw.terminate()
