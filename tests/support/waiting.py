"""Waiting for something another connection or process does, bounded by a timeout.

The condition waited on is a database state written by another session (often another process), and
PostgreSQL has no notification for an arbitrary predicate, so this polls it; the timeout bounds the wait
and a condition that never comes true fails the test. It never stands in for synchronisation this process
could do itself with an asyncio.Event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

POLL_SECONDS = 0.02


async def eventually(check: Callable[[], Awaitable[bool]], *, within: float = 10.0, what: str = "condition") -> None:
    try:
        async with asyncio.timeout(within):
            while not await check():  # noqa: ASYNC110 - the event lives in another session's writes
                await asyncio.sleep(POLL_SECONDS)
    except TimeoutError:
        raise AssertionError(f"{what} did not hold within {within} s") from None
