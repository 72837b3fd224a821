"""The RabbitMQ contract, in one module: every exchange, queue, routing key and header, the message
properties, the builders of every message Intermission sends, and the topology's declaration.

Hosts and the messaging bus are written against this contract (``docs/contracts.md`` describes it for
them), so every layer takes its names from here and nothing builds a message by hand.

- ``intermission.commands`` (topic) routes each command to its quorum queue. A command's key names the
  scope of its body, ``run.<command>.<app>.<tenant>``, and each queue is bound with ``run.<command>.#``:
  that is what lets RabbitMQ's topic permissions confine a host to its tenants (a confined user may only
  publish keys of its own scopes), while the bare ``run.<command>`` still routes for identities trusted
  with every scope. Each queue dead-letters to ``intermission.dead`` (fanout, into the quorum queue of
  that name) at least once, and has a delivery limit, so a command that keeps failing ends there instead
  of looping forever.
- ``intermission.events`` (topic) carries notices, run events and refusals to hosts and the bus, under
  ``notice.<reason>.<app>.<tenant>``, ``run.<kind>.<app>.<tenant>`` and ``command.rejected.<app>.<tenant>``.
- Every message is ``application/json``, persistent, has a ``message_id``, ``type`` = its routing key, the
  header ``x-schema-version``, the causing command's id as ``correlation_id`` (events), and a W3C
  ``traceparent`` header when there is one.

A command refused for a permanent reason is not rejected into the dead-letter exchange: the consumer
publishes a copy to ``intermission.dead`` itself (``dead_copy``), with the error code in
``x-intermission-error`` (a broker dead-lettering cannot add a header), and acknowledges the original once
that copy is confirmed.

Declarations are made on robust objects, so aio-pika replays them after a reconnect.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any, Final, Protocol

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, AbstractQueue, FieldValue
from aiormq.exceptions import ChannelPreconditionFailed
from pamqp.encode import field_table

from intermission.schemas.events import CommandRejected, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import SuspendReason

# --- message properties and headers ------------------------------------------------------------------

SCHEMA_VERSION: Final = 1
JSON: Final = "application/json"

SCHEMA_VERSION_HEADER: Final = "x-schema-version"
TRACEPARENT_HEADER: Final = "traceparent"
# On a refused command's dead-lettered copy: the error code, its human detail, and the routing key the
# command was sent with (the copy is published under it too, but a replay must not depend on that).
ERROR_HEADER: Final = "x-intermission-error"
DETAIL_HEADER: Final = "x-intermission-detail"
ORIGINAL_KEY_HEADER: Final = "x-intermission-routing-key"
# On a dead copy whose sender's headers would not fit a frame beside the refusal's: why they were left out.
HEADERS_DROPPED_HEADER: Final = "x-intermission-headers-dropped"
# A dead copy's detail is for people; the header stays well inside what the broker accepts.
MAX_DETAIL_CHARS: Final = 1000

# What an AMQP header table holds here: scalars only (the schema version, a traceparent, an error code).
HeaderValue = str | int | bool | float

# An AMQP short string (message_id, correlation_id, type, a routing key) holds at most this many bytes of
# UTF-8.
MAX_SHORT_STRING_BYTES: Final = 255
# A message's properties travel in one frame, and RabbitMQ's frames are 128 KiB by default: a header table
# near that makes the broker close the whole connection (FRAME_ERROR), which looks like an outage.
MAX_HEADER_BYTES: Final = 64 * 1024

# --- exchanges, queues, routing keys ------------------------------------------------------------------

COMMANDS_EXCHANGE: Final = "intermission.commands"
EVENTS_EXCHANGE: Final = "intermission.events"
DEAD_EXCHANGE: Final = "intermission.dead"
DEAD_QUEUE: Final = "intermission.dead"


class Command(StrEnum):
    """The commands, named by their bare routing keys."""

    START = "run.start"
    RESUME = "run.resume"
    DECIDE = "run.decide"
    REPLY = "run.reply"
    EXPIRE = "run.expire"
    CANCEL = "run.cancel"

    @property
    def queue(self) -> str:
        return COMMAND_QUEUES[self]

    @classmethod
    def of_key(cls, routing_key: str) -> Command | None:
        """The command a routing key (bare or scoped) is for, None when it is no command's."""
        for command in cls:
            if routing_key == command.value or routing_key.startswith(f"{command.value}."):
                return command
        return None

    @property
    def binding(self) -> str:
        """The command queue's binding: the bare key and every scoped one."""
        return f"{self.value}.#"

    def key(self, scope: Scope) -> str:
        """The routing key of this command for ``scope``: ``run.resume.acme.eu-1``."""
        return f"{self.value}.{scope.routing_suffix()}"

    def scope_of_key(self, routing_key: str) -> Scope | None:
        """The scope a routing key of this command names, or None for the bare key. KeyScopeInvalid for a
        key of this command whose remainder is not exactly ``<app>.<tenant>`` (``#`` routes it anyway)."""
        if routing_key == self.value:
            return None
        app, dot, tenant = routing_key.removeprefix(f"{self.value}.").partition(".")
        if not routing_key.startswith(f"{self.value}.") or not dot:
            raise KeyScopeInvalid(routing_key)
        try:
            return Scope(app=app, tenant=tenant)
        except ValueError as exc:
            raise KeyScopeInvalid(routing_key) from exc


def scope_of_command_key(routing_key: str) -> Scope | None:
    """The scope a command's routing key names; None for a bare key, a key of no command, or one that names
    no scope the contract allows (what a refusal, a dead letter or a tool may attribute a message to)."""
    command = Command.of_key(routing_key)
    if command is None:
        return None
    try:
        return command.scope_of_key(routing_key)
    except KeyScopeInvalid:
        return None


class KeyScopeInvalid(ValueError):
    """A command's routing key names no scope the contract allows."""

    def __init__(self, routing_key: str) -> None:
        super().__init__(f"the routing key {routing_key!r} does not end in .<app>.<tenant>")
        self.routing_key = routing_key


COMMAND_QUEUES: Final[dict[Command, str]] = {
    Command.START: "intermission.start",
    Command.RESUME: "intermission.resume",
    Command.DECIDE: "intermission.decide",
    Command.REPLY: "intermission.reply",
    Command.EXPIRE: "intermission.expire",
    Command.CANCEL: "intermission.cancel",
}

# The scope part of a refusal's key when the command's scope could not be read, so that a subscriber of
# command.rejected.# still hears it.
UNREADABLE_SCOPE: Final = "_._"


def notice_key(reason: SuspendReason, scope: Scope) -> str:
    return f"notice.{reason.value}.{scope.routing_suffix()}"


def notice_binding(reason: SuspendReason) -> str:
    """Every scope's notices of one reason, as a topic binding (scope parts hold no dots)."""
    return f"notice.{reason.value}.*.*"


def run_event_key(kind: RunEventKind, scope: Scope) -> str:
    return f"run.{kind.value}.{scope.routing_suffix()}"


def rejected_key(scope: Scope | None) -> str:
    return f"command.rejected.{scope.routing_suffix() if scope is not None else UNREADABLE_SCOPE}"


# --- messages -----------------------------------------------------------------------------------------


def message(
    body: bytes | str,
    *,
    message_id: str | None,
    routing_key: str,
    correlation_id: str | None = None,
    headers: Mapping[str, HeaderValue] | None = None,
    traceparent: str | None = None,
    user_id: str | None = None,
) -> aio_pika.Message:
    """A message with the contract's properties. ``headers`` are copied as given (an outbox row's headers
    already carry the schema version and perhaps a traceparent); the schema version is added if absent."""
    all_headers: dict[str, Any] = {SCHEMA_VERSION_HEADER: SCHEMA_VERSION}
    if headers:
        all_headers.update(headers)
    if traceparent:
        all_headers[TRACEPARENT_HEADER] = traceparent
    return aio_pika.Message(
        body.encode() if isinstance(body, str) else body,
        content_type=JSON,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=message_id,
        type=routing_key,
        correlation_id=correlation_id,
        headers=all_headers,
        user_id=user_id,
    )


class ScopedBody(Protocol):
    """A command body: every one names its scope."""

    @property
    def scope(self) -> Scope: ...

    def model_dump_json(self) -> str: ...


def command_message(
    command: Command,
    body: ScopedBody,
    *,
    message_id: str,
    correlation_id: str | None = None,
    traceparent: str | None = None,
    user_id: str | None = None,
) -> aio_pika.Message:
    """A command as hosts, the bus and the sweeper send it. ``user_id`` must be the publishing connection's
    own user: RabbitMQ refuses any other, which is what lets a worker trust it. Its routing key (and
    ``type``) is the command's key for the body's scope."""
    return message(
        body.model_dump_json(),
        message_id=message_id,
        routing_key=command.key(body.scope),
        correlation_id=correlation_id,
        traceparent=traceparent,
        user_id=user_id,
    )


def derived_id(prefix: str, source: str) -> str:
    """``<prefix>:<source>``, an id made from another message's id, or ``<prefix>:sha256:<hex>`` when that
    would not fit a short string. The source may already use all 255 bytes; its digest keeps the derived id
    stable (a repeat deduplicates) and unique to it, and it always fits."""
    plain = f"{prefix}:{source}"
    if len(plain.encode()) <= MAX_SHORT_STRING_BYTES:
        return plain
    return f"{prefix}:sha256:{hashlib.sha256(source.encode()).hexdigest()}"


def rejection_message(rejection: CommandRejected, *, traceparent: str | None = None) -> aio_pika.Message:
    """The ``command.rejected`` event for a refused command. Its id is stable per refused message, so a
    refusal repeated after a redelivery deduplicates; the refused message's id is its correlation id and
    in its body, whole; ``traceparent`` puts it in the refused command's trace."""
    refused = rejection.message_id
    return message(
        rejection.model_dump_json(),
        message_id=derived_id("rejected", refused) if refused else None,
        routing_key=rejected_key(rejection.scope),
        correlation_id=refused or None,
        traceparent=traceparent,
    )


def wire_problem(outgoing: aio_pika.Message, routing_key: str) -> str | None:
    """Why ``outgoing`` cannot be put on the wire as it is (None: it can). The AMQP client would raise
    for these, or the broker drop the connection, before any broker could refuse the message itself."""
    for name, value in (
        ("routing key", routing_key),
        ("message_id", outgoing.message_id),
        ("correlation_id", outgoing.correlation_id),
        ("type", outgoing.type),
    ):
        if value is not None and len(value.encode()) > MAX_SHORT_STRING_BYTES:
            return f"its {name} is over {MAX_SHORT_STRING_BYTES} bytes"
    try:
        size = len(field_table(outgoing.headers))
    except (TypeError, ValueError) as exc:
        return f"its headers cannot be encoded: {exc}"
    if size > MAX_HEADER_BYTES:
        return f"its headers are {size} bytes, over {MAX_HEADER_BYTES}"
    return None


def wire_safe(value: object) -> FieldValue:
    """A header value as the wire can carry it again. The AMQP client decodes a string header that is not
    UTF-8 into ``bytes``, which it cannot encode back; such a value becomes a byte array (the same bytes,
    type ``x``), nested tables and arrays are made safe the same way, and anything else the client has no
    encoding for becomes its text."""
    if value is None or isinstance(value, str | int | float | bool | bytearray):
        return value
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, Mapping):
        return {str(k): wire_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [wire_safe(v) for v in value]
    if isinstance(value, Decimal | datetime):
        return value
    return str(value)


def dead_copy(
    body: bytes,
    headers: Mapping[str, Any],
    *,
    message_id: str | None,
    correlation_id: str | None,
    routing_key: str,
    code: str,
    detail: str,
) -> aio_pika.Message:
    """A refused command as it is kept in ``intermission.dead``: its body and id unchanged, its headers
    but for any that imitate the refusal's or the broker's dead-lettering (``REFUSAL_HEADER_PREFIXES``:
    the dead-letter tools believe a worker's copy, so a sender must not be able to write its refusal), with
    the refusal's code, detail and the command's routing key added. When the sender's headers would make
    the copy too large for a frame (the broker would close the whole connection over it), they are left out
    and ``x-intermission-headers-dropped`` says why: the refusal always gets to the queue."""
    refusal: dict[str, Any] = {
        ERROR_HEADER: code,
        DETAIL_HEADER: detail[:MAX_DETAIL_CHARS],
        ORIGINAL_KEY_HEADER: routing_key,
    }
    kept = {
        k: wire_safe(v) for k, v in headers.items() if isinstance(k, str) and not k.startswith(REFUSAL_HEADER_PREFIXES)
    }
    copy = aio_pika.Message(
        body,
        content_type=JSON,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=message_id,
        correlation_id=correlation_id,
        type=routing_key,
        # When it was refused: what the dead-letter queue's age is measured by.
        timestamp=datetime.now(UTC),
        headers={**kept, **refusal},
    )
    problem = wire_problem(copy, routing_key)
    if problem is not None:
        # The schema version stays, so that a replay of the command is read as it was sent.
        version = headers.get(SCHEMA_VERSION_HEADER)
        copy.headers = {
            **({SCHEMA_VERSION_HEADER: version} if isinstance(version, int) and not isinstance(version, bool) else {}),
            **refusal,
            HEADERS_DROPPED_HEADER: f"the sender's headers were left out: {problem}"[:MAX_DETAIL_CHARS],
        }
    return copy


# The refusal's headers (every x-intermission- one) and the broker's dead-lettering history: a dead copy
# never carries a sender's version of them, and a replayed command starts afresh.
REFUSAL_HEADER_PREFIXES: Final = (
    "x-intermission-",
    "x-death",
    "x-first-death",
    "x-last-death",
)


def replayed_command(
    body: bytes,
    headers: Mapping[str, Any],
    *,
    message_id: str | None,
    correlation_id: str | None,
    routing_key: str,
    user_id: str | None,
    content_type: str | None = JSON,
) -> aio_pika.Message:
    """A dead-lettered command sent back to its queue: the same body and id, without the refusal."""
    return aio_pika.Message(
        body,
        content_type=content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=message_id,
        correlation_id=correlation_id,
        type=routing_key,
        headers={k: wire_safe(v) for k, v in headers.items() if not k.startswith(REFUSAL_HEADER_PREFIXES)},
        user_id=user_id,
    )


# --- topology -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    commands: AbstractExchange
    events: AbstractExchange
    dead: AbstractExchange
    dead_queue: AbstractQueue
    queues: dict[Command, AbstractQueue]


class TopologyOutdated(RuntimeError):
    """The broker still has the direct ``intermission.commands`` of before scoped routing."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{COMMANDS_EXCHANGE} is not a topic exchange on this broker ({detail}); this version routes "
            "commands by scope. Convert it with `intermission topology upgrade` (queued commands are kept), "
            "then start the workers again"
        )


def _is_type_mismatch(error: ChannelPreconditionFailed) -> bool:
    # RabbitMQ's answer to declaring an existing exchange with another type: "PRECONDITION_FAILED -
    # inequivalent arg 'type' for exchange ... received 'topic' but current is 'direct'".
    return "inequivalent arg 'type'" in str(error)


async def declare_commands_exchange(channel: AbstractChannel) -> AbstractExchange:
    """The commands exchange, or TopologyOutdated when a direct one of an older version is in its place
    (the broker closes ``channel`` over the mismatch)."""
    try:
        return await channel.declare_exchange(COMMANDS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
    except ChannelPreconditionFailed as exc:
        if _is_type_mismatch(exc):
            raise TopologyOutdated(str(exc)) from exc
        raise


def command_queue_arguments(delivery_limit: int) -> dict[str, Any]:
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DEAD_EXCHANGE,
        # At-least-once dead-lettering: a dead-lettered command is never dropped on the way.
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
        "x-delivery-limit": delivery_limit,
    }


def dead_queue_arguments(max_length: int) -> dict[str, Any]:
    arguments: dict[str, Any] = {"x-queue-type": "quorum"}
    if max_length:
        # Full, it refuses new dead letters rather than drop the oldest: a refusal the broker will not take
        # is retried and its command stays in its own queue (consumers/policy.py), so nothing is lost, at
        # the price of commands waiting until an operator empties the dead-letter queue.
        arguments.update({"x-max-length": max_length, "x-overflow": "reject-publish"})
    return arguments


async def declare(channel: AbstractChannel, *, delivery_limit: int, dead_max_length: int = 0) -> Topology:
    """Declare the whole topology, idempotently. Queue arguments are fixed when a queue is first declared:
    a changed ``delivery_limit`` or ``dead_max_length`` needs the queues re-created (or a policy)."""
    commands = await declare_commands_exchange(channel)
    events = await channel.declare_exchange(EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
    dead = await channel.declare_exchange(DEAD_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    dead_queue = await channel.declare_queue(DEAD_QUEUE, durable=True, arguments=dead_queue_arguments(dead_max_length))
    await dead_queue.bind(dead)
    queues: dict[Command, AbstractQueue] = {}
    for command, name in COMMAND_QUEUES.items():
        queue = await channel.declare_queue(name, durable=True, arguments=command_queue_arguments(delivery_limit))
        await queue.bind(commands, routing_key=command.binding)
        queues[command] = queue
    return Topology(commands=commands, events=events, dead=dead, dead_queue=dead_queue, queues=queues)


async def upgrade(connection: AbstractConnection, *, delivery_limit: int, dead_max_length: int = 0) -> bool:
    """Convert a broker's direct ``intermission.commands`` into the topic exchange of scoped routing, and
    declare the rest of the topology; returns whether there was anything to convert.

    An exchange's type cannot change, so the old one is deleted (its bindings with it) and the new one
    declared and bound. The command queues keep every message meanwhile: a quorum queue's messages do not
    depend on the exchanges bound to it. A command published in the moment between the two has no exchange
    to go to: the broker refuses it (a publisher with confirms is told, and re-sends it under the same
    message_id), so none is lost unseen. Stop the old workers first: they declare the direct exchange.
    """
    probe = await connection.channel()
    try:
        await declare_commands_exchange(probe)
        outdated = False
    except TopologyOutdated:
        outdated = True
    finally:
        if not probe.is_closed:
            await probe.close()
    channel = await connection.channel()
    try:
        if outdated:
            await channel.exchange_delete(COMMANDS_EXCHANGE)
        await declare(channel, delivery_limit=delivery_limit, dead_max_length=dead_max_length)
    finally:
        await channel.close()
    return outdated
