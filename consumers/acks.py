"""Acknowledgements of command deliveries, several at once where that acknowledges exactly them.

Group commit (``engine/committer.py``) commits the commands that arrive together in one statement and
hands each its outcome in the same turn of the event loop, so their acknowledgements are asked for
together too. ``Acknowledgements.ack`` gathers the ones asked for in one turn and sends them with ONE
``basic.ack`` (``multiple``) where that acknowledges nothing else, one by one otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Sequence

from aio_pika.abc import AbstractIncomingMessage


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
        # Acknowledgements asked for and not sent yet, and the task that sends them.
        self._asked: list[tuple[AbstractIncomingMessage, asyncio.Future[None]]] = []
        self._sending: asyncio.Task[None] | None = None

    async def ack(self, message: AbstractIncomingMessage) -> None:
        """Acknowledge ``message``, with every other acknowledgement asked for in the same turn of the event
        loop. An acknowledgement that is lost makes a duplicate, never a loss: errors are not raised."""
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._asked.append((message, sent))
        if self._sending is None or self._sending.done():
            self._sending = asyncio.create_task(self._send())
        await sent

    async def _send(self) -> None:
        while self._asked:
            taken, self._asked = self._asked, []
            try:
                # A lost acknowledgement makes a duplicate, never a loss.
                with contextlib.suppress(Exception):
                    await self.ack_all([message for message, _ in taken])
            finally:
                for _, sent in taken:
                    if not sent.done():
                        sent.set_result(None)

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
