"""The spans of commands: one CONSUMER span per delivery, in the trace its ``traceparent`` header names.

``AckPolicy`` opens a command's span around everything it does with the delivery (``command_span``), so
the command's transaction (``transaction_span``, opened by ``CommandHandlers.apply``), its refusal and the
run it hands to the fleet happen in it: the fleet's task copies the context it was created in, so the run's
continuation starts as this span's child (``fleet/run_spans.py``). The outcome the policy reports is also
set on the span (``engine/observer.py``, ``Spans.settled``), and a claim links the span to the span of the
pause it answered (``note_claimed``), whose ``traceparent`` the pause stored with itself.

Group commit (``engine/committer.py``): each command keeps its own span; the ONE statement several of them
share gets one span of its own, a root, linked to each command's span and linked from each
(``engine/observer.py``, ``Spans``). It cannot be the child of all of them (a span has one parent), and
making it the child of one would put the others' work in a stranger's trace; links keep every command in
its own trace and let a viewer go from any of them to the statement and back.

A command without a ``traceparent`` begins a trace of its own: its span starts before the pause it answers
is read, so it cannot be that pause's child. The run it claims still continues in the run's trace
(``fleet/run_spans.py``), linked to this span.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

from aio_pika.abc import AbstractIncomingMessage
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from intermission.engine.commands import Claimed
from intermission.engine.observer import on_behalf_of
from intermission.tracing import (
    LINK_PAUSE,
    annotate,
    current_span,
    extracted,
    link,
    open_span,
    recording,
    untraced,
)
from intermission.wire import COMMANDS_EXCHANGE, Command, KeyScopeInvalid

T = TypeVar("T")


def _attributes(message: AbstractIncomingMessage, command: Command) -> dict[str, AttributeValue]:
    routing_key = message.routing_key or command.value
    attributes: dict[str, AttributeValue] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "process",
        "messaging.destination.name": COMMANDS_EXCHANGE,
        "messaging.rabbitmq.destination.routing_key": routing_key,
        "messaging.message.id": message.message_id or "",
        "intermission.command": command.value,
        "intermission.queue": command.queue,
    }
    if message.correlation_id:
        attributes["messaging.message.conversation_id"] = message.correlation_id
    with contextlib.suppress(KeyScopeInvalid):
        scope = command.scope_of_key(routing_key)
        if scope is not None:
            attributes["intermission.app"] = scope.app
            attributes["intermission.tenant"] = scope.tenant
    return attributes


def command_span(message: AbstractIncomingMessage, command: Command) -> contextlib.AbstractContextManager[Span]:
    """The span of one delivery, current within the block: the child of the context its headers carry."""
    return open_span(
        f"{command.value} process",
        parent=extracted(message.headers),
        kind=SpanKind.CONSUMER,
        attributes=_attributes(message, command) if recording() else None,
    )


@contextlib.contextmanager
def transaction_span(command: Command) -> Iterator[Span]:
    """The command's transaction (its read and its transition), a child of the command's span. An exception
    leaving it (a refusal, a duplicate, the database away) is recorded on it: the transaction did not
    commit. Its transitions are the command's work: a statement they share with others links to the
    command's span (``on_behalf_of``)."""
    if not recording():
        with untraced() as span:
            yield span
        return
    with on_behalf_of(current_span()), open_span(f"{command.value} transaction", record_errors=True) as span:
        yield span


def note_claimed(claimed: Claimed) -> None:
    """The current command's span claimed ``claimed``: name the run, and link to the pause it answered."""
    span = current_span()
    if not span.is_recording():
        return
    annotate(span, {"intermission.run_id": claimed.run.id})
    if claimed.suspension is not None:
        link(span, claimed.suspension.continuation.traceparent, LINK_PAUSE)
