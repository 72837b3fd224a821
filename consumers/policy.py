"""THE ack policy. Every command goes through ``AckPolicy.process``; there is no other.

1. Check the envelope (message_id, schema version) and the body's size and depth; refusals here touch
   nothing and read nothing but the raw bytes.
2. Run the command's ONE transaction (inbox record, claim, lease, first progress, outbox event).
3. Acknowledge only after the commit. Then hand the claimed run to the fleet: from here the run's safety
   rests on its lease, not on the broker, so no delivery is held for the length of a run.

Outcomes other than success:
- the command's effect committed before (a redelivery, a re-send): acknowledge, no second effect, no
  rejection;
- a permanent error: publish ``command.rejected`` and a dead-lettered copy with the code in
  ``x-intermission-error`` (both confirmed), then acknowledge; a broker that will not take them (restarting,
  nacking) is retried like an outage, and a refusal it never takes returns the command to its queue;
- a transient error (the database away: a restart, a failover, a lost connection; a serialisation failure
  or deadlock): the delivery is HELD and the transaction retried with capped backoff for up to
  ``retry_seconds`` (three minutes by default: longer than a managed database's failover). Meanwhile this
  worker starts no other command (``Availability``): each would only fail the same way and spend a
  delivery. Only a failure that outlasts the window returns the message to its queue. Counting outages as
  deliveries would let the quorum queue's delivery limit dead-letter every command that arrived during
  one, which is exactly what a 30-second failover must not do;
- a bug in a handler: return the message to its queue; the delivery limit dead-letters a message that
  keeps failing, with the broker's ``x-death`` reason;
- anything at all going wrong while settling (building the refusal itself, say): reject the delivery
  without requeue, so the queue's dead-letter exchange keeps it with its ``x-death`` reason. A delivery is
  ALWAYS settled: one left unsettled holds a prefetch slot for good, and a handful of them stop the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import ChannelInvalidStateError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    stop_any,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from intermission import points
from intermission.consumers.acks import Acknowledgements
from intermission.consumers.command_spans import command_span, note_claimed
from intermission.consumers.handlers import CommandHandlers
from intermission.consumers.parsing import MAX_REPLY_BODY_BYTES, Delivery, check_body_limits, check_envelope
from intermission.consumers.rejection import Rejecter
from intermission.engine.commands import Claimed, StaleExpiry
from intermission.engine.observer import CRASH_POINTS, Observer
from intermission.engine.transition import Applicable
from intermission.publishers.amqp import TRANSIENT_AMQP_ERRORS, backoff
from intermission.schemas.errors import PermanentError, StoreContention, TransientError
from intermission.store.inbox import AlreadyApplied
from intermission.wire import Command

log = logging.getLogger("intermission.consumers")

# The default body limit of every command but run.reply (whose limit follows from its 8 MiB input).
DEFAULT_MAX_COMMAND_BYTES = 1024 * 1024


def delivery_of(message: AbstractIncomingMessage, command: Command) -> Delivery:
    return Delivery(
        message_id=message.message_id,
        routing_key=message.routing_key or command.value,
        body=message.body,
        headers=dict(message.headers or {}),
        user_id=message.user_id,
        correlation_id=message.correlation_id,
    )


@dataclass(frozen=True)
class CommandLimits:
    """What a command's body may be, checked before it is parsed."""

    max_command_bytes: int = DEFAULT_MAX_COMMAND_BYTES

    def body_bytes(self, command: Command) -> int:
        return MAX_REPLY_BODY_BYTES if command is Command.REPLY else self.max_command_bytes


class Availability:
    """Whether this worker's commands may start, or should wait for the database to answer again.

    A command whose transaction failed because the database is away becomes a PROBE: it holds its delivery
    and retries (``AckPolicy._apply``). While any probe is out, commands not yet started wait (up to the
    retry window) before their first attempt: an outage then costs one failing transaction per probe and
    backoff, not one per delivery the broker keeps handing over. The wait ends as soon as the database
    answers a probe (with a commit or with a refusal: either way it is back), or when the last probe
    gives up; a flag that only a commit cleared could keep commands waiting long after the outage.
    """

    def __init__(self) -> None:
        self._probes = 0
        self._clear = asyncio.Event()
        self._clear.set()

    @property
    def is_clear(self) -> bool:
        return self._clear.is_set()

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        self._probes += 1
        self._clear.clear()
        try:
            yield
        finally:
            self._probes -= 1
            if self._probes == 0:
                self._clear.set()

    def answered(self) -> None:
        """The database answered a probe: every waiting command may go."""
        self._clear.set()

    async def wait_clear(self, within: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._clear.wait(), within)


class ChannelGone(stop_base):
    """Stop retrying once the delivery's channel has closed: the broker returned it to its queue."""

    def __init__(self, message: AbstractIncomingMessage) -> None:
        self.message = message

    def __call__(self, retry_state: RetryCallState) -> bool:
        try:
            return self.message.channel.is_closed
        except ChannelInvalidStateError:
            return True


class ClaimedRuns(Protocol):
    """Where a run a command claimed for this worker goes to run (the fleet)."""

    def submit(self, claimed: Claimed) -> object: ...


class AckPolicy:
    def __init__(
        self,
        handlers: CommandHandlers,
        rejecter: Rejecter,
        runs: ClaimedRuns,
        *,
        retry_seconds: float = 180.0,
        max_backoff_seconds: float = 5.0,
        limits: CommandLimits | None = None,
        observer: Observer = CRASH_POINTS,
        acks: Acknowledgements | None = None,
    ) -> None:
        self.handlers = handlers
        self.rejecter = rejecter
        self.runs = runs
        self.retry_seconds = retry_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.limits = limits or CommandLimits()
        self.availability = Availability()
        # Sees every delivery's outcome (metrics count it; the command's span records it) and the crash
        # point between a commit and its acknowledgement, where the crash tests kill a worker.
        self.observer = observer
        # Acknowledgements requested together go as one frame where they can (group commit resolves a
        # batch's commands at once).
        self.acks = acks or Acknowledgements()

    def observe(self, command: Command, outcome: str, code: str) -> None:
        self.observer.settled(command.value, outcome, code)

    async def _apply(self, command: Command, operation: Applicable[Claimed | None], message_id: str) -> Claimed | None:
        """The command's transaction, retried with backoff on transient errors until ``retry_seconds`` have
        passed. The first attempt runs without the retry machinery: it almost always succeeds, and building
        tenacity's state for every message costs more than the attempt's own Python work."""
        if not self.availability.is_clear:
            await self.availability.wait_clear(self.retry_seconds)
        try:
            return await self.handlers.apply(command, operation)
        except TransientError as exc:
            if self.retry_seconds <= 0:
                raise
            # Losing to another transaction says nothing of the database being away.
            away = not isinstance(exc, StoreContention)
        with self.availability.probing() if away else contextlib.nullcontext():
            await asyncio.sleep(random.uniform(0, 0.05))  # noqa: S311 - jitter, not cryptography
            claimed: Claimed | None = None
            try:
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception_type(TransientError),
                    # Full jitter, doubling from 0.1 s, capped: a database that is back is noticed within the cap.
                    wait=wait_random_exponential(multiplier=0.1, max=self.max_backoff_seconds),
                    stop=stop_after_delay(self.retry_seconds),
                    before_sleep=lambda state: self._waiting(state, message_id),
                    reraise=True,
                ):
                    with attempt:
                        claimed = await self.handlers.apply(command, operation)
            except TransientError:
                raise
            except BaseException:
                self.availability.answered()  # a refusal is an answer: the database is back
                raise
            self.availability.answered()
            return claimed

    @staticmethod
    def _waiting(state: RetryCallState, message_id: str) -> None:
        if state.attempt_number in (1, 10) or state.attempt_number % 50 == 0:
            failure = state.outcome.exception() if state.outcome is not None else None
            log.warning(
                "the database is unavailable; holding the command and retrying",
                extra={
                    "action": "command_held",
                    "message_id": message_id,
                    "attempt": state.attempt_number,
                    "held_seconds": round(state.seconds_since_start or 0.0, 1),
                    "error": getattr(failure, "code", type(failure).__name__),
                },
            )

    async def _refuse(self, message: AbstractIncomingMessage, delivery: Delivery, error: PermanentError) -> None:
        """Publish the refusal. The broker not taking it (restarting; ``intermission.dead`` without a quorum
        for a moment, which nacks) is retried with backoff, as an outage is: the refused command must end
        up with its code in the dead-letter queue, not be dead-lettered by the broker without one. The
        retries end early once the delivery's channel is gone (the broker has returned it to its queue)."""

        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(TRANSIENT_AMQP_ERRORS),
            wait=wait_random_exponential(multiplier=0.1, max=self.max_backoff_seconds),
            stop=stop_any(stop_after_delay(self.retry_seconds), ChannelGone(message)),
            before_sleep=lambda state: log.warning(
                "the broker did not take a refusal; retrying",
                extra={"action": "refusal_retry", "message_id": delivery.message_id, **backoff(state)},
            ),
            reraise=True,
        ):
            with attempt:
                await self.rejecter.reject(delivery, error)

    async def process(self, message: AbstractIncomingMessage, command: Command) -> None:
        """Settle ``message``, whatever it holds (see the module docstring), in the command's span."""
        with command_span(message, command):
            await self._process(message, command)

    async def _process(self, message: AbstractIncomingMessage, command: Command) -> None:
        try:
            await self._settle(message, command)
        except Exception:
            # Building or publishing the refusal failed, or reading the delivery did: never leave it
            # unsettled. The broker dead-letters it with reason "rejected". (A delivery that was settled
            # before the failure refuses a second settlement locally, without a word to the broker.)
            log.exception(
                "could not settle a command; rejected to the dead-letter exchange",
                extra={"action": "dead_lettered", "message_id": message.message_id, "queue": command.queue},
            )
            with contextlib.suppress(Exception):
                await message.reject(requeue=False)
            self.observe(command, "dead_lettered", "unsettled")

    async def _settle(self, message: AbstractIncomingMessage, command: Command) -> None:
        delivery = delivery_of(message, command)
        _note_redelivery(message, delivery)
        try:
            message_id = check_envelope(delivery)
            check_body_limits(delivery.body, self.limits.body_bytes(command))
            # Parsed once: the body, its scope against its key, its receipt.
            operation = self.handlers.operation(command, delivery, message_id)
            claimed = await self._apply(command, operation, message_id)
        except Exception as failed:
            await self._settle_failed(message, command, delivery, failed)
            return
        self.observer.reached(points.AFTER_COMMIT)
        # The effect is committed. If the acknowledgement is lost, the redelivery is a duplicate.
        with contextlib.suppress(Exception):
            await self.acks.ack(message)
        self.observe(command, "applied", "")
        if claimed is not None:
            note_claimed(claimed)
            self.runs.submit(claimed)

    async def _settle_failed(
        self, message: AbstractIncomingMessage, command: Command, delivery: Delivery, failed: Exception
    ) -> None:
        """Settle a command whose transition did not commit, by why (see the module docstring)."""
        extra = {"message_id": delivery.message_id, "routing_key": delivery.routing_key}
        if isinstance(failed, AlreadyApplied):
            log.info("duplicate command; its effect committed before", extra={"action": "duplicate", **extra})
            await message.ack()
            self.observe(command, "duplicate", "")
        elif isinstance(failed, StaleExpiry):
            log.info("stale expiry", extra={"action": "stale_expiry", "detail": str(failed), **extra})
            await message.ack()
            self.observe(command, "stale", "")
        elif isinstance(failed, PermanentError):
            await self._settle_refused(message, command, delivery, failed, extra)
        elif isinstance(failed, TransientError):
            log.warning(
                "command failed transiently for the whole retry window; requeued",
                extra={"action": "requeue", "error": failed.code, **extra},
            )
            await message.nack(requeue=True)
            self.observe(command, "requeued", failed.code)
        else:
            log.error("command handler crashed; requeued", exc_info=failed, extra={"action": "handler_error", **extra})
            await message.nack(requeue=True)
            self.observe(command, "requeued", "handler_error")

    async def _settle_refused(
        self,
        message: AbstractIncomingMessage,
        command: Command,
        delivery: Delivery,
        error: PermanentError,
        extra: dict[str, str | None],
    ) -> None:
        log.info(
            "command rejected",
            extra={"action": "command_rejected", "code": error.code, "detail": error.detail, **extra},
        )
        self.observer.reached(points.REFUSING)
        try:
            await self._refuse(message, delivery, error)
        except TRANSIENT_AMQP_ERRORS as away:
            # The broker would not take the refusal for the whole window: return the command to its queue
            # to be refused later (if its channel is gone, the broker has already).
            log.warning(
                "could not publish a refusal; requeued",
                extra={"action": "refusal_requeued", "error": type(away).__name__, **extra},
            )
            await message.nack(requeue=True)
            self.observe(command, "requeued", "refusal_unpublished")
            return
        await message.ack()
        self.observe(command, "rejected", error.code)


def _note_redelivery(message: AbstractIncomingMessage, delivery: Delivery) -> None:
    if message.redelivered:
        # Delivered before and never acknowledged: its consumer died, its channel or node was lost, or it
        # was requeued. Rare when all is well, so worth a line: after a node loss, these say how many
        # commands it cost (the inbox makes each one harmless).
        log.info(
            "command delivered again",
            extra={
                "action": "redelivered",
                "delivery_count": (message.headers or {}).get("x-delivery-count"),
                "message_id": delivery.message_id,
                "routing_key": delivery.routing_key,
            },
        )
