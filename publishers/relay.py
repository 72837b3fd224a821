"""The outbox relay: every outbox row reaches ``intermission.events`` at least once, always under its own
``message_id``.

A change and its event commit together (the outbox row); this relay publishes the row afterwards. Per
batch it locks up to ``batch_size`` unsent rows (``FOR UPDATE SKIP LOCKED``, so the relays of several
workers share the work and never publish the same row at the same time), publishes them concurrently on a
publisher-confirm channel, awaits all the confirms together, marks the confirmed rows sent and commits. A
row whose publication was nacked, timed out or lost with the connection stays unsent and goes out again
later with the SAME ``message_id``; subscribers deduplicate on it. A crash between the confirm and the
commit does the same. Delivery is therefore at least once, never at most once.

Events are published WITHOUT ``mandatory``: ``intermission.events`` is a topic exchange that nobody may
be bound to (no host subscribed to that tenant yet), and an unroutable event is normal, not a failure.
With ``mandatory`` the broker would return such a message and the relay would retry it forever.

The relay wakes on ``LISTEN intermission_outbox`` (the ``outbox_notify`` trigger fires once per inserting
transaction) and also polls every ``poll_seconds``, so a lost notification delays an event but never
strands it. Publication failures (broker down, channel closed, no confirm in time, database gone) back off
with tenacity and retry; the rows stay unsent meanwhile.

Usage::

    connection = await publishers.amqp.connect(amqp_url, "intermission-relay@host")
    async with OutboxRelay(db, connection, listen_dsn=database_url) as relay:
        await relay.serve(stop)  # until stop is set
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from tenacity import RetryCallState

from intermission.publishers.amqp import RETRYABLE, ConfirmingPublisher, Outgoing, PublishFailed, backoff, retrying
from intermission.store.across_scopes import AcrossScopes, OutboxRow
from intermission.store.db import Database
from intermission.store.notifications import OutboxListener
from intermission.wire import EVENTS_EXCHANGE, message

log = logging.getLogger("intermission.relay")


def outbox_message(row: OutboxRow) -> aio_pika.Message:
    """The row as published: its stored id, key, body, correlation id and headers (schema version,
    traceparent), unchanged, so a re-publication is the same message."""
    return message(
        row.body,
        message_id=row.message_id,
        routing_key=row.routing_key,
        correlation_id=row.correlation_id,
        headers=row.headers,
    )


class OutboxRelay:
    """Publishes the outbox to ``intermission.events``; see the module docstring for the guarantees.

    ``connection`` belongs to the caller (the relay opens and closes only its own channel).
    ``listen_dsn`` enables LISTEN/NOTIFY wake-ups on a connection of the relay's own; without it the relay
    only polls.
    """

    def __init__(
        self,
        db: Database,
        connection: AbstractRobustConnection,
        *,
        listen_dsn: str | None = None,
        batch_size: int = 256,
        poll_seconds: float = 5.0,
        publish_timeout: float = 10.0,
        max_backoff_seconds: float = 10.0,
        name: str = "intermission-relay",
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self._outbox = AcrossScopes(db)
        self._publisher = ConfirmingPublisher(connection, EVENTS_EXCHANGE, mandatory=False, timeout=publish_timeout)
        self._listen_dsn = listen_dsn
        self._batch_size = batch_size
        self._poll_seconds = poll_seconds
        self._publish_timeout = publish_timeout
        self._max_backoff = max_backoff_seconds
        self._name = name
        self._wake = asyncio.Event()
        self._listener: OutboxListener | None = None
        self._serving = asyncio.Event()
        # Counters for metrics and tests: rows this relay marked sent, and attempts that failed.
        self.published = 0
        self.failures = 0

    async def __aenter__(self) -> OutboxRelay:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def listens(self) -> int:
        """How many times the LISTEN connection was (re)established; 0 when not listening."""
        return self._listener.listens if self._listener is not None else 0

    async def wait_listening(self, count: int = 1) -> None:
        """Wait until the relay's LISTEN has succeeded ``count`` times (1, plus one per re-listen after a
        lost connection). Only meaningful while ``serve`` runs with a ``listen_dsn``."""
        await self._serving.wait()
        if self._listener is None:
            raise RuntimeError(f"{self._name} serves without a listen_dsn: it only polls")
        await self._listener.wait_listening(count)

    def wake(self) -> None:
        """Look at the outbox now rather than at the next poll."""
        self._wake.set()

    async def run_once(self, stop: asyncio.Event | None = None) -> int:
        """Publish every row unsent right now, batch after batch, until a batch comes back short (or
        ``stop`` is set). Returns the number of rows marked sent. Raises PublishFailed when a row was not
        confirmed (the confirmed rows of that batch are marked sent first) and the broker's or database's
        error when it could not get that far."""
        total = 0
        while stop is None or not stop.is_set():
            claimed, sent = await self._relay_batch()
            total += sent
            if claimed < self._batch_size:
                break
        return total

    async def _relay_batch(self) -> tuple[int, int]:
        # Wait for the channel BEFORE taking row locks: a transaction must never stay open across a
        # reconnect. The wait is bounded so that a broker that is away surfaces as a retryable error.
        async with asyncio.timeout(self._publish_timeout):
            await self._publisher.ready()
        async with self._outbox.claim_outbox(self._batch_size) as batch:
            if not batch.rows:
                return 0, 0
            outcomes = await self._publisher.publish_all(
                [Outgoing(outbox_message(r), r.routing_key) for r in batch.rows]
            )
            confirmed = [row.id for row, outcome in zip(batch.rows, outcomes, strict=True) if outcome is None]
            await batch.mark_sent(confirmed)
        self.published += len(confirmed)
        failed = [outcome for outcome in outcomes if outcome is not None]
        log.debug(
            "outbox batch published",
            extra={"action": "relay_batch", "claimed": len(batch.rows), "sent": len(confirmed)},
        )
        if failed:
            raise PublishFailed(f"{len(failed)} of {len(batch.rows)} outbox rows were not confirmed") from failed[0]
        return len(batch.rows), len(confirmed)

    async def serve(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set. A stop lets the batch in flight finish (publish, confirm, commit)
        and interrupts a back-off or an idle wait at once. Cancelling instead is safe too: the batch's
        transaction rolls back and its rows go out again later under the same ids."""
        log.info("relay started", extra={"action": "relay_started", "relay": self._name})
        listener = (
            OutboxListener(self._listen_dsn, self._wake.set, application_name=self._name)
            if self._listen_dsn is not None
            else None
        )
        self._listener = listener
        self._serving.set()
        try:
            async with listener if listener is not None else contextlib.nullcontext():
                while not stop.is_set():
                    # Cleared BEFORE the drain: a notification that lands during it triggers another pass.
                    self._wake.clear()
                    await self._drain(stop)
                    await self._idle(stop, listener)
        finally:
            log.info(
                "relay stopped", extra={"action": "relay_stopped", "relay": self._name, "published": self.published}
            )

    async def _drain(self, stop: asyncio.Event) -> None:
        try:
            async for attempt in retrying(stop, max_backoff=self._max_backoff, before_sleep=self._failed):
                with attempt:
                    await self.run_once(stop)
        except RETRYABLE:
            # Only reached once stop is set (tenacity gives up on nothing else); the rows stay unsent for
            # the next relay.
            if not stop.is_set():
                raise

    def _failed(self, state: RetryCallState) -> None:
        self.failures += 1
        log.warning(
            "relay could not publish; backing off",
            extra={"action": "relay_retry", "relay": self._name, **backoff(state)},
        )

    async def _idle(self, stop: asyncio.Event, listener: OutboxListener | None) -> None:
        """Wait for a notification, the poll interval, or stop, whichever comes first."""
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._wake.wait())]
        watched: list[asyncio.Task[object]] = [*waits]
        if listener is not None and listener.task is not None:
            watched.append(listener.task)
        try:
            await asyncio.wait(watched, timeout=self._poll_seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if listener is not None and listener.task is not None and listener.task.done():
            # The listener only ends by a bug; say so loudly rather than degrade to polling unnoticed.
            error = listener.task.exception() if not listener.task.cancelled() else None
            raise RuntimeError(f"the outbox listener of {self._name} ended") from error

    async def close(self) -> None:
        await self._publisher.close()
