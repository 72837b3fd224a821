"""The clients hosts and the messaging bus use: send commands, hear events.

A host starts, resumes, decides and cancels runs, and subscribes to its scope's notices and run events::

    scope = Scope(app="billing", tenant="acme")
    async with await HostClient.connect("amqp://host:secret@rabbit/", name="billing-host") as host:
        async with host.subscribe(scope) as events:
            await host.start(StartCommand(scope=scope, run_id="run-1", agent_id="demo", input="hi"))
            async for received in events:
                notice = received.event
                if isinstance(notice, Notice) and notice.reason is SuspendReason.EXTERNAL_TOOL:
                    answers = [ToolAnswer(call_id=call.id, content=run_tool(call)) for call in notice.pending]
                    await host.resume(ResumeCommand(scope=scope, version=version_of(notice), results=answers))

The bus answers ``agent_reply`` pauses::

    async with await BusClient.connect("amqp://intermission-bus:secret@rabbit/") as bus:
        async with bus.subscribe() as notices:  # every scope's agent_reply notices
            async for received in notices:
                notice = received.event
                call = notice.pending[0]
                await bus.reply(notice.scope, version_of(notice), call.reply_with, encoded_reply)

Every command is published with publisher confirms (a method returns only once the broker has the
command) and with ``mandatory`` (a command no queue takes fails loudly instead of vanishing). Each carries
``user_id``: the connection's own user, which RabbitMQ checks against the authenticated user and refuses
(``PRECONDITION_FAILED``, the channel is closed) if it differs. That check is what lets the fleet trust
a reply's or a decision's ``user_id``: a host cannot forge the bus's.

Subscriptions deduplicate on ``message_id``: the relay delivers every event at least once, always under
the same id. An event is acknowledged only once its consumer is done with it: when the consumer asks for the
next one, or leaves the ``async with`` block without an error. A consumer that raises, or a process that
dies, leaves it unacknowledged, and the broker delivers it again.

By default a subscription reads from a DURABLE queue named after the connection's user and the scope
(``<user>.<app>.<tenant>``; see ``subscription_queue``), so nothing is missed while a host is away or
restarting: events routed there meanwhile wait for it, and an event whose handler never finished is
delivered again to the next subscription of that queue. ``durable_queue="name"`` names it instead;
subscriptions of several processes to one name share its events (each goes to one of them).
``exclusive=True`` is for throwaway listeners (a demo, a dashboard): a queue that lives only as long as the
subscription, and misses whatever is published while it is not there. It is named ``<user>.exclusive-<hex>``
after the connection's user too, so a host confined to its scopes (which may declare only queues named
``<user>.*``) can have one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any, ClassVar, Generic, Self, TypedDict, TypeVar

from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
    ConsumerTag,
)
from pydantic import BaseModel, ValidationError
from typing_extensions import Unpack

from intermission.publishers.amqp import TRANSIENT_AMQP_ERRORS, ConfirmingPublisher, amqp_nodes, connect
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    ReplyCommand,
    ResumeCommand,
    ScopedCommand,
    StartCommand,
)
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import ClaimVersion, Notice, SuspendReason
from intermission.wire import (
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    Command,
    command_message,
    notice_binding,
    notice_key,
    rejected_key,
    run_event_key,
)

log = logging.getLogger("intermission.clients")

E = TypeVar("E")

HostEvent = Notice | RunEvent | CommandRejected


def version_of(notice: Notice) -> ClaimVersion:
    """The claim pin that answers ``notice``: its run, its pause and the revision it paused at."""
    return ClaimVersion(run_id=notice.run_id, suspension_id=notice.suspension_id, run_revision=notice.run_revision)


class EventKind(StrEnum):
    """What a host subscription hears."""

    NOTICE = "notice"  # notice.<reason>.<app>.<tenant>: a run paused
    RUN = "run"  # run.<kind>.<app>.<tenant>: a run resumed or ended
    REJECTED = "rejected"  # command.rejected.<app>.<tenant>: a command was refused


ALL_KINDS: frozenset[EventKind] = frozenset(EventKind)


@dataclass(frozen=True)
class Received(Generic[E]):
    """One event as delivered: its typed body and the message's identity. ``redelivered``: the broker
    delivered it before (to a consumer that did not finish with it, perhaps this process before a
    restart), so its effect may already have happened."""

    event: E
    message_id: str | None
    routing_key: str
    correlation_id: str | None
    headers: Mapping[str, Any]
    redelivered: bool = False


class _Seen:
    """The last ``limit`` message ids, to drop re-deliveries of an event already handed out."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def first_time(self, message_id: str) -> bool:
        if message_id in self._ids:
            self._ids.move_to_end(message_id)
            return False
        self._ids[message_id] = None
        while len(self._ids) > self._limit:
            self._ids.popitem(last=False)
        return True


class Subscription(Generic[E]):
    """Events from ``intermission.events`` for some routing keys: an async context manager that yields an
    async iterator of ``Received`` events, each ``message_id`` at most once (of the last ``remember``).

    Each event is acknowledged once its consumer is done with it: when the consumer asks for the next
    (``__anext__``), or leaves the ``async with`` block without an error. Until then it is unacknowledged,
    so a consumer that raises (the block is left with the error) or a process that dies gets it again from
    the broker. A message whose body does not decode is logged, acknowledged and skipped: no consumer could
    ever handle it. ``prefetch`` bounds how many wait unread.

    ``durable_queue`` names the durable (quorum) queue to read from, declared if missing and bound to the
    subscription's keys (a queue keeps every binding it was ever given); without it the queue is exclusive
    and deleted with the subscription, named ``exclusive_queue`` (by default aio-pika's ``amq_<hex>``, which
    only a user trusted with every queue may declare). The clients' ``subscribe`` name both after their
    user.
    """

    def __init__(
        self,
        connection: AbstractRobustConnection,
        bindings: Collection[str],
        decode: Callable[[str, bytes], E],
        *,
        durable_queue: str | None = None,
        exclusive_queue: str | None = None,
        prefetch: int = 64,
        remember: int = 10_000,
    ) -> None:
        if durable_queue is not None and exclusive_queue is not None:
            raise ValueError("a subscription reads either a durable queue or an exclusive one, not both")
        self._connection = connection
        self._bindings = list(bindings)
        self._decode = decode
        self._durable_queue = durable_queue
        self._exclusive_queue = exclusive_queue
        self._prefetch = prefetch
        self._seen = _Seen(remember)
        self._inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self._channel: AbstractRobustChannel | None = None
        self._queue: AbstractQueue | None = None
        self._tag: ConsumerTag | None = None
        # The event handed out last, acknowledged once its consumer is done with it.
        self._current: AbstractIncomingMessage | None = None

    async def __aenter__(self) -> Self:
        channel = self._connection.channel(publisher_confirms=False)
        await channel
        self._channel = channel
        await channel.set_qos(prefetch_count=self._prefetch)
        if self._durable_queue is not None:
            queue = await channel.declare_queue(self._durable_queue, durable=True, arguments={"x-queue-type": "quorum"})
        else:
            # Named on the client side (by the caller, or by aio-pika as amq_<hex>), so after a reconnect the
            # robust channel declares the same name again, replays the bindings and resumes consuming.
            queue = await channel.declare_queue(self._exclusive_queue, exclusive=True, auto_delete=True)
        for key in self._bindings:
            await queue.bind(EVENTS_EXCHANGE, key)
        self._queue = queue
        self._tag = await queue.consume(self._arrived)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            # Left cleanly (the loop ended, a break, a return): the consumer is done with the last event.
            # Left with an error, it may not be: it stays unacknowledged and the broker delivers it again.
            await self._settle()
        channel, self._channel = self._channel, None
        if channel is None or channel.is_closed:
            return
        with contextlib.suppress(*TRANSIENT_AMQP_ERRORS):
            if self._queue is not None and self._tag is not None:
                await self._queue.cancel(self._tag)
        # Closing the channel hands every unacknowledged message back to the queue.
        with contextlib.suppress(*TRANSIENT_AMQP_ERRORS):
            await channel.close()

    @property
    def queue_name(self) -> str:
        assert self._queue is not None, "enter the subscription first"
        return self._queue.name

    async def _arrived(self, message: AbstractIncomingMessage) -> None:
        await self._inbox.put(message)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Received[E]:
        # Asking for the next event is saying the last one is done with.
        await self._settle()
        while True:
            message = await self._inbox.get()
            key = message.routing_key or ""
            if message.message_id is not None and not self._seen.first_time(message.message_id):
                # A copy of an event this subscription handed out already, whose consumer asked for more
                # since: done with, like the original.
                await _ack(message)
                continue
            try:
                event = self._decode(key, message.body)
            except (ValidationError, KeyError) as exc:
                log.warning(
                    "undecodable event skipped",
                    extra={
                        "action": "event_skipped",
                        "routing_key": key,
                        "message_id": message.message_id,
                        "error": type(exc).__name__,
                    },
                )
                await _ack(message)
                continue
            self._current = message
            return Received(
                event=event,
                message_id=message.message_id,
                routing_key=key,
                correlation_id=message.correlation_id,
                headers=dict(message.headers),
                redelivered=bool(message.redelivered),
            )

    async def _settle(self) -> None:
        message, self._current = self._current, None
        if message is not None:
            await _ack(message)


async def _ack(message: AbstractIncomingMessage) -> None:
    # On a channel that closed meanwhile (a lost connection) the ack cannot be sent: the broker delivers the
    # message again, on the reopened channel, and the subscription drops it as a copy.
    with contextlib.suppress(*TRANSIENT_AMQP_ERRORS):
        await message.ack()


def subscription_queue(user: str, scope: Scope | None, what: Collection[str] = ()) -> str:
    """The durable queue a subscription reads from unless told otherwise: ``<user>.<app>.<tenant>``, then
    what it hears when that is not everything (``.notice``, ``.notice+run``, ``.agent_reply``);
    ``<user>.agent_reply`` for the bus's subscription to every scope. One name per user, scope and kinds,
    so two subscriptions of one process to different kinds never share a queue (they would take turns with
    each other's events), and the same subscription after a restart finds its queue, and what waited there."""
    parts = [user, *((scope.app, scope.tenant) if scope is not None else ())]
    if what:
        parts.append("+".join(sorted(what)))
    return ".".join(parts)


def exclusive_queue_name(user: str) -> str:
    """A fresh name for an exclusive subscription's queue: ``<user>.exclusive-<hex>``. Not the server's
    ``amq.gen-*`` (a robust channel must declare the same name again after a reconnect, so the client names
    it) nor aio-pika's ``amq_<hex>`` (a host confined to its scopes may declare only queues named
    ``<user>.*``)."""
    return f"{user}.exclusive-{uuid.uuid4().hex}"


def host_bindings(scope: Scope, kinds: Collection[EventKind] = ALL_KINDS) -> dict[str, type[BaseModel]]:
    """The exact routing keys a host subscription to ``scope`` binds, each with its body type. Exact keys
    (one per reason and per run event kind) rather than wildcards: only this scope's events can match."""
    require_scope(scope)
    keys: dict[str, type[BaseModel]] = {}
    if EventKind.NOTICE in kinds:
        keys.update({notice_key(reason, scope): Notice for reason in SuspendReason})
    if EventKind.RUN in kinds:
        keys.update({run_event_key(kind, scope): RunEvent for kind in RunEventKind})
    if EventKind.REJECTED in kinds:
        keys[rejected_key(scope)] = CommandRejected
    return keys


class SendOptions(TypedDict, total=False):
    """What every command method takes beside the command: ``message_id`` (a fresh one unless given:
    re-send with the same id to make a retry idempotent), ``correlation_id`` and a W3C ``traceparent``."""

    message_id: str | None
    correlation_id: str | None
    traceparent: str | None


class _CommandClient:
    """Publishes commands to ``intermission.commands`` with confirms, as ``user_id``."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        *,
        user_id: str | None,
        publish_timeout: float = 10.0,
        owns_connection: bool = False,
    ) -> None:
        self.connection = connection
        self.user_id = user_id
        self._owns_connection = owns_connection
        self._publisher = ConfirmingPublisher(connection, COMMANDS_EXCHANGE, mandatory=True, timeout=publish_timeout)

    # The connection's name in the management UI when ``connect`` is not told one.
    connection_name: ClassVar[str] = "intermission-client"

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str | None = None,
        publish_timeout: float = 10.0,
        reconnect_interval: float = 5.0,
        connect_timeout: float = 5.0,
        offset: int | None = None,
    ) -> Self:
        """A client over a robust connection of its own, closed with the client, as the URL's user. ``url``
        may list the nodes of a cluster (``publishers.amqp.connect``: each (re)connect tries them in turn)."""
        connection = await connect(
            url,
            name or cls.connection_name,
            reconnect_interval=reconnect_interval,
            connect_timeout=connect_timeout,
            offset=offset,
        )
        return cls(connection, user_id=_url_user(url), publish_timeout=publish_timeout, owns_connection=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _user(self) -> str:
        """Who this client is to the broker: its ``user_id``, else the user its connection logged in as."""
        if self.user_id:
            return self.user_id
        url = getattr(self.connection, "url", None)
        return _url_user(str(url)) if url is not None else "guest"

    async def close(self) -> None:
        """Close the client's channel, and its connection when the client opened it."""
        await self._publisher.close()
        if self._owns_connection:
            await self.connection.close()

    async def send(
        self,
        command: Command,
        body: ScopedCommand,
        *,
        message_id: str | None = None,
        correlation_id: str | None = None,
        traceparent: str | None = None,
    ) -> str:
        """Publish ``body`` under ``command`` and wait for the broker's confirm; returns the message id (a
        fresh one unless given: re-send with the same id to make a retry idempotent). PublishFailed (the
        broker's error chained) when the broker did not take it."""
        chosen = message_id or str(uuid.uuid4())
        await self._publisher.publish(
            command_message(
                command,
                body,
                message_id=chosen,
                correlation_id=correlation_id,
                traceparent=traceparent,
                user_id=self.user_id,
            ),
            command.key(body.scope),
        )
        return chosen


def _url_user(url: str) -> str:
    # aio-pika logs in as guest when the URL names nobody.
    return amqp_nodes(url)[0].user or "guest"


class HostClient(_CommandClient):
    """What a host uses: start, resume, decide and cancel runs; hear its scope's events.

    ``user_id`` is the connection's user (RabbitMQ refuses any other); a decision on a pause that names
    approvers counts only if it is one of them. Each method returns the command's ``message_id``.
    """

    connection_name = "intermission-host"

    async def start(self, command: StartCommand, **options: Unpack[SendOptions]) -> str:
        return await self.send(Command.START, command, **options)

    async def resume(self, command: ResumeCommand, **options: Unpack[SendOptions]) -> str:
        return await self.send(Command.RESUME, command, **options)

    async def decide(self, command: DecideCommand, **options: Unpack[SendOptions]) -> str:
        return await self.send(Command.DECIDE, command, **options)

    async def cancel(self, command: CancelCommand, **options: Unpack[SendOptions]) -> str:
        return await self.send(Command.CANCEL, command, **options)

    def subscribe(
        self,
        scope: Scope,
        kinds: Collection[EventKind] = ALL_KINDS,
        *,
        durable_queue: str | None = None,
        exclusive: bool = False,
        prefetch: int = 64,
    ) -> Subscription[HostEvent]:
        """``scope``'s events of the given kinds, typed: Notice, RunEvent or CommandRejected.

        They are read from the durable queue ``durable_queue`` or, by default, ``subscription_queue(user,
        scope, kinds)`` (``<user>.<app>.<tenant>`` for every kind), so a host misses no pause while it is
        away; ``exclusive=True`` reads from a queue of this subscription's own instead, gone with it."""
        keys = host_bindings(scope, kinds)
        queue = _queue_to_read(
            durable_queue,
            exclusive,
            lambda: subscription_queue(self._user(), scope, () if set(kinds) >= ALL_KINDS else kinds),
        )
        mine = exclusive_queue_name(self._user()) if queue is None else None

        def decode(routing_key: str, body: bytes) -> HostEvent:
            model = keys[routing_key]
            event = model.model_validate_json(body)
            assert isinstance(event, Notice | RunEvent | CommandRejected)
            return event

        return Subscription(self.connection, keys, decode, durable_queue=queue, exclusive_queue=mine, prefetch=prefetch)


def _queue_to_read(durable_queue: str | None, exclusive: bool, default: Callable[[], str]) -> str | None:
    """The durable queue a subscription reads, or None for an exclusive one (named by the caller)."""
    if exclusive:
        if durable_queue is not None:
            raise ValueError("a subscription reads either a durable queue or an exclusive one, not both")
        return None
    return durable_queue if durable_queue is not None else default()


class BusClient(_CommandClient):
    """What the messaging bus uses: answer ``agent_reply`` pauses and hear about them.

    Connect as the configured bus user (``INTERMISSION_BUS_USER``): a reply counts only when its
    broker-validated ``user_id`` is that user.
    """

    connection_name = "intermission-bus"

    async def reply(
        self,
        scope: Scope,
        version: ClaimVersion,
        reply_with: str,
        input: str,
        **options: Unpack[SendOptions],
    ) -> str:
        """Answer the pause ``version`` names; ``input`` (the agent's encoded reply) is delivered to the run
        byte for byte."""
        reply = ReplyCommand(scope=scope, version=version, reply_with=reply_with, input=input)
        return await self.send(Command.REPLY, reply, **options)

    def subscribe(
        self,
        scope: Scope | None = None,
        *,
        durable_queue: str | None = None,
        exclusive: bool = False,
        prefetch: int = 64,
    ) -> Subscription[Notice]:
        """``agent_reply`` notices of ``scope``, or of every scope when None, read from the durable queue
        ``durable_queue`` or, by default, ``<user>.agent_reply`` (``<user>.<app>.<tenant>.agent_reply`` for
        one scope); ``exclusive=True`` reads from a queue of this subscription's own, gone with it."""
        key = (
            notice_key(SuspendReason.AGENT_REPLY, require_scope(scope))
            if scope is not None
            else notice_binding(SuspendReason.AGENT_REPLY)
        )
        queue = _queue_to_read(
            durable_queue, exclusive, lambda: subscription_queue(self._user(), scope, [SuspendReason.AGENT_REPLY])
        )
        mine = exclusive_queue_name(self._user()) if queue is None else None

        def decode(_routing_key: str, body: bytes) -> Notice:
            return Notice.model_validate_json(body)

        return Subscription(
            self.connection, [key], decode, durable_queue=queue, exclusive_queue=mine, prefetch=prefetch
        )
