"""Consuming the six command queues, and stopping gracefully.

The queues and exchanges come declared (``intermission/wire.py``) on a robust channel, so aio-pika restores
the consumers after a reconnect. Each delivery goes through the ack policy on its own; the commands that
arrive together still share their statements, because every transition goes through the engine's one
group-commit scheduler (``engine/committer.py``), which also bounds the statements in flight at once
(``INTERMISSION_COMMANDS_IN_FLIGHT``): deliveries beyond it wait in this process, unacknowledged, without
holding a database connection.

A command that may start or resume a run (every one but a cancel) is first admitted by ``places``, the
fleet's cap on runs in flight (``Fleet.admission``): past the cap it waits here, unacknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from intermission.consumers.policy import AckPolicy
from intermission.wire import Command

log = logging.getLogger("intermission.consumers")

# The commands whose outcome may be a run to continue: all but a cancel, which only ends one.
RUN_CAUSING: frozenset[Command] = frozenset(Command) - {Command.CANCEL}


class Places(Protocol):
    """The fleet's places for runs: a command that may start or resume one holds a place while applied."""

    def place(self, key: str) -> AbstractAsyncContextManager[None]: ...


class CommandConsumers:
    def __init__(
        self, policy: AckPolicy, queues: Mapping[Command, AbstractQueue], *, places: Places | None = None
    ) -> None:
        self.policy = policy
        self._places = places
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
                # Waiting past the cap is served a scope at a time, by the routing key (which names the
                # scope): it orders the waiting and authorises nothing.
                admitted = (
                    self._places.place(message.routing_key or "")
                    if self._places is not None and command in RUN_CAUSING
                    else None
                )
                async with admitted if admitted is not None else contextlib.nullcontext():
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
            for task in list(self._in_flight):
                task.cancel()
