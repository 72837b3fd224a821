"""Group commit: the commands that arrive together are applied together.

A worker under load holds many deliveries at once (the prefetch of six consumers). Applied one by one,
each costs a read, a claim, a commit (with its WAL flush) and an acknowledgement. ``CommandBatches`` lets
the BATCHED commands (those that answer a pause: resume, decide, expire) that are waiting when a batch
starts go through ONE read and ONE claim statement, committed once, and acknowledged with one
``basic.ack`` (``multiple``) where that acknowledges nothing else (``Acknowledgements``).

Nothing waits for a batch to fill. A batch starts as soon as a command arrives and fewer than
``max_batches`` batches are running; the commands that arrive while those run wait for the next one. So
one command alone goes straight through (no latency is added when there is nothing to batch), and under
load the batches grow by themselves, up to ``max_size``: the busier the database, the more each commit
carries.

Every guarantee of a single command holds per command (``AckPolicy.process_batch``): each outcome (claimed,
refused, duplicate, stale) is decided on its own, a refused command writes nothing, and a batch that fails
as a whole is applied again one command at a time, so one bad command never fails the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence

from aio_pika.abc import AbstractIncomingMessage

from intermission.wire import Command

log = logging.getLogger("intermission.consumers")

Batch = Sequence[tuple[AbstractIncomingMessage, Command]]


class _ChannelTags:
    """The delivery tags of one channel that are settled, as a watermark (every tag up to it) and the
    settled tags above it. A channel numbers its deliveries 1, 2, 3, ...; a reopened channel is a new one."""

    __slots__ = ("settled_above", "watermark")

    def __init__(self) -> None:
        self.watermark = 0
        self.settled_above: set[int] = set()

    def settle(self, tag: int) -> None:
        if tag <= self.watermark:
            return
        self.settled_above.add(tag)
        while self.watermark + 1 in self.settled_above:
            self.watermark += 1
            self.settled_above.discard(self.watermark)


class Acknowledgements:
    """Acknowledges deliveries, several at once with ONE ``basic.ack`` (``multiple=True``) where that is
    exactly them.

    ``multiple`` acknowledges every unacknowledged delivery of the channel up to a tag, so it is used only
    up to a tag T below which every delivery is either one of those being acknowledged or settled already
    (acknowledged, rejected or returned by this worker, as ``settled`` records). A delivery that is still
    being worked on, or that arrived and was not yet seen, stops the run there; those above it are
    acknowledged one by one. Nothing else is ever acknowledged by accident, whatever order deliveries
    reach their callbacks in.
    """

    def __init__(self) -> None:
        self._channels: weakref.WeakKeyDictionary[object, _ChannelTags] = weakref.WeakKeyDictionary()
        # Deliveries acknowledged by another's ``multiple``: aio-pika does not know them as processed.
        self._acked: weakref.WeakSet[AbstractIncomingMessage] = weakref.WeakSet()
        # ``basic.ack`` frames sent, and deliveries they acknowledged (for tests and metrics).
        self.frames = 0
        self.acknowledged = 0

    def _tags(self, message: AbstractIncomingMessage) -> _ChannelTags | None:
        try:
            channel = message.channel
        except Exception:  # its channel is closed: the broker has returned the delivery to its queue
            return None
        tags = self._channels.get(channel)
        if tags is None:
            tags = self._channels[channel] = _ChannelTags()
        return tags

    def settled(self, message: AbstractIncomingMessage) -> None:
        """``message`` is settled (its callback is done with it)."""
        tags = self._tags(message)
        if tags is not None and message.delivery_tag is not None:
            tags.settle(message.delivery_tag)

    def is_acked(self, message: AbstractIncomingMessage) -> bool:
        return message.processed or message in self._acked

    async def ack_all(self, messages: Sequence[AbstractIncomingMessage]) -> None:
        by_channel: dict[int, tuple[_ChannelTags | None, list[AbstractIncomingMessage]]] = {}
        for message in messages:
            tags = self._tags(message)
            by_channel.setdefault(id(tags), (tags, []))[1].append(message)
        for tags, group in by_channel.values():
            await self._ack_group(tags, sorted(group, key=lambda m: m.delivery_tag or 0))

    async def _ack_group(self, tags: _ChannelTags | None, group: list[AbstractIncomingMessage]) -> None:
        covered = 0  # how many of group (in tag order) one multiple ack takes
        if tags is not None:
            expected = tags.watermark + 1
            for message in group:
                while expected in tags.settled_above:
                    expected += 1
                if message.delivery_tag != expected:
                    break
                covered += 1
                expected += 1
        if covered >= 2:
            last = group[covered - 1]
            await last.ack(multiple=True)
            self.frames += 1
            self.acknowledged += covered
            for message in group[: covered - 1]:
                self._acked.add(message)
        else:
            covered = 0
        for message in group[covered:]:
            with contextlib.suppress(Exception):  # a lost acknowledgement makes a duplicate, never a loss
                await message.ack()
                self.frames += 1
                self.acknowledged += 1


class CommandBatches:
    """Collects deliveries of BATCHED commands and hands them to ``apply_batch`` in batches (see the module
    docstring). ``submit`` returns once its delivery is settled."""

    def __init__(
        self,
        apply_batch: Callable[[Batch], Awaitable[None]],
        *,
        max_size: int = 32,
        max_batches: int = 2,
        slots: asyncio.Semaphore | None = None,
    ) -> None:
        if max_size < 1 or max_batches < 1:
            raise ValueError("a batch holds at least one command, and at least one batch may run")
        self._apply_batch = apply_batch
        self._max_size = max_size
        self._max_batches = max_batches
        self._slots = slots
        self._waiting: list[tuple[AbstractIncomingMessage, Command, asyncio.Future[None]]] = []
        self._running: set[asyncio.Task[None]] = set()
        # Sizes of the batches applied (for tests and metrics).
        self.sizes: list[int] = []

    async def submit(self, message: AbstractIncomingMessage, command: Command) -> None:
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((message, command, settled))
        self._start()
        # Shielded: a cancelled callback (a stop past its grace) must not cancel a batch other
        # deliveries share; ``cancel`` ends the batches themselves.
        await asyncio.shield(settled)

    def _start(self) -> None:
        if self._waiting and len(self._running) < self._max_batches:
            self._running.add(asyncio.create_task(self._run()))

    async def _run(self) -> None:
        # The batch takes its commands when it first runs, not when it was started: the deliveries that
        # reached their callbacks in the same turn of the event loop (a prefetch's worth, after a burst) go
        # together. Another batch may have taken them all by then.
        taken, self._waiting = self._waiting[: self._max_size], self._waiting[self._max_size :]
        try:
            if not taken:
                return
            async with self._slots if self._slots is not None else contextlib.nullcontext():
                self.sizes.append(len(taken))
                await self._apply_batch([(message, command) for message, command, _ in taken])
        except Exception:
            # apply_batch settles every delivery itself; this is a bug, and the deliveries stay with the
            # broker (returned to their queue when the channel closes).
            log.exception("a batch of commands failed", extra={"action": "batch_crashed", "size": len(taken)})
        finally:
            for _, _, settled in taken:
                if not settled.done():
                    settled.set_result(None)
            task = asyncio.current_task()
            if task is not None:
                self._running.discard(task)
            self._start()

    @property
    def in_flight(self) -> int:
        """Batches running now."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Deliveries waiting for the next batch."""
        return len(self._waiting)

    def cancel(self) -> None:
        """End the running batches (a stop past its grace): their transactions roll back, and their
        deliveries return to their queues with the channel."""
        for task in list(self._running):
            task.cancel()
        for _, _, settled in self._waiting:
            if not settled.done():
                settled.cancel()
        self._waiting.clear()
