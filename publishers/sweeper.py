"""The expiry sweeper (``intermission sweeper``): one ``run.expire`` command per expired pause.

Every ``interval_seconds`` it reads the database clock once, then walks the expired pauses of paused runs
across every scope in bounded pages (keyset pagination on ``(expires_at, id)``, ``batch`` rows a page),
publishing a ``run.expire`` for each with publisher confirms. A backlog of any size is worked through page
by page in one sweep, never by re-reading the same first page. The sweeper only lists and publishes; the
expire consumer claims each pause under the row's own scope and the stored deadline.

Any number of sweepers may run at once because every command is DETERMINISTIC: ``message_id`` is
``expire:<run_id>:<suspension_id>`` and ``expired_by`` is the pause's own ``expires_at`` (already passed
by the database clock), so two sweepers that find the same pause publish byte-identical messages and the
consumer's inbox keeps one. A pause this process already published is remembered (bounded, oldest
forgotten first) and not published again on every sweep; it is published again only after
``republish_after_seconds``, in case its command was lost to a dead-letter or a purge while the run stayed
paused. With ``max_rate`` it publishes at most that many commands per second, as ONE burst a second (the
second's pages back to back, then a wait), so that a large backlog is worked through without taking the
CPU the workers' claims need. One burst rather than many small ones because on a machine the broker and
the database share, each wake-up of the broker costs the claims beside it more than the messages do:
``python -m bench.interference`` measured a commit loop's p99 at 1.14 / 1.97 ms beside 50 / 500
messages a second sent in 50 bursts, and 0.77 / 0.91 ms sent in one (0.76 ms beside nothing).

Commands are published with ``mandatory``: a command no queue takes is an error to retry, not a silent
loss. Publish failures back off (tenacity) and the sweep starts over; nothing is remembered until its
confirm arrives.

Usage::

    connection = await publishers.amqp.connect(amqp_url, "intermission-sweeper@host")
    sweeper = ExpirySweeper(db, connection, interval_seconds=60, batch=100)
    try:
        await sweeper.serve(stop)
    finally:
        await sweeper.close()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from datetime import datetime

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from opentelemetry.trace import SpanKind
from tenacity import RetryCallState

from intermission.publishers.amqp import (
    RETRYABLE,
    ConfirmingPublisher,
    Outgoing,
    PublishFailed,
    backoff,
    retrying,
    wait_or_stop,
)
from intermission.schemas.commands import ExpireCommand
from intermission.store.across_scopes import AcrossScopes, ExpiredPause, PauseKey
from intermission.store.db import Database
from intermission.tracing import open_span
from intermission.wire import COMMANDS_EXCHANGE, Command, command_message

log = logging.getLogger("intermission.sweeper")


class _Pacer:
    """At most ``rate`` commands a second, in one burst: what a second allows goes out at once, then the
    sweeper waits for the rest of that second."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._began: float | None = None
        self._sent = 0

    def allowance(self) -> int:
        """How many commands may go now (at least one)."""
        return max(1, int(self._rate) - self._sent)

    async def spent(self, count: int, stop: asyncio.Event | None) -> None:
        now = time.monotonic()
        if self._began is None:
            self._began = now
        self._sent += count
        if self._sent < int(self._rate):
            return
        rest = self._sent / self._rate - (now - self._began)
        self._began, self._sent = None, 0
        if rest > 0:
            if stop is None:
                await asyncio.sleep(rest)
            else:
                await wait_or_stop(stop, rest)


def expire_message_id(pause: ExpiredPause) -> str:
    """The same id for the same pause from every sweeper, on every sweep."""
    # Unique within the pause's scope, which is all the inbox asks (it keys message ids by scope): a pause
    # id comes from one sequence for every scope, and the command is published under the pause's scope.
    return f"expire:{pause.run_id}:{pause.suspension_id}"


def expire_command(pause: ExpiredPause) -> ExpireCommand:
    # expired_by is the stored deadline, not the sweep's clock reading: equal for every sweeper, and
    # already passed by the database clock, so the consumer's claim by it succeeds.
    return ExpireCommand(scope=pause.scope, version=pause.version, expired_by=pause.expires_at)


def expire_message(pause: ExpiredPause) -> aio_pika.Message:
    # No traceparent: every sweeper publishes the identical message for a pause, headers included. The
    # worker processes it in a trace of its own, linked to the pause it expires.
    return command_message(Command.EXPIRE, expire_command(pause), message_id=expire_message_id(pause))


class _Recent:
    """Pauses published by this process, oldest first, at most ``limit`` of them."""

    def __init__(self, limit: int, ttl: float) -> None:
        self._limit = limit
        self._ttl = ttl
        self._at: OrderedDict[PauseKey, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def holds(self, key: PauseKey, now: float) -> bool:
        at = self._at.get(key)
        return at is not None and now - at < self._ttl

    def add(self, key: PauseKey, now: float) -> None:
        self._at[key] = now
        self._at.move_to_end(key)
        while len(self._at) > self._limit:
            self._at.popitem(last=False)


class ExpirySweeper:
    """Publishes ``run.expire`` for expired pauses; see the module docstring.

    ``connection`` belongs to the caller; the sweeper opens and closes only its own channel. The topology
    (``fleet.topology.declare``) must exist: the sweeper never declares it.
    """

    def __init__(
        self,
        db: Database,
        connection: AbstractRobustConnection,
        *,
        interval_seconds: float = 60.0,
        batch: int = 100,
        republish_after_seconds: float = 3600.0,
        max_remembered: int = 100_000,
        max_rate: float | None = None,
        publish_timeout: float = 10.0,
        max_backoff_seconds: float = 10.0,
        name: str = "intermission-sweeper",
    ) -> None:
        if batch < 1:
            raise ValueError("batch must be at least 1")
        if max_rate is not None and not max_rate > 0:
            raise ValueError("max_rate must be a positive number of commands per second")
        self._store = AcrossScopes(db)
        self._publisher = ConfirmingPublisher(connection, COMMANDS_EXCHANGE, mandatory=True, timeout=publish_timeout)
        self._interval = interval_seconds
        self._batch = batch
        # At most this many run.expire commands per second (None: as fast as the broker confirms). A backlog
        # worked through at full speed takes CPU from the claims of every worker on the same machines.
        self._max_rate = max_rate
        self._recent = _Recent(max_remembered, republish_after_seconds)
        self._publish_timeout = publish_timeout
        self._max_backoff = max_backoff_seconds
        self._name = name
        # Counters for metrics and tests.
        self.published = 0
        self.failures = 0
        self.sweeps = 0

    @property
    def remembered(self) -> int:
        return len(self._recent)

    async def sweep_once(self, stop: asyncio.Event | None = None) -> int:
        """One sweep: every pause expired by the database clock now, page by page. Returns how many
        ``run.expire`` commands were confirmed. Raises PublishFailed when one was not (those confirmed
        before it are remembered), or the broker's or database's error."""
        cutoff = await self._store.database_now()
        pacer = _Pacer(self._max_rate) if self._max_rate is not None else None
        after: tuple[datetime, int] | None = None
        published = 0
        pages = 0
        while stop is None or not stop.is_set():
            page = await self._store.list_expired_paused(cutoff, after, self._batch)
            pages += 1
            published += await self._publish(page, pacer, stop)
            if len(page) < self._batch:
                break
            after = page[-1].cursor
        self.sweeps += 1
        log.info(
            "sweep done",
            extra={"action": "sweep", "sweeper": self._name, "published": published, "pages": pages},
        )
        return published

    async def _publish(
        self, page: list[ExpiredPause], pacer: _Pacer | None = None, stop: asyncio.Event | None = None
    ) -> int:
        now = time.monotonic()
        due = [p for p in page if not self._recent.holds(p.key, now)]
        if not due:
            return 0
        async with asyncio.timeout(self._publish_timeout):
            await self._publisher.ready()
        confirmed = 0
        while due:
            take = len(due) if pacer is None else pacer.allowance()
            burst, due = due[:take], due[take:]
            with open_span(
                "run.expire publish",
                kind=SpanKind.PRODUCER,
                attributes={"messaging.system": "rabbitmq", "messaging.batch.message_count": len(burst)},
            ):
                outcomes = await self._publisher.publish_all(
                    [Outgoing(expire_message(p), Command.EXPIRE.key(p.scope)) for p in burst]
                )
            sent = 0
            for pause, outcome in zip(burst, outcomes, strict=True):
                if outcome is None:
                    self._recent.add(pause.key, now)
                    sent += 1
            confirmed += sent
            self.published += sent
            failed = [outcome for outcome in outcomes if outcome is not None]
            if failed:
                raise PublishFailed(
                    f"{len(failed)} of {len(burst)} run.expire commands were not confirmed"
                ) from failed[0]
            if pacer is not None:
                await pacer.spent(sent, stop)
        return confirmed

    async def serve(self, stop: asyncio.Event) -> None:
        """Sweep every ``interval_seconds`` until ``stop`` is set. A failed sweep backs off and starts
        over; a stop ends a back-off or the wait between sweeps at once."""
        log.info("sweeper started", extra={"action": "sweeper_started", "sweeper": self._name})
        try:
            while not stop.is_set():
                try:
                    async for attempt in retrying(stop, max_backoff=self._max_backoff, before_sleep=self._failed):
                        with attempt:
                            await self.sweep_once(stop)
                except RETRYABLE:
                    if not stop.is_set():
                        raise
                await wait_or_stop(stop, self._interval)
        finally:
            log.info(
                "sweeper stopped",
                extra={"action": "sweeper_stopped", "sweeper": self._name, "published": self.published},
            )

    def _failed(self, state: RetryCallState) -> None:
        self.failures += 1
        log.warning(
            "sweep failed; backing off", extra={"action": "sweep_retry", "sweeper": self._name, **backoff(state)}
        )

    async def close(self) -> None:
        await self._publisher.close()
