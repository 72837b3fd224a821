"""Operator tools behind ``intermission dead``: the dead-letter queue, read in place and replayed.

``dead list`` reads the dead-letter queue without taking anything out of it (every message it fetched is
returned to the queue when it is done). ``dead replay`` republishes dead-lettered commands to their
original routing key (a bare one made scoped by the body's scope), with the refusal headers removed, waits
for the broker's confirm, and only then acknowledges the dead copy: a command is never in neither place.
Replaying keeps the ``message_id``, so a command whose effect did commit after all is acknowledged as a
duplicate, not applied twice.

Nothing here believes a header the sender could have chosen. Only workers and the broker put messages in
``intermission.dead`` (no host may write to it), and both keep the key the message was first published
with, so a dead letter's key is the delivery's own, never a header. Its refusal is read from the refusal
headers only when a worker wrote the copy; when the broker dead-lettered the message (``Source``), every
header is the sender's and only the broker's ``x-death`` reason is read. A refusal neither could have
written is shown ``unverified``, never as what it claims. A replay goes out only under a key naming the
scope its body acts in, and as its sender's identity unless the operator agreed otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from intermission.consumers.parsing import readable_body, scope_hint
from intermission.schemas.errors import ALL_ERRORS
from intermission.schemas.scope import Scope
from intermission.wire import (
    COMMANDS_EXCHANGE,
    DEAD_QUEUE,
    DETAIL_HEADER,
    ERROR_HEADER,
    Command,
    replayed_command,
    scope_of_command_key,
)


class Source(StrEnum):
    """Who put a message in ``intermission.dead``, as the broker proves it."""

    # A worker refused it and published the copy: its refusal headers are the worker's own (a worker drops
    # any the sender wrote, and an older worker's copy wrote its own over them).
    WORKER = "worker"
    # The broker dead-lettered it (a delivery limit, a rejection): the broker always adds ``x-death``, and
    # every other header is the SENDER's, refusal-looking ones included, so none of them is believed.
    BROKER = "broker"


@dataclass(frozen=True)
class DeadLetter:
    """A message in ``intermission.dead``, described by what can be proven. ``routing_key`` is the key it
    was first published with, as the broker delivered it from the dead queue; ``scope`` is the scope that
    key names (None for a bare key, which only identities trusted with every scope may publish)."""

    message_id: str | None
    routing_key: str
    code: str
    detail: str
    size: int
    source: Source = Source.WORKER
    scope: Scope | None = None
    user_id: str | None = None
    # Whether ``code`` and ``detail`` are the worker's or the broker's own account of the refusal. An
    # unverified letter (a code no worker writes, an ``x-death`` reason the broker never gives: only a letter
    # made by hand, or a copy by a worker from before the sender's look-alikes were dropped, can be one)
    # shows "unknown" and says so, never what its headers claim; its key is still the broker's.
    verified: bool = True


_BROKER_DETAILS: Final = {
    "delivery_limit": "kept failing; dead-lettered by the queue's delivery limit",
    "rejected": "a worker could not even refuse it; dead-lettered by the broker",
    "expired": "its time to live ran out; dead-lettered by the broker",
    "maxlen": "its queue was full; dead-lettered by the broker",
}
# The refusal codes a worker writes: anything else in a worker's copy is not a refusal this product made.
_WORKER_CODES: Final = frozenset(error.code for error in ALL_ERRORS)
_UNVERIFIED_DETAIL: Final = "unverified: the refusal on this letter is not one a worker or the broker wrote"


def _broker_reason(headers: Mapping[str, Any]) -> str:
    """The reason of the broker's latest dead-lettering: the first ``x-death`` entry, which the broker
    writes (or moves to the front) each time it dead-letters a message, whatever the sender put there."""
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        reason = deaths[0].get("reason")
        if isinstance(reason, str) and reason:
            return reason
    return "unknown"


def describe(message: AbstractIncomingMessage) -> DeadLetter:
    """``message`` as the dead-letter tools show it: its key from the delivery, its refusal from the worker's
    copy or the broker's ``x-death``, and nothing else a sender could have written taken as a fact."""
    headers = message.headers or {}
    routing_key = message.routing_key or ""
    if "x-death" in headers:
        reason = _broker_reason(headers)
        source = Source.BROKER
        verified = reason in _BROKER_DETAILS
        code = "delivery_limit" if reason == "delivery_limit" else f"broker_{reason}"
        detail = _BROKER_DETAILS.get(reason, "")
    else:
        source = Source.WORKER
        written, explained = headers.get(ERROR_HEADER), headers.get(DETAIL_HEADER)
        verified = isinstance(written, str) and written in _WORKER_CODES
        code = written if isinstance(written, str) else "unknown"
        detail = explained if isinstance(explained, str) else ""
    if not verified:
        code, detail = "unknown", _UNVERIFIED_DETAIL
    return DeadLetter(
        message_id=message.message_id,
        routing_key=routing_key,
        code=code,
        detail=detail,
        size=len(message.body),
        source=source,
        scope=scope_of_command_key(routing_key),
        user_id=message.user_id,
        verified=verified,
    )


async def _fetch_all(connection: AbstractRobustConnection, limit: int) -> tuple[Any, list[AbstractIncomingMessage]]:
    channel = await connection.channel(publisher_confirms=True)
    queue = await channel.get_queue(DEAD_QUEUE)
    fetched: list[AbstractIncomingMessage] = []
    while len(fetched) < limit:
        message = await queue.get(no_ack=False, fail=False)
        if message is None:
            break
        fetched.append(message)
    return channel, fetched


async def list_dead(connection: AbstractRobustConnection, limit: int = 100) -> list[DeadLetter]:
    """What is in the dead-letter queue (up to ``limit``), leaving it all there."""
    channel, fetched = await _fetch_all(connection, limit)
    try:
        return [describe(m) for m in fetched]
    finally:
        # Unacknowledged messages go back to the queue when their channel closes.
        with contextlib.suppress(Exception):
            await channel.close()


class Kept(StrEnum):
    """Why a dead letter a replay selected was not replayed."""

    NOT_A_COMMAND = "not_a_command"  # its key is no command's
    SCOPE_MISMATCH = "scope_mismatch"  # its body acts in a scope its key does not name
    ANOTHER_IDENTITY = "another_identity"  # it would go out as the replaying user, not as its sender


@dataclass(frozen=True)
class Replay:
    """What ``replay_dead`` did: the letters replayed, and those selected but kept in place, with why."""

    replayed: list[DeadLetter]
    kept: list[tuple[DeadLetter, Kept]]


def replay_key(letter: DeadLetter, body: bytes) -> str | Kept:
    """The key a replay publishes under: one naming both the scope the body acts in and the one the
    original key named. A scoped key is kept only when the body names that same scope: a confined host
    can publish its own scope's key with another tenant's body, which a worker refuses ``forbidden``, and
    replaying it on a trusted connection under the body's scope would do what the broker and the worker
    refused. A bare key was published by an identity trusted with every scope: the body's scope is its
    scope, and the replay is keyed by it when the body names a valid one."""
    command = Command.of_key(letter.routing_key)
    if command is None:
        return Kept.NOT_A_COMMAND
    hint = scope_hint(readable_body(body))
    try:
        body_scope = Scope(app=hint[0], tenant=hint[1]) if hint is not None else None
    except ValueError:
        body_scope = None
    if letter.routing_key == command.value:
        return command.key(body_scope) if body_scope is not None else letter.routing_key
    if letter.scope is None or body_scope != letter.scope:
        return Kept.SCOPE_MISMATCH
    return letter.routing_key


def republished_as_another(letter: DeadLetter, replaying_user: str | None) -> bool:
    """Whether a replay of ``letter`` would go out as ``replaying_user`` rather than as its sender. RabbitMQ
    refuses a user_id other than the connection's own, so a sender's user_id survives a replay only when
    the operator connects as that user; a letter without one, or with another's, is published on the
    operator's identity, usually trusted with every scope."""
    return letter.user_id is None or letter.user_id != replaying_user


async def replay_dead(
    connection: AbstractRobustConnection,
    wanted: Callable[[DeadLetter], bool],
    limit: int = 1000,
    on_looked_at: Callable[[], None] = lambda: None,
    *,
    as_another: bool | Callable[[DeadLetter], bool] = False,
) -> Replay:
    """Republish the dead-lettered commands ``wanted`` selects, each under ``replay_key``. A letter that
    would go out on the replaying connection's identity rather than its sender's is kept in place unless
    ``as_another`` says the operator agreed to that: for every such letter (True), or for those it selects
    (the letters the operator was shown: one dead-lettered after they were asked was not agreed to).
    ``on_looked_at`` is called once per dead letter looked at, replayed or not (a progress bar)."""
    agreed = as_another if callable(as_another) else (lambda _letter: as_another)
    channel, fetched = await _fetch_all(connection, limit)
    replayed: list[DeadLetter] = []
    kept: list[tuple[DeadLetter, Kept]] = []
    me = connection_user(connection)
    try:
        exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
        for message in fetched:
            on_looked_at()
            letter = describe(message)
            if not wanted(letter):
                continue
            key = replay_key(letter, message.body)
            if isinstance(key, Kept):
                kept.append((letter, key))
                continue
            if republished_as_another(letter, me) and not agreed(letter):
                kept.append((letter, Kept.ANOTHER_IDENTITY))
                continue
            await exchange.publish(
                replayed_command(
                    message.body,
                    message.headers or {},
                    message_id=message.message_id,
                    correlation_id=message.correlation_id,
                    routing_key=key,
                    user_id=message.user_id if message.user_id == me else None,
                    content_type=message.content_type,
                ),
                routing_key=key,
            )
            # Confirmed: the command is back in its queue, so the dead copy may go.
            await message.ack()
            replayed.append(letter)
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
    return Replay(replayed=replayed, kept=kept)


def connection_user(connection: AbstractRobustConnection) -> str | None:
    """The user ``connection`` was opened as."""
    url = getattr(connection, "url", None)
    return getattr(url, "user", None)
