"""The lease keeper: ONE per worker, renewing every lease the worker holds in one statement per tick, over a
connection of its own (``store/leases.py``), never through the shared pool.

Why one connection of its own: the pool serves up to ``PREFETCH`` commands in flight and every run's
saves; a renewal that borrowed from it waited behind them, its lease lapsed, and another worker took over
a run that was alive. Why one statement: a worker's renewals cost one round trip per tick whatever the
number of runs it holds.

What a renewal tells each run:

- still held, perhaps with an end asked of it while it ran (a cancel): ``on_ending`` is called, and the run
  finishes that end at its next boundary (``RunContext``);
- no longer held (its lease lapsed and passed to someone else, or it left running): ``on_lost`` is called,
  and the fleet cancels the run's task, so this worker writes nothing more for it;
- nothing known, because the renewal itself failed (the database restarting, the connection lost): the
  line reconnects at the next tick, and each run whose lease may have lapsed by this process's own clock
  is given up the same way, because another worker may already hold it.

The keeper renews through a ``LeaseLine``: on a worker, ``store/leases.py``'s, one connection of its own; in
the fast tier of tests, the in-memory committer's (``engine/memory.py``), over the same tables the engine
writes. Either satisfies the protocol below by its shape alone, so neither imports the fleet.

The keeper's loop runs under the process's supervisor (``fleet/supervisor.py``) from the first run it holds
until the fleet stops; a tick that finds no run closes its connection, so an idle worker holds none for it.
A bug in the loop gives every held run up at once (a keeper that died quietly would let their leases lapse
while they went on writing) and the supervisor restarts the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from intermission.fleet.supervisor import Supervisor
from intermission.schemas.errors import IntermissionError
from intermission.schemas.run import Ending
from intermission.schemas.scope import Scope
from intermission.store.leases import HeldRun, Renewed

log = logging.getLogger("intermission.lease")

LEASE_TASK = "lease-keeper"


class LeaseLine(Protocol):
    """What the keeper renews through (``store.leases.LeaseLine`` over PostgreSQL)."""

    async def renew(self, owner: str, ttl_seconds: float, held: Sequence[HeldRun]) -> dict[HeldRun, Renewed]:
        """Renew ``owner``'s lease on each run of ``held`` by the store's clock (now + ttl); the runs still
        held, by their key. A run missing from the answer is no longer held by ``owner``. An
        ``IntermissionError`` (StoreUnavailable) when the renewal itself failed: nothing is known then."""
        ...

    async def close(self) -> None:
        """Let go of what the line holds while idle (a connection); the next renewal takes it again."""
        ...


@dataclass(eq=False)
class Holding:
    """One run's place in the keeper."""

    held: HeldRun
    # Whose lease it is: the worker's own, unless the run was claimed under another owner of this process.
    owner: str
    on_lost: Callable[[], None]
    on_ending: Callable[[Ending], None]
    # Until when the lease holds at least, by this process's monotonic clock: a renewal asked at t holds
    # until t + ttl by the database's clock, which is never earlier than that.
    held_until: float = field(default=0.0)


class LeaseKeeper:
    def __init__(
        self, line: LeaseLine, owner: str, *, ttl_seconds: float, renew_every: float, supervisor: Supervisor
    ) -> None:
        self._line = line
        self._owner = owner
        self._ttl = ttl_seconds
        self._renew_every = renew_every
        self._supervisor = supervisor
        # By the run's key (its id within its scope): one worker may hold runs of one id in two scopes.
        self._holdings: dict[HeldRun, Holding] = {}
        self._stopped = asyncio.Event()

    @property
    def held(self) -> int:
        return len(self._holdings)

    def hold(
        self,
        run_id: str,
        scope: Scope,
        *,
        on_lost: Callable[[], None],
        on_ending: Callable[[Ending], None],
        owner: str | None = None,
    ) -> Holding:
        """Keep renewing the lease on ``run_id`` (held by ``owner``, the keeper's own by default) until
        ``release``. Call right after the lease was taken."""
        # The lease was taken (by the database clock) moments before this; by this process's clock it holds
        # about ttl from here (the claim's own latency is the error, and it is small beside the ttl).
        holding = Holding(
            HeldRun(run_id, scope), owner or self._owner, on_lost, on_ending, time.monotonic() + self._ttl
        )
        self._holdings[holding.held] = holding
        if not self._stopped.is_set() and not self._supervisor.running(LEASE_TASK):
            self._supervisor.start(LEASE_TASK, self._keep)
        return holding

    def release(self, holding: Holding) -> None:
        """Stop renewing: the run paused, ended, was released or lost."""
        if self._holdings.get(holding.held) is holding:
            del self._holdings[holding.held]

    async def renew_once(self) -> None:
        """One tick: renew every held lease in one statement (one per lease owner, and a worker's runs all
        have the worker's) and tell each run what it learnt."""
        owners: dict[str, list[Holding]] = {}
        for h in self._holdings.values():
            owners.setdefault(h.owner, []).append(h)
        for owner, batch in owners.items():
            await self._renew(owner, batch)

    async def _renew(self, owner: str, batch: list[Holding]) -> None:
        asked_at = time.monotonic()
        try:
            renewed = await self._line.renew(owner, self._ttl, [h.held for h in batch])
        except IntermissionError as exc:
            now = time.monotonic()
            for h in batch:
                if self._holdings.get(h.held) is h and now >= h.held_until:
                    log.warning(
                        "lease may have lapsed while the database was unreachable; giving the run up",
                        extra={
                            "action": "lease_abandoned",
                            "run_id": h.held.run_id,
                            "scope": str(h.held.scope),
                            "error": exc.code,
                        },
                    )
                    self._give_up(h)
            log.info("lease renewal failed; retrying", extra={"action": "lease_retry", "error": exc.code})
            return
        for h in batch:
            if self._holdings.get(h.held) is not h:
                continue  # it left while the renewal was in flight: nothing to tell it
            found = renewed.get(h.held)
            if found is None:
                # Either the lease passed on (the run's task is then stopped, and says so) or the run just
                # left running by its own pause or end, committed while this renewal ran: the run's holder
                # tells the two apart (Fleet), so this is not yet news.
                log.info(
                    "lease not renewed",
                    extra={"action": "lease_not_renewed", "run_id": h.held.run_id, "scope": str(h.held.scope)},
                )
                self._give_up(h)
                continue
            h.held_until = asked_at + self._ttl
            if found.ending is not None:
                h.on_ending(found.ending)

    def _give_up(self, h: Holding) -> None:
        self.release(h)
        h.on_lost()

    async def _keep(self) -> None:
        try:
            while not self._stopped.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), self._renew_every)
                if self._stopped.is_set():
                    return
                if not self._holdings:
                    await self._line.close()  # idle: reopened by the next renewal
                    continue
                await self.renew_once()
        except Exception:
            # A bug, not the database (renew_once takes those): nobody renews these leases until the
            # supervisor has restarted the loop, so give every run up now rather than let them write on.
            for h in list(self._holdings.values()):
                self._give_up(h)
            raise

    async def stop(self) -> None:
        """Stop renewing (the fleet stops), and close the connection."""
        self._stopped.set()
        await self._supervisor.cancel(LEASE_TASK)
        await self._line.close()
