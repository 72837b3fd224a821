"""What every publisher shares: the connection and confirmed publishing. The messages themselves are
built by ``intermission.wire``, the contract's one module.

Publishing always waits for the broker's publisher confirm. A batch is published concurrently on one
channel and its confirms are awaited together: waiting for each confirm before sending the next message
would cost a network round trip per message.

A message that was not confirmed was either REFUSED by the broker, which said so about that very message
(``refusal`` tells), or lost to an outage (the connection or channel went away, no confirm in time), which
says nothing about the message: the outbox relay counts only the former against a row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

import aio_pika
import aiormq
from aio_pika.abc import AbstractExchange, AbstractRobustChannel, AbstractRobustConnection, ConnectionParameter
from aiormq.channel import EXCEPTION_MAPPING
from pamqp.commands import Basic
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential
from yarl import URL

from intermission import amqp_headers
from intermission.schemas.errors import TransientError

log = logging.getLogger("intermission.publishers")

# Every connection of the product is made here: from now on, this process decodes header tables within
# bounds, so that no message's headers can take a connection down (intermission/amqp_headers.py).
amqp_headers.install()

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


# The channel-closing codes that mean "this publication is refused": 406 PRECONDITION_FAILED (the message is
# over the broker's max_message_size, or names a user_id that is not the connection's own) and 506
# RESOURCE_ERROR. Not 403 ACCESS_REFUSED or 404 NOT_FOUND: a missing permission or exchange refuses every
# message alike and says nothing about any one of them.
REFUSING_CHANNEL_CODES: Final = frozenset({406, 506})
_CHANNEL_CODES: Final = {error: code for code, error in EXCEPTION_MAPPING.items()}


def _channel_closed(error: BaseException) -> tuple[int | None, str] | None:
    """The code and text of the Channel.Close behind ``error``, or None when it is something else."""
    if not isinstance(error, aiormq.exceptions.ChannelClosed):
        return None
    code = _CHANNEL_CODES.get(type(error))
    if code is not None:
        # aiormq raises a mapped code's class with the reply text alone.
        return code, str(error.args[0]) if error.args else ""
    # Any other code: ChannelClosed(reply_code, reply_text).
    raw_code, text = (*error.args, None, None)[:2]
    return (raw_code if isinstance(raw_code, int) else None), str(text or "")


def _closed_by_refusal(error: BaseException | None) -> bool:
    closed = _channel_closed(error) if error is not None else None
    return closed is not None and closed[0] in REFUSING_CHANNEL_CODES


def refusal(outcome: BaseException | None) -> str | None:
    """The broker's reason when ``outcome`` (an element of ``publish_all``'s result) is the broker refusing
    that very message; None when the message was confirmed, or failed for a reason that is not its own (the
    connection or channel lost, no confirm in time, a missing exchange or permission)."""
    if outcome is None:
        return None
    if isinstance(outcome, aiormq.exceptions.PublishError):
        returned = outcome.frame
        assert isinstance(returned, Basic.Return)
        return f"returned by the broker (basic.return): {returned.reply_code} {returned.reply_text}"
    if isinstance(outcome, aiormq.exceptions.DeliveryError) and isinstance(outcome.frame, Basic.Nack):
        # A nack carries no reason; these are the ones RabbitMQ has.
        return (
            "nacked by the broker (basic.nack): a queue it routes to refused it (at its length limit with "
            "x-overflow reject-publish, or a quorum queue without a quorum)"
        )
    closed = _channel_closed(outcome)
    if closed is not None and closed[0] in REFUSING_CHANNEL_CODES:
        return f"the broker closed the channel over it: {closed[1]}"
    return None


def _fails_with_its_channel(outcome: BaseException | None) -> bool:
    """Whether ``outcome`` is a publication that failed because its channel closed: it may have been
    another message's doing (the broker closes the channel over one publication and every other one in
    flight on it fails with the same error)."""
    return isinstance(outcome, aiormq.exceptions.ChannelClosed | aiormq.exceptions.ChannelInvalidStateError)


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


class AmqpUrlError(ValueError):
    """An AMQP URL (or list of nodes) that cannot be connected to as written."""


def _split(url: str) -> tuple[str, str, str, str, str]:
    """(scheme, userinfo, "@" or "", hosts, the rest from the path on) of an AMQP URL or node list."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("amqp", "amqps"):
        raise AmqpUrlError(f"an AMQP URL starts with amqp:// or amqps://, not {safe_url(url)!r}")
    # The authority ends at the first "/", "?" or "#" after the credentials; the credentials end at the
    # LAST "@" of the authority (a password may not hold a raw "/", but yarl and RFC 3986 agree on this).
    end = len(rest)
    for mark in "/?#":
        found = rest.find(mark)
        if found != -1:
            end = min(end, found)
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hosts = authority.rpartition("@")
    return scheme, userinfo, at, hosts, tail


def with_credentials(url: str, user: str, password: str) -> str:
    """``url`` (one node or a list) logging in as ``user``: the same nodes, vhost and query."""
    amqp_nodes(url)  # refuses what is not an AMQP URL or node list
    scheme, _, _, hosts, tail = _split(url)
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{hosts}{tail}"


def with_vhost(url: str, vhost: str) -> str:
    """``url`` (one node or a list) on ``vhost``: the same nodes, credentials and query."""
    amqp_nodes(url)
    scheme, userinfo, at, hosts, tail = _split(url)
    query = tail[tail.index("?") :] if "?" in tail else ""
    return f"{scheme}://{userinfo}{at}{hosts}/{quote(vhost, safe='')}{query}"


def amqp_nodes(url: str) -> list[URL]:
    """The broker nodes of ``url``: one URL per node, in the order listed.

    ``amqp://user:pw@h1:5672,h2:5673,h3/vhost?params`` lists three nodes of one cluster: they share the
    credentials, the vhost and the query (a cluster has one user database and one set of vhosts), so only
    host and port are per node. A node without a port gets the scheme's default. A single URL is one node,
    parsed by yarl exactly as before.
    """
    scheme, userinfo, at, hosts, tail = _split(url)
    prefix = f"{scheme}://{userinfo}{at}"
    default_port = 5671 if scheme == "amqps" else 5672
    nodes: list[URL] = []
    for part in hosts.split(","):
        part = part.strip()
        # A bracketed IPv6 address without a port ends with "]": its colons are not a port's.
        has_port = ":" in part and not part.endswith("]")
        host, colon, port_text = part.rpartition(":") if has_port else (part, "", "")
        if not host:
            raise AmqpUrlError(f"empty host in the AMQP node list of {safe_url(url)!r}")
        if colon and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise AmqpUrlError(f"bad port {port_text!r} for host {host!r} in {safe_url(url)!r}")
        port = int(port_text) if colon else default_port
        try:
            node = URL(f"{prefix}{host}:{port}{tail}")
        except ValueError as exc:
            raise AmqpUrlError(f"cannot parse node {host!r} of {safe_url(url)!r}: {exc}") from exc
        if node.host is None:
            raise AmqpUrlError(f"no host in node {part!r} of {safe_url(url)!r}")
        nodes.append(node)
    return nodes


def safe_url(url: str | URL) -> str:
    """The URL without its password, for logs (a node list too: its one password is masked)."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    userinfo, at, after = rest.partition("@")
    if not sep or not at or "/" in userinfo or ":" not in userinfo:
        return text
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{after}"


def process_offset() -> int:
    """Where this process starts in the node list: by pid, so the processes of one machine (consecutive
    pids, usually) spread over the nodes rather than all landing on the first one."""
    return os.getpid()


class NodeTransportFactory(aiormq.TransportFactory):
    """Opens the TCP (or TLS) transport to the first node that accepts, trying them in turn starting after
    the node the last connect used, each within ``connect_timeout``.

    aiormq calls ``create`` on every connect and reconnect of the robust connection: a worker whose node
    died moves to the next one on its next reconnect instead of knocking on the dead node until it returns.
    Only the transport is per node; the AMQP handshake follows on whichever node accepted. A node that
    accepts TCP but fails the handshake (a half-dead broker, a proxy with no backend) fails that attempt,
    and the next attempt starts after it.
    """

    def __init__(self, nodes: list[URL], *, connect_timeout: float, offset: int = 0) -> None:
        if not nodes:
            raise AmqpUrlError("no AMQP node to connect to")
        self.nodes = nodes
        self.connect_timeout = connect_timeout
        # The index of the node last tried successfully; the next connect starts after it.
        self._last = (offset - 1) % len(nodes)
        self.current: URL | None = None

    def order(self) -> list[URL]:
        """The nodes in the order the next connect tries them."""
        start = (self._last + 1) % len(self.nodes)
        return self.nodes[start:] + self.nodes[:start]

    async def create(self, url: URL, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        provider = kwargs.pop("ssl_context_provider", None)
        errors: list[str] = []
        start = (self._last + 1) % len(self.nodes)
        for step in range(len(self.nodes)):
            index = (start + step) % len(self.nodes)
            node = self.nodes[index]
            ssl = await provider.get_context() if node.scheme == "amqps" and provider is not None else None
            try:
                # Per node, so that a node whose packets vanish (no RST) costs this long, not the whole
                # connect's budget: the next node gets its own.
                async with asyncio.timeout(self.connect_timeout):
                    pair = await asyncio.open_connection(host=node.host, port=node.port, ssl=ssl, **kwargs)
            except (OSError, TimeoutError) as exc:
                errors.append(f"{node.host}:{node.port}: {exc!r}")
                log.warning(
                    "amqp node unreachable",
                    extra={"action": "amqp_node_unreachable", "node": safe_url(node), "error": repr(exc)},
                )
                continue
            # Advanced before the handshake: if it then fails, the next attempt starts at the next node.
            self._last = index
            self.current = node
            return pair
        raise aiormq.exceptions.AMQPConnectionError("no AMQP node accepted a connection: " + "; ".join(errors))


def _identity(value: Any) -> Any:
    return value


class NodesConnection(aio_pika.RobustConnection):
    """A robust connection over a list of nodes (``NodeTransportFactory``), which logs the node it is on
    (``amqp_connected``) and when a reconnect lands on another one (``amqp_moved``)."""

    # aio-pika hands the underlying aiormq connection only the keyword arguments its connection class
    # declares: declaring transport_factory is what lets it through to aiormq on every (re)connect.
    PARAMETERS: tuple[ConnectionParameter, ...] = (
        *aio_pika.RobustConnection.PARAMETERS,
        ConnectionParameter(name="transport_factory", parser=_identity, is_kwarg=True),
    )

    def __init__(self, url: URL, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
        super().__init__(url, loop=loop, **kwargs)
        factory = self.kwargs.get("transport_factory")
        if not isinstance(factory, NodeTransportFactory):
            raise TypeError("NodesConnection needs a NodeTransportFactory as transport_factory")
        self.factory = factory
        self._on_node: URL | None = None

    def forget_password(self) -> None:
        """Drop the password from everything this connection keeps to reconnect with. It can then never
        reconnect: what a connection opened with a person's own password should do once it is open (the
        console ends the person's session when it is lost, and they log in again)."""
        self.url = self.url.with_password(None)
        self.factory.nodes = [node.with_password(None) for node in self.factory.nodes]
        if self.factory.current is not None:
            self.factory.current = self.factory.current.with_password(None)
        transport = self.transport
        if transport is not None:
            transport.connection.url = transport.connection.url.with_password(None)

    @property
    def node_url(self) -> URL:
        """The URL of the node this connection is on (the first node before it ever connected)."""
        return self.factory.current or self.factory.nodes[0]

    async def _on_connected(self) -> None:
        await super()._on_connected()
        node = self.factory.current
        name = self.kwargs.get("client_properties", {}).get("connection_name")
        if self._on_node is not None and node != self._on_node:
            log.warning(
                "amqp connection moved to another node",
                extra={
                    "action": "amqp_moved",
                    "connection_name": name,
                    "from_node": safe_url(self._on_node),
                    "node": safe_url(node or ""),
                },
            )
        log.info(
            "amqp connected",
            extra={"action": "amqp_connected", "connection_name": name, "node": safe_url(node or "")},
        )
        self._on_node = node


async def connect(
    url: str,
    name: str,
    *,
    reconnect_interval: float = 5.0,
    connect_timeout: float = 5.0,
    offset: int | None = None,
) -> NodesConnection:
    """A robust connection named ``name`` (shown in the management UI and ``rabbitmqctl list_connections``).

    ``url`` is one broker or a comma-separated list of nodes of one cluster (``amqp_nodes``). Every connect
    and reconnect tries the nodes in turn, starting after the one used last, each within
    ``connect_timeout``; the first connect starts at ``offset`` (by default this process's, so processes
    spread over the nodes). After a failed attempt it waits ``reconnect_interval`` seconds.

    It reconnects by itself after the broker restarts and reopens its channels; publications that failed
    meanwhile are the caller's to retry.
    """
    nodes = amqp_nodes(url)
    factory = NodeTransportFactory(
        nodes, connect_timeout=connect_timeout, offset=process_offset() if offset is None else offset
    )
    log.info(
        "connecting",
        extra={
            "action": "amqp_connect",
            "url": safe_url(url),
            "nodes": len(nodes),
            "first_node": safe_url(factory.order()[0]),
            "connection_name": name,
        },
    )
    # One whole attempt is bounded: every node's transport, then the handshake on the one that accepted.
    attempt_timeout = connect_timeout * (len(nodes) + 1)
    # The first connect fails fast (aio-pika's fail_fast), so a node that accepts TCP but fails the
    # handshake would fail the start: try again, at the next node, once per node.
    for attempt in range(len(nodes)):
        # Built here rather than by aio_pika.connect_robust, which also copies every keyword argument into
        # the URL's query string, where a factory object cannot go.
        connection = NodesConnection(
            nodes[0],
            client_properties={"connection_name": name},
            reconnect_interval=reconnect_interval,
            transport_factory=factory,
        )
        try:
            await connection.connect(timeout=attempt_timeout)
        except TRANSIENT_AMQP_ERRORS:
            await connection.close()
            if attempt == len(nodes) - 1:
                raise
            continue
        return connection
    raise AssertionError("unreachable")


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
        publisher's timeout. Element i is None when message i was confirmed, else why it was not; where
        ``refusal`` finds a refusal in it, it is message i's own (see ``_attribute``)."""
        outcomes = await self._publish_together(outgoing)
        if any(_closed_by_refusal(outcome) for outcome in outcomes):
            outcomes = await self._attribute(outgoing, outcomes)
        return outcomes

    async def _attribute(
        self, outgoing: Sequence[Outgoing], outcomes: list[BaseException | None]
    ) -> list[BaseException | None]:
        """Find out which message the broker closed the channel over.

        A channel the broker closes fails every publication in flight on it with the same error, so that
        error names none of them. Each message that failed with its channel is published again, alone, on a
        channel that nothing else uses: a channel closed over it now is its own doing. (One that goes
        through is confirmed now; the first attempt may have reached queues too, a duplicate under the same
        message_id, as after any failure.) The first outage ends the search: the messages not tried alone
        take that error, which counts against none of them.

        The search runs on a connection of its own, opened for it: aiormq may still write a publication of
        the batch after it answered the broker's Channel.Close (a publication waiting for the channel's lock
        when the close arrived), and the broker then closes the whole CONNECTION (504 CHANNEL_ERROR). On the
        shared connection the search would run into that every time and never name the message.
        """
        settled = list(outcomes)
        suspects = [i for i, outcome in enumerate(outcomes) if _fails_with_its_channel(outcome)]
        try:
            async with asyncio.timeout(self._timeout):
                private = await aio_pika.connect(
                    self._connection_url(), client_properties={"connection_name": "intermission refusal check"}
                )
        except TRANSIENT_AMQP_ERRORS as exc:
            for i in suspects:
                settled[i] = exc
            return settled
        try:
            for position, i in enumerate(suspects):
                alone = await self._publish_alone(private, outgoing[i])
                settled[i] = alone
                if alone is not None and refusal(alone) is None:
                    for j in suspects[position + 1 :]:
                        settled[j] = alone
                    break
        finally:
            with contextlib.suppress(*TRANSIENT_AMQP_ERRORS):
                await private.close()
        return settled

    def _connection_url(self) -> URL:
        # aio-pika keeps the URL it connected with (credentials, vhost, options) but does not declare it on
        # its abstract connection.
        # A connection over a node list is on one node of it: the one it is on now is alive.
        url = getattr(self._connection, "node_url", None) or getattr(self._connection, "url", None)
        if not isinstance(url, URL):
            raise TypeError("the publisher's connection does not say which URL it connected to")
        return url

    async def _publish_alone(self, connection: aio_pika.abc.AbstractConnection, item: Outgoing) -> BaseException | None:
        channel = connection.channel(publisher_confirms=True, on_return_raises=True)
        try:
            async with asyncio.timeout(self._timeout):
                await channel
                exchange = await channel.get_exchange(self._exchange_name, ensure=False)
                await exchange.publish(item.message, item.routing_key, mandatory=self._mandatory)
        except TimeoutError:
            return TimeoutError("no publisher confirm in time")
        except TRANSIENT_AMQP_ERRORS as exc:
            return exc
        finally:
            if not channel.is_closed:
                with contextlib.suppress(*TRANSIENT_AMQP_ERRORS):
                    await channel.close()
        return None

    async def _publish_together(self, outgoing: Sequence[Outgoing]) -> list[BaseException | None]:
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
