"""What every publisher shares: the connection and confirmed publishing. The messages themselves are
built by ``intermission.wire``, the contract's one module.

Publishing always waits for the broker's publisher confirm. A batch is published concurrently on one
channel and its confirms are awaited together: waiting for each confirm before sending the next message
would cost a network round trip per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import aio_pika
import aiormq
from aio_pika.abc import AbstractExchange, AbstractRobustChannel, AbstractRobustConnection
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential
from yarl import URL

from intermission.schemas.errors import TransientError

log = logging.getLogger("intermission.publishers")

# Errors a later attempt may cure: the connection or channel went away, the broker refused or did not
# confirm in time. Named one by one (aio-pika's CONNECTION_EXCEPTIONS also holds RuntimeError, which would
# dress programming errors up as network blips); ChannelInvalidStateError is the "publish on a closed
# channel" error, which aiormq derives from RuntimeError.
TRANSIENT_AMQP_ERRORS: Final[tuple[type[BaseException], ...]] = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    TimeoutError,
)


class PublishFailed(TransientError):
    """The broker did not confirm every message; the unconfirmed ones may be published again."""

    code = "publish_failed"


# What a background publisher retries: the broker (connection, channel, confirms) or the database being
# away. TransientError covers PublishFailed and the store's StoreUnavailable.
RETRYABLE: Final[tuple[type[BaseException], ...]] = (*TRANSIENT_AMQP_ERRORS, TransientError)


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds`` or until ``stop`` is set, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


def retrying(
    stop: asyncio.Event, *, max_backoff: float, before_sleep: Callable[[RetryCallState], None]
) -> AsyncRetrying:
    """Retry RETRYABLE errors with jittered exponential back-off until they stop or ``stop`` is set; the
    back-off sleep ends early on ``stop``, so a stop never waits one out. Anything else is a bug and
    propagates at once. When ``stop`` ends the retries, the last error is re-raised."""

    async def sleep(seconds: float) -> None:
        await wait_or_stop(stop, seconds)

    return AsyncRetrying(
        retry=retry_if_exception_type(RETRYABLE),
        # Full jitter, so relays and sweepers that failed together do not retry in step.
        wait=wait_random_exponential(multiplier=0.1, max=max_backoff),
        stop=lambda _state: stop.is_set(),
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )


def backoff(state: RetryCallState) -> dict[str, object]:
    """What a log line says of a retry that backs off: the attempt, its error, the wait before the next."""
    error = state.outcome.exception() if state.outcome is not None else None
    return {"attempt": state.attempt_number, "error": repr(error), "next_seconds": state.upcoming_sleep}


def safe_url(url: str) -> str:
    """The URL without its password, for logs."""
    parsed = URL(url)
    return str(parsed.with_password("***")) if parsed.password else str(parsed)


async def connect(url: str, name: str, *, reconnect_interval: float = 5.0) -> AbstractRobustConnection:
    """A robust connection named ``name`` (shown in the management UI and ``rabbitmqctl list_connections``).

    It reconnects by itself after the broker restarts and reopens its channels; publications that failed
    meanwhile are the caller's to retry.
    """
    log.info("connecting", extra={"action": "amqp_connect", "url": safe_url(url), "connection_name": name})
    return await aio_pika.connect_robust(
        url, client_properties={"connection_name": name}, reconnect_interval=reconnect_interval
    )


@dataclass(frozen=True)
class Outgoing:
    """One message and where it goes."""

    message: aio_pika.Message
    routing_key: str


class ConfirmingPublisher:
    """One publisher-confirm channel on ``connection``, publishing to the exchange ``exchange_name``.

    ``mandatory`` decides what an unroutable message is: with it the broker returns the message and the
    publication fails (commands: a command no queue takes is an error, not a silent loss); without it the
    broker drops it and confirms (events: nobody need be subscribed).

    The channel is robust: after a reconnect it is reopened, and ``ready`` waits for that.
    """

    def __init__(
        self,
        connection: AbstractRobustConnection,
        exchange_name: str,
        *,
        mandatory: bool,
        timeout: float = 10.0,
    ) -> None:
        self._connection = connection
        self._exchange_name = exchange_name
        self._mandatory = mandatory
        self._timeout = timeout
        self._channel: AbstractRobustChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._lock = asyncio.Lock()

    async def _open(self) -> AbstractExchange:
        async with self._lock:
            if self._exchange is None:
                try:
                    channel = self._connection.channel(publisher_confirms=True, on_return_raises=True)
                except RuntimeError as exc:
                    # aio-pika's "Connection was not opened": the robust connection is reconnecting. A
                    # passing state, to retry like any other lost connection (not a bug to crash on).
                    raise ConnectionError(f"no connection to RabbitMQ to open a channel on ({exc})") from exc
                await channel
                # The topology (fleet.topology.declare) owns the exchange: a publisher only names it, so
                # it can never declare it with arguments that differ from the declared ones.
                self._exchange = await channel.get_exchange(self._exchange_name, ensure=False)
                self._channel = channel
            return self._exchange

    async def ready(self) -> None:
        """Wait until the channel is open (and, after a broker restart, reopened)."""
        await self._open()
        assert self._channel is not None
        await self._channel.ready()

    async def publish_all(self, outgoing: Sequence[Outgoing]) -> list[BaseException | None]:
        """Publish every message concurrently and wait for all their confirms together, bounded by the
        publisher's timeout. Element i is None when message i was confirmed, else why it was not."""
        if not outgoing:
            return []
        exchange = await self._open()
        tasks = [
            asyncio.ensure_future(exchange.publish(o.message, o.routing_key, mandatory=self._mandatory))
            for o in outgoing
        ]
        try:
            # One deadline for the whole batch rather than one per message: a broker that stops answering
            # costs one timeout, not one per row.
            _, pending = await asyncio.wait(tasks, timeout=self._timeout)
        finally:
            # Also on our own cancellation: no publication outlives the call that asked for it.
            unfinished = [task for task in tasks if not task.done()]
            for task in unfinished:
                task.cancel()
            if unfinished:
                await asyncio.gather(*unfinished, return_exceptions=True)
        outcomes: list[BaseException | None] = []
        for task in tasks:
            if task in pending:
                outcomes.append(TimeoutError("no publisher confirm in time"))
            elif task.cancelled():
                # Not by us (our own cancellation never gets here): the channel or connection went away
                # under the publication, which aiormq reports by cancelling its confirm future.
                outcomes.append(
                    aiormq.exceptions.ChannelInvalidStateError("publication cancelled by a closing channel")
                )
            else:
                outcomes.append(task.exception())
        for outcome in outcomes:
            if outcome is not None and not isinstance(outcome, TRANSIENT_AMQP_ERRORS):
                # Anything else is a bug (a bad argument, say): let it out rather than retry it forever.
                raise outcome
        return outcomes

    async def publish(self, message: aio_pika.Message, routing_key: str) -> None:
        """Publish one message and wait for its confirm; PublishFailed (cause chained) if it is not."""
        (outcome,) = await self.publish_all([Outgoing(message, routing_key)])
        if outcome is not None:
            raise PublishFailed(f"{routing_key} {message.message_id} was not confirmed: {outcome!r}") from outcome

    async def close(self) -> None:
        async with self._lock:
            channel, self._channel, self._exchange = self._channel, None, None
        if channel is not None and not channel.is_closed:
            await channel.close()
