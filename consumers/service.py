"""Consuming the six command queues, with the commands in flight bounded for the whole worker, and
stopping gracefully.

The queues and exchanges come declared (``intermission/wire.py``) on a robust channel, so aio-pika restores
the consumers after a reconnect. Prefetch is per consumer (RabbitMQ's quorum queues do not implement a
channel-wide prefetch), so six consumers could otherwise run six times the prefetch at once against a pool
of a few connections. ``in_flight_limit`` bounds the commands whose transactions run at once across all
six; deliveries beyond it wait in this process, unacknowledged, without holding a database connection.

The commands that answer a pause (resume, decide, expire) go through ``CommandBatches`` instead: those that
arrive together are applied in one transaction (group commit, ``consumers/batching.py``), each batch
holding one of the same slots.

A command that may start or resume a run (every one but a cancel) is first admitted by ``admit``, the
fleet's cap on runs in flight (``Fleet.admitting``): past the cap it waits here, unacknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from intermission.consumers.batching import CommandBatches
from intermission.consumers.handlers import BATCHED
from intermission.consumers.policy import AckPolicy
from intermission.wire import Command

log = logging.getLogger("intermission.consumers")

# The commands whose outcome may be a run to continue: all but a cancel, which only ends one.
RUN_CAUSING: frozenset[Command] = frozenset(Command) - {Command.CANCEL}


class CommandConsumers:
    def __init__(
        self,
        policy: AckPolicy,
        queues: Mapping[Command, AbstractQueue],
        *,
        in_flight_limit: int = 8,
        batch_size: int = 32,
        batches_in_flight: int = 2,
        admit: Callable[[str], AbstractAsyncContextManager[None]] | None = None,
    ) -> None:
        self.policy = policy
        self._admit = admit
        self.queues = dict(queues)
        self._slots = asyncio.Semaphore(in_flight_limit)
        # batch_size 1: every command alone, as before group commit.
        self.batches = (
            CommandBatches(policy.process_batch, max_size=batch_size, max_batches=batches_in_flight, slots=self._slots)
            if batch_size > 1
            else None
        )
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
                # Waiting past the cap is served a scope at a time, by the routing key (which names the
                # scope): it orders the waiting and authorises nothing.
                admitted = (
                    self._admit(message.routing_key or "")
                    if self._admit is not None and command in RUN_CAUSING
                    else None
                )
                async with admitted if admitted is not None else contextlib.nullcontext():
                    if self.batches is not None and command in BATCHED:
                        await self.batches.submit(message, command)
                    else:
                        async with self._slots:
                            await self.policy.process(message, command)
            finally:
                self.policy.acks.settled(message)
                self._in_flight.discard(task)
                if not self._in_flight:
                    self._idle.set()

        return on_message

    @property
    def consuming(self) -> bool:
        """Whether every queue has its consumer (from ``start`` until ``stop``). The robust channel restores
        them after a reconnect under the same tags, so this stays true across one; the connection's own
        state says whether deliveries can arrive meanwhile."""
        return bool(self.queues) and self._tags.keys() == self.queues.keys()

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
            if self.batches is not None:
                self.batches.cancel()
            for task in list(self._in_flight):
                task.cancel()
