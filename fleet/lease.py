"""The lease keeper: one per running run, renewing its lease on schedule.

When a renewal finds the lease gone (it lapsed and another worker took the run, or the run left running),
the keeper marks the run lost and cancels its task: this worker writes nothing more for it. A renewal that
fails for a passing reason (the database restarting) is retried on the next tick; once the lease may have
lapsed by this process's own clock, the run is given up the same way, because another worker may already
hold it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from intermission.schemas.errors import RunLeaseLost, TransientError
from intermission.schemas.run import Lease
from intermission.store.runs import RunStore

log = logging.getLogger("intermission.lease")


class LeaseKeeper:
    def __init__(
        self,
        runs: RunStore,
        run_id: str,
        lease: Lease,
        *,
        renew_every: float,
        on_lost: Callable[[], None],
    ) -> None:
        self._runs = runs
        self._run_id = run_id
        self._lease = lease
        self._renew_every = renew_every
        self._on_lost = on_lost
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def keep(self) -> None:
        # The lease was taken (by the database clock) moments before this started; by this process's
        # monotonic clock it holds at least until here.
        held_until = time.monotonic() + self._lease.ttl_seconds
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self._renew_every)
                return
            except TimeoutError:
                pass
            asked_at = time.monotonic()
            try:
                await self._runs.renew_lease(self._run_id, self._lease)
                held_until = asked_at + self._lease.ttl_seconds
            except RunLeaseLost:
                log.warning("lease lost", extra={"action": "lease_lost", "run_id": self._run_id})
                self._on_lost()
                return
            except TransientError as exc:
                if time.monotonic() >= held_until:
                    log.warning(
                        "lease may have lapsed while the database was unreachable; giving the run up",
                        extra={"action": "lease_abandoned", "run_id": self._run_id, "error": exc.code},
                    )
                    self._on_lost()
                    return
                log.info("lease renewal failed; retrying", extra={"action": "lease_retry", "run_id": self._run_id})
