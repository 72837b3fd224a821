"""Group commit for run boundaries: runs that save a step or end at the same moment share one statement.

A worker runs many runs at once, and under load several of them reach a step boundary (``save_progress``)
or their end (``end_run``) within the same moment. Each alone is a round trip and a commit with its WAL
flush. ``Coalesced`` gives every caller of such a transition the row of its own call, but runs the calls
that wait together as ONE statement (the transition's batch form: one array per argument, the transition
called once per element in array order, ``store/queries``), so they share one round trip and one commit.
Each call's transition is still whole inside that statement: a step is saved, or a run ended, entirely or
not at all, and the outcome (saved; the lease lost; an end asked for) is each call's own row.

Nothing waits for company. A call runs at once, alone, when fewer than ``max_batches`` statements are in
flight; the calls that arrive while they are take the next one together. So a quiet worker pays nothing
(one turn of the event loop), and a busy one commits less often the busier it is.

A batch whose statement fails is retried call by call, each alone: one call's bad argument (a value the
database refuses) fails only that call, and an outage fails each call as it would have alone.

A transition that writes an event its writer publishes from memory (an end's run.* event, migration 0011)
takes the connection's outbox hold as its ``outbox_hold`` argument, set here for every call, and
``handed`` says which event a call's row wrote: those go to the database's hand-over once the statement
has committed (``Conn.hand_over``), as a claim's do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg

from intermission.store.outbox import OutboxEvent
from intermission.store.queries import QUERIES

if TYPE_CHECKING:
    from intermission.store.db import Conn, Database

log = logging.getLogger("intermission.store")

Named = Mapping[str, Any]
# The event a call's row says its transition wrote under the hold (None: it wrote none).
Handed = Callable[[Named, asyncpg.Record], OutboxEvent | None]


class Coalesced:
    """Calls of the single-row statement ``single`` that are waiting at the same moment, run as ONE
    ``batch`` statement (see the module docstring). ``batch`` takes ``single``'s named arguments as arrays
    in ``single``'s order and returns ``single``'s columns with the call's position ``n``."""

    def __init__(
        self,
        db: Database,
        single: str,
        batch: str,
        *,
        max_size: int = 64,
        max_batches: int = 2,
        handed: Handed | None = None,
    ) -> None:
        arguments = QUERIES[single].arguments
        if arguments is None:
            raise ValueError(f"query {single!r} does not name its arguments")
        if (handed is not None) != ("outbox_hold" in arguments):
            raise ValueError(f"query {single!r}: an outbox_hold argument goes with events handed over")
        self._handed = handed
        self._db = db
        self._single = single
        self._batch = batch
        self._arguments = arguments
        self._max_size = max_size
        self._max_batches = max_batches
        self._waiting: list[tuple[Named, asyncio.Future[asyncpg.Record | None]]] = []
        self._running: set[asyncio.Task[None]] = set()
        # How many calls each statement carried (for tests and metrics).
        self.sizes: list[int] = []

    async def fetchrow(self, **named: Any) -> asyncpg.Record | None:
        """The row ``single`` returns for ``named``, or the error it raises."""
        done: asyncio.Future[asyncpg.Record | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((named, done))
        if len(self._running) < self._max_batches:
            task = asyncio.create_task(self._run())
            self._running.add(task)
            task.add_done_callback(self._finished)
        return await done

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        if self._waiting and len(self._running) < self._max_batches:
            again = asyncio.create_task(self._run())
            self._running.add(again)
            again.add_done_callback(self._finished)

    async def _run(self) -> None:
        # Taken when the task first runs: every call made in the same turn of the event loop goes along.
        taken, self._waiting = self._waiting[: self._max_size], self._waiting[self._max_size :]
        if not taken:
            return
        self.sizes.append(len(taken))
        if len(taken) > 1:
            try:
                rows = await self._together([named for named, _ in taken])
            except Exception as failed:  # nobody's in particular: each call goes alone, with its own outcome
                log.debug(
                    "a coalesced statement failed; its calls go one by one",
                    extra={"action": "coalesced_failed", "statement": self._batch, "error": type(failed).__name__},
                )
            else:
                for (_, done), row in zip(taken, rows, strict=True):
                    if not done.done():
                        done.set_result(row)
                return
        for named, done in taken:
            try:
                async with self._db.connection() as con:
                    held = self._held(con, named)
                    alone = await con.fetchrow(self._single, **held)
                    self._hand_over(con, [held], [alone])
            except Exception as failed:
                if not done.done():
                    done.set_exception(failed)
            else:
                if not done.done():
                    done.set_result(alone)

    async def _together(self, calls: list[Named]) -> list[asyncpg.Record]:
        # By run, so that two statements take the rows they share in the same order.
        order = sorted(range(len(calls)), key=lambda i: (calls[i]["app"], calls[i]["tenant"], calls[i]["run_id"]))
        async with self._db.connection() as con:
            held = [self._held(con, calls[i]) for i in order]
            columns = [[named[name] for named in held] for name in self._arguments]
            found = await con.fetch(self._batch, *columns)
            if len(found) != len(calls):
                raise RuntimeError(f"{self._batch} returned {len(found)} rows for {len(calls)} calls")
            self._hand_over(con, held, found)
        rows: list[asyncpg.Record] = list(found)
        for position, i in enumerate(order):
            rows[i] = found[position]
        return rows

    def _held(self, con: Conn, named: Named) -> Named:
        """``named`` with the connection's outbox hold, for a transition whose events are handed over."""
        if self._handed is None:
            return named
        return {**named, "outbox_hold": con.outbox_hold}

    def _hand_over(self, con: Conn, calls: Sequence[Named], found: Sequence[asyncpg.Record | None]) -> None:
        """The events the statement wrote under the hold go to the hand-over after its commit."""
        if self._handed is None or con.outbox_hold is None:
            return
        handed = self._handed
        con.hand_over(
            [
                event
                for named, row in zip(calls, found, strict=True)
                if row is not None and (event := handed(named, row)) is not None
            ]
        )
