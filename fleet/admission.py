"""The places a worker has for runs (``INTERMISSION_RUNS_IN_FLIGHT``), handed out one scope at a time.

A command that may start or resume a run holds a place from before its transaction until it has handed its
run over (``Fleet.admitting``); a takeover holds its batch's places from before its claim. Past the cap the
commands wait here, unacknowledged, and when a place frees it goes to the scopes waiting in turn: the
oldest waiting command of the scope after the one served last. So a tenant whose commands fill the worker's
prefetch does not keep another tenant's command that reached the worker behind all of them: it waits for
at most one of each other waiting scope's commands. The key a command waits under is its routing key, which
names its scope; it orders the waiting and authorises nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable


class Admission:
    def __init__(self, cap: int, running: Callable[[], int]) -> None:
        self.cap = cap
        self._running = running
        self.held = 0
        # Scope key -> its waiting commands, oldest first; the dict's order is the turn order.
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    def room(self) -> int:
        """How many more runs the worker may take now (a large number when it has no cap)."""
        return max(0, self.cap - self._running() - self.held) if self.cap else 1 << 30

    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def hold(self, places: int) -> None:
        self.held += places

    def give_back(self, places: int) -> None:
        if places:
            self.held -= places
            self.serve()

    def serve(self) -> None:
        """Hand the free places to the waiting commands, one scope at a time (a run left, a place came back)."""
        while self._waiting and self.room():
            key = next(iter(self._waiting))
            queue = self._waiting.pop(key)
            waiter = queue.popleft()
            if queue:
                self._waiting[key] = queue  # to the back of the turn
            if not waiter.done():
                self.held += 1
                waiter.set_result(None)

    @contextlib.asynccontextmanager
    async def place(self, key: str) -> AsyncIterator[None]:
        """Hold one place while the body runs; wait for one first, in the turn of ``key``'s scope."""
        if not self._waiting and self.room():
            self.held += 1
        else:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(key, deque()).append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self.give_back(1)  # granted as it was cancelled: the place goes to the next one
                else:
                    self._forget(key, waiter)
                raise
        try:
            yield
        finally:
            self.give_back(1)

    def _forget(self, key: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(key)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(waiter)
        if not queue:
            del self._waiting[key]
