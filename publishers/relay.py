"""The outbox relay: every outbox row reaches ``intermission.events`` at least once, always under its own
``message_id``.

A change and its event commit together (the outbox row); this relay publishes the row afterwards. Per
batch it locks up to ``batch_size`` unsent rows (``FOR UPDATE SKIP LOCKED``, so the relays of several
workers share the work and never publish the same row at the same time), publishes them concurrently on a
publisher-confirm channel, awaits all the confirms together, marks the confirmed rows sent and commits. A
row whose publication was refused, timed out or lost with the connection stays unsent and goes out again
later with the SAME ``message_id``; subscribers deduplicate on it. A crash between the confirm and the
commit does the same. Delivery is therefore at least once, never at most once.

A refusal and an outage are told apart (``publishers.amqp.refusal``). A REFUSAL is the broker saying no to
that very row: a nack of its publication (a subscriber queue at its length limit with reject-publish, a
quorum queue without a quorum), a return, or a channel it closed over it (over its max message size). It
is counted against the row in the batch's transaction (``attempts``, ``last_error``); the row waits before
it is claimed again (one second, doubled per refusal, at most the longest back-off) while the rest of the
batch and the batches behind it go out, and at its ``max_attempts``-th refusal it is QUARANTINED: set aside,
logged with its id, key and the broker's reason (never its body), and claimed no more until an operator
retries it (``intermission outbox retry``), under the same ``message_id``. An OUTAGE (the broker away, a
channel or connection lost, no confirm in time, the database away) counts against no row: it would fail
every row alike, and a broker restart must not quarantine the outbox. The relay backs off and retries.

Events are published WITHOUT ``mandatory``: ``intermission.events`` is a topic exchange that nobody may
be bound to (no host subscribed to that tenant yet), and an unroutable event is normal, not a failure.
With ``mandatory`` the broker would return such a message and the relay would retry it forever.

Every event is known whole before its transaction (``engine/events.py``), so it needs no relay at all: the
relay is the engine's ``EventSink`` (``engine/sink.py``), the committer HANDS each commit's events to it
(``committed``), and right after their commit it publishes them from memory, on the same confirm channel,
and marks their rows sent with one statement per batch of confirms.
Their rows are written with a hold (migration 0009): the relays leave them alone for ``hold_seconds``,
and publish them only if the hand-over did not get them confirmed and marked by then (the worker died
after the commit, the broker was away, a nack). A hand-over that fails is therefore never retried here:
the row is still the durable record, and the relays' next look after the hold does the rest, under the
same ``message_id``.

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
import uuid
from collections.abc import Sequence
from types import TracebackType

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from tenacity import RetryCallState

from intermission.engine.events import OutboxEvent
from intermission.publishers.amqp import (
    RETRYABLE,
    ConfirmingPublisher,
    Outgoing,
    PublishFailed,
    backoff,
    refusal,
    retrying,
)
from intermission.store.across_scopes import AcrossScopes, OutboxRow, RefusalPolicy, Refused
from intermission.store.db import Database
from intermission.store.notifications import OutboxListener
from intermission.wire import EVENTS_EXCHANGE, message, wire_problem

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


def handed_message(event: OutboxEvent) -> aio_pika.Message:
    """A handed-over event as published: exactly what its row holds, so that the relay's publication of the
    row (after a crash) is the same message."""
    return message(
        event.body,
        message_id=str(event.message_id),
        routing_key=event.routing_key,
        correlation_id=event.correlation_id,
        headers=event.headers,
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
        max_attempts: int = 5,
        refusal_wait_seconds: float = 1.0,
        name: str = "intermission-relay",
        hand_over_seconds: float | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        # A refused row waits longer after each refusal, but never longer than the relay backs off after
        # an outage: both are "try again soon", and neither may leave an event idle for long.
        self._refusals = RefusalPolicy(
            max_attempts=max_attempts,
            first_wait_seconds=refusal_wait_seconds,
            longest_wait_seconds=max(refusal_wait_seconds, max_backoff_seconds),
        )
        self._outbox = AcrossScopes(db)
        self._publisher = ConfirmingPublisher(connection, EVENTS_EXCHANGE, mandatory=False, timeout=publish_timeout)
        self._listen_dsn = listen_dsn
        self._batch_size = batch_size
        self._poll_seconds = poll_seconds
        self._publish_timeout = publish_timeout
        self._max_backoff = max_backoff_seconds
        self._name = name
        self._wake = asyncio.Event()
        self._batch_lock = asyncio.Lock()
        self._listener: OutboxListener | None = None
        self._serving = asyncio.Event()
        # When the earliest row this relay saw refused is due again (loop time), so that it does not wait
        # for the poll.
        self._retry_at: float | None = None
        # Counters for metrics and tests: rows this relay marked sent, attempts that failed (outages), broker
        # refusals it counted, and rows it quarantined.
        self.published = 0
        self.failures = 0
        self.refused = 0
        self.quarantined = 0
        # The outbox's quarantined rows, fleet-wide, as last counted (None before the first count): read at
        # most once per poll interval, and after every quarantine.
        self.quarantined_rows: int | None = None
        self._counted_at: float | None = None
        # Handed-over events waiting to be published, and confirmed ones waiting to be marked sent; one task
        # each at a time, taking everything that waits (so under load each publishes and marks in batches).
        self._handed: list[OutboxEvent] = []
        self._confirmed: list[uuid.UUID] = []
        self._publishing: asyncio.Task[None] | None = None
        self._marking: asyncio.Task[None] | None = None
        # Handed-over events published and marked sent by this relay, and those left for the relays.
        self.handed = 0
        self.handed_failed = 0
        # How long the rows of events handed over wait for this relay (None: none are handed over; the rows
        # of this process's commits are due at once, and this relay only wakes for them).
        self._hand_over_seconds = hand_over_seconds if hand_over_seconds else None

    # --- the engine's event sink ------------------------------------------------------------------------

    @property
    def hold_seconds(self) -> float | None:
        return self._hand_over_seconds

    def committed(self, events: Sequence[OutboxEvent]) -> None:
        """The events a commit of this process wrote: published from memory when they are handed over, or
        looked for at once otherwise (this process's sessions NOTIFY nobody: ``store/db.py``)."""
        if self._hand_over_seconds is None:
            self.wake()
        else:
            self.hand_over(list(events))

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

    def hand_over(self, events: list[OutboxEvent]) -> None:
        """Publish ``events``, whose rows just committed under a hold, from memory (see the module
        docstring). Returns at once."""
        self._handed.extend(events)
        if self._publishing is None or self._publishing.done():
            self._publishing = asyncio.create_task(self._publish_handed())

    async def _publish_handed(self) -> None:
        while self._handed:
            taken, self._handed = self._handed, []
            try:
                outcomes = await self._publisher.publish_all(
                    [Outgoing(handed_message(e), e.routing_key) for e in taken]
                )
            except Exception as exc:  # the broker away: the relays publish these rows once their hold ends
                outcomes = [exc] * len(taken)
            failed = sum(1 for outcome in outcomes if outcome is not None)
            if failed:
                self.handed_failed += failed
                log.info(
                    "handed-over events not confirmed; left to the relays",
                    extra={"action": "handover_unconfirmed", "relay": self._name, "events": failed},
                )
            self._confirmed.extend(e.message_id for e, outcome in zip(taken, outcomes, strict=True) if outcome is None)
            if self._confirmed and (self._marking is None or self._marking.done()):
                self._marking = asyncio.create_task(self._mark_handed())

    async def _mark_handed(self) -> None:
        while self._confirmed:
            taken, self._confirmed = self._confirmed, []
            try:
                await self._outbox.mark_handed_sent(taken)
            except Exception as exc:  # the database away: the relays publish them again, same message_id
                log.info(
                    "could not mark handed-over events sent; the relays will publish them again",
                    extra={"action": "handover_unmarked", "relay": self._name, "error": type(exc).__name__},
                )
                continue
            self.handed += len(taken)
            self.published += len(taken)

    async def handed_settled(self) -> None:
        """Return once every event handed over so far is published and marked (or left to the relays)."""
        while True:
            pending = [t for t in (self._publishing, self._marking) if t is not None and not t.done()]
            if not pending:
                return
            await asyncio.gather(*pending, return_exceptions=True)

    async def run_once(self, stop: asyncio.Event | None = None) -> int:
        """Publish every row unsent and due right now, batch after batch, until a batch comes back short
        (or ``stop`` is set). Returns the number of rows marked sent. A row the broker refused is not an
        error: its refusal is counted (and the row quarantined at its last attempt) and the batches go on.
        Raises PublishFailed when a row was lost to an outage (the confirmed and refused rows of that batch
        are recorded first) and the broker's or database's error when it could not get that far."""
        total = 0
        while stop is None or not stop.is_set():
            claimed, sent = await self._relay_batch()
            total += sent
            if claimed < self._batch_size:
                break
        return total

    async def _relay_batch(self) -> tuple[int, int]:
        # One batch at a time per relay: a caller of run_once (a drain) beside serve waits for the batch in
        # flight to commit, instead of skipping its locked rows and finding the outbox "empty" meanwhile.
        async with self._batch_lock:
            return await self._relay_batch_now()

    async def _relay_batch_now(self) -> tuple[int, int]:
        # Wait for the channel BEFORE taking row locks: a transaction must never stay open across a
        # reconnect. The wait is bounded so that a broker that is away surfaces as a retryable error.
        async with asyncio.timeout(self._publish_timeout):
            await self._publisher.ready()
        async with self._outbox.claim_outbox(self._batch_size) as batch:
            if not batch.rows:
                return 0, 0
            messages = [outbox_message(r) for r in batch.rows]
            # A row no client could send (a foreign writer's key over 255 bytes, headers past a frame) is
            # refused here, as the broker would refuse it: it must not fail the whole batch every time.
            unsendable = {
                row.id: f"cannot be put on the wire: {problem}"
                for row, m in zip(batch.rows, messages, strict=True)
                if (problem := wire_problem(m, row.routing_key)) is not None
            }
            sending = [(row, m) for row, m in zip(batch.rows, messages, strict=True) if row.id not in unsendable]
            outcomes = await self._publisher.publish_all([Outgoing(m, row.routing_key) for row, m in sending])
            confirmed = [row.id for (row, _), outcome in zip(sending, outcomes, strict=True) if outcome is None]
            reasons = unsendable | {
                row.id: reason
                for (row, _), outcome in zip(sending, outcomes, strict=True)
                if (reason := refusal(outcome)) is not None
            }
            await batch.mark_sent(confirmed)
            # In the claiming transaction: a refusal is counted exactly when the batch commits, once.
            refused = await batch.mark_refused(reasons, self._refusals)
        self.published += len(confirmed)
        self._note_refusals(refused)
        # Whatever is neither confirmed nor refused failed by an outage: back off and retry, counting nothing.
        failed = [outcome for outcome in outcomes if outcome is not None and refusal(outcome) is None]
        log.debug(
            "outbox batch published",
            extra={
                "action": "relay_batch",
                "claimed": len(batch.rows),
                "sent": len(confirmed),
                "refused": len(refused),
            },
        )
        if failed:
            raise PublishFailed(f"{len(failed)} of {len(batch.rows)} outbox rows were not confirmed") from failed[0]
        return len(batch.rows), len(confirmed)

    def _note_refusals(self, refused: list[Refused]) -> None:
        now = asyncio.get_running_loop().time()
        for row in refused:
            self.refused += 1
            facts = {
                "relay": self._name,
                "outbox_id": row.id,
                "message_id": row.message_id,
                "routing_key": row.routing_key,
                "attempts": row.attempts,
                "reason": row.reason,
            }
            if row.quarantined:
                self.quarantined += 1
                # The count is stale now; the next drain reads it again.
                self._counted_at = None
                log.warning(
                    "outbox row quarantined: the broker refused it every time",
                    extra={"action": "outbox_quarantined", **facts},
                )
            else:
                log.info("outbox row refused by the broker", extra={"action": "outbox_refused", **facts})
                if row.retry_in is not None:
                    due = now + max(0.0, row.retry_in)
                    self._retry_at = due if self._retry_at is None else min(self._retry_at, due)

    async def _count_quarantined(self) -> None:
        """Read the quarantined rows' count when the last reading is a poll interval old or stale."""
        now = asyncio.get_running_loop().time()
        if self._counted_at is not None and now - self._counted_at < self._poll_seconds:
            return
        self.quarantined_rows = await self._outbox.count_quarantined_outbox()
        self._counted_at = now

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
                    await self._count_quarantined()
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
        """Wait for a notification, the poll interval, a refused row's next attempt, or stop, whichever
        comes first."""
        loop = asyncio.get_running_loop()
        timeout = self._poll_seconds
        if self._retry_at is not None:
            timeout = max(0.0, min(timeout, self._retry_at - loop.time()))
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._wake.wait())]
        watched: list[asyncio.Task[object]] = [*waits]
        if listener is not None and listener.task is not None:
            watched.append(listener.task)
        try:
            await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if self._retry_at is not None and self._retry_at <= loop.time():
            # Due: the drain that follows claims it (a later refusal sets the next one).
            self._retry_at = None
        if listener is not None and listener.task is not None and listener.task.done():
            # The listener only ends by a bug; say so loudly rather than degrade to polling unnoticed.
            error = listener.task.exception() if not listener.task.cancelled() else None
            raise RuntimeError(f"the outbox listener of {self._name} ended") from error

    async def close(self) -> None:
        # What is still being handed over finishes first (bounded): a row left unmarked is only published
        # again later, but one publication fewer is one duplicate fewer.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._publish_timeout):
                await self.handed_settled()
        for task in (self._publishing, self._marking):
            if task is not None and not task.done():
                task.cancel()
        await self._publisher.close()
