"""Consuming the six command queues with bounded prefetch, and stopping gracefully.

The queues and exchanges come declared (``intermission/wire.py``) on a robust channel, so aio-pika restores
the consumers after a reconnect. Prefetch bounds how many commands are in flight at once; since no
delivery is held for the length of a run, a small prefetch is enough to keep the database busy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from intermission.consumers.policy import AckPolicy
from intermission.wire import Command

log = logging.getLogger("intermission.consumers")


class CommandConsumers:
    def __init__(self, policy: AckPolicy, queues: Mapping[Command, AbstractQueue]) -> None:
        self.policy = policy
        self.queues = dict(queues)
        self._tags: dict[Command, str] = {}
        self._in_flight: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        for command, queue in self.queues.items():
            self._tags[command] = await queue.consume(self._callback(command))
        log.info("consuming", extra={"action": "consumers_started", "queues": [q.name for q in self.queues.values()]})

    def _callback(self, command: Command) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
        async def on_message(message: AbstractIncomingMessage) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._in_flight.add(task)
            self._idle.clear()
            try:
                await self.policy.process(message, command)
            finally:
                self._in_flight.discard(task)
                if not self._in_flight:
                    self._idle.set()

        return on_message

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def stop(self, grace: float) -> None:
        """Stop consuming, then let in-flight commands finish their transactions within ``grace``."""
        for command, tag in list(self._tags.items()):
            try:
                await self.queues[command].cancel(tag)
            except Exception:  # the channel may already be gone; its deliveries return to the queue
                log.warning("could not cancel a consumer", extra={"action": "cancel_failed", "queue": command.queue})
        self._tags.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            for task in list(self._in_flight):
                task.cancel()
