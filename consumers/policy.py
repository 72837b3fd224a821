"""THE ack policy. Every command goes through ``AckPolicy.process``; there is no other.

1. Check the envelope (message_id, schema version) and the body; refusals here touch nothing.
2. Run the command's ONE transaction (inbox record, claim, lease, first progress, outbox event). Transient
   failures (a lost connection, a serialisation failure, a deadlock) are retried with backoff.
3. Acknowledge only after the commit. Then hand the claimed run to the fleet: from here the run's safety
   rests on its lease, not on the broker, so no delivery is held for the length of a run.

Outcomes other than success:
- the command's effect committed before (a redelivery, a re-send): acknowledge, no second effect, no
  rejection;
- a permanent error: publish ``command.rejected`` and a dead-lettered copy with the code in
  ``x-intermission-error`` (both confirmed), then acknowledge;
- a transient error that outlasted the retries, or a bug: return the message to its queue; the quorum
  queue's delivery limit dead-letters a message that keeps failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable

from aio_pika.abc import AbstractIncomingMessage
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from intermission.consumers.handlers import CommandHandlers, StaleExpiry
from intermission.consumers.parsing import Delivery, check_envelope
from intermission.consumers.rejection import Rejecter
from intermission.schemas.errors import PermanentError, TransientError
from intermission.store.commands import Claimed
from intermission.store.inbox import AlreadyApplied
from intermission.wire import Command

log = logging.getLogger("intermission.consumers")


def delivery_of(message: AbstractIncomingMessage, command: Command) -> Delivery:
    return Delivery(
        message_id=message.message_id,
        routing_key=message.routing_key or command.value,
        body=message.body,
        headers=dict(message.headers or {}),
        user_id=message.user_id,
        correlation_id=message.correlation_id,
    )


class AckPolicy:
    def __init__(
        self,
        handlers: CommandHandlers,
        rejecter: Rejecter,
        on_claimed: Callable[[Claimed], None],
        *,
        attempts: int = 5,
        after_commit: Callable[[], None] = lambda: None,
        observe: Callable[[Command, str, str], None] = lambda command, outcome, code: None,
    ) -> None:
        self.handlers = handlers
        self.rejecter = rejecter
        self.on_claimed = on_claimed
        self.attempts = attempts
        # Between the commit and the acknowledgement: the crash tests kill a worker here.
        self.after_commit = after_commit
        # (command, outcome, error code) of every delivery handled: the worker counts them for metrics.
        self.observe = observe

    async def _apply(self, command: Command, delivery: Delivery, message_id: str) -> Claimed | None:
        """The command's transaction, retried with backoff on transient errors. The first attempt runs
        without the retry machinery: it almost always succeeds, and building tenacity's state for every
        message costs more than the attempt's own Python work."""
        try:
            return await self.handlers.apply(command, delivery, message_id)
        except TransientError:
            if self.attempts <= 1:
                raise
        # The same back-off as one tenacity loop over every attempt: up to 0.05 s after the first failure,
        # then doubling (full jitter, capped at 2 s).
        await asyncio.sleep(random.uniform(0, 0.05))  # noqa: S311 - jitter, not cryptography
        claimed: Claimed | None = None
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            wait=wait_random_exponential(multiplier=0.1, max=2.0),
            stop=stop_after_attempt(self.attempts - 1),
            reraise=True,
        ):
            with attempt:
                claimed = await self.handlers.apply(command, delivery, message_id)
        return claimed

    async def process(self, message: AbstractIncomingMessage, command: Command) -> None:
        delivery = delivery_of(message, command)
        extra = {"message_id": delivery.message_id, "routing_key": delivery.routing_key}
        try:
            message_id = check_envelope(delivery)
            claimed = await self._apply(command, delivery, message_id)
        except AlreadyApplied:
            log.info("duplicate command; its effect committed before", extra={"action": "duplicate", **extra})
            await message.ack()
            self.observe(command, "duplicate", "")
            return
        except StaleExpiry as stale:
            log.info("stale expiry", extra={"action": "stale_expiry", "detail": str(stale), **extra})
            await message.ack()
            self.observe(command, "stale", "")
            return
        except PermanentError as exc:
            log.info(
                "command rejected",
                extra={"action": "command_rejected", "code": exc.code, "detail": exc.detail, **extra},
            )
            await self.rejecter.reject(delivery, exc)
            await message.ack()
            self.observe(command, "rejected", exc.code)
            return
        except TransientError as exc:
            log.warning("command failed transiently; requeued", extra={"action": "requeue", "error": exc.code, **extra})
            await message.nack(requeue=True)
            self.observe(command, "requeued", exc.code)
            return
        except Exception:
            log.exception("command handler crashed; requeued", extra={"action": "handler_error", **extra})
            await message.nack(requeue=True)
            self.observe(command, "requeued", "handler_error")
            return
        self.after_commit()
        # The effect is committed. If the acknowledgement is lost, the redelivery is a duplicate.
        with contextlib.suppress(Exception):
            await message.ack()
        self.observe(command, "applied", "")
        if claimed is not None:
            self.on_claimed(claimed)
