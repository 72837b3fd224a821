"""The spans of commands: one CONSUMER span per delivery, in the trace its ``traceparent`` header names.

``AckPolicy`` opens a command's span around everything it does with the delivery (``command_span``), so
the command's transaction (``transaction_span``, opened by ``CommandHandlers.apply``), its refusal and the
run it hands to the fleet happen in it: the fleet's task copies the context it was created in, so the run's
continuation starts as this span's child (``fleet/run_spans.py``). The outcome the policy reports for
metrics is also set on the span (``observed``), and a claim links the span to the span of the pause it
answered (``note_claimed``), whose ``traceparent`` the pause stored with itself.

Group commit (``AckPolicy.process_batch``): each command still has its own span (``BatchSpans``); the ONE
transaction they share gets one span of its own, a root, linked to each command's span, and each
command's span links back to it. It cannot be the child of all of them (a span has one parent), and
making it the child of one would put the others' work in a stranger's trace; links keep every command in
its own trace and let a viewer go from any of them to the transaction and back.

A command without a ``traceparent`` begins a trace of its own: its span starts before the pause it answers
is read, so it cannot be that pause's child. The run it claims still continues in the run's trace
(``fleet/run_spans.py``), linked to this span.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TypeVar

from aio_pika.abc import AbstractIncomingMessage
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from intermission.store.commands import Claimed
from intermission.tracing import (
    LINK_BATCH,
    LINK_COMMAND,
    LINK_PAUSE,
    annotate,
    current_span,
    extracted,
    failed,
    link,
    open_span,
    recording,
    started_span,
    untraced,
    use,
)
from intermission.wire import COMMANDS_EXCHANGE, Command, KeyScopeInvalid

T = TypeVar("T")

# Outcomes (AckPolicy.observe) that say the worker could not handle the command, not that the command was
# refused: the span is marked failed.
_FAILURES = frozenset({"requeued", "dead_lettered"})


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


def transaction_span(command: Command) -> contextlib.AbstractContextManager[Span]:
    """The command's transaction (its read and its transition), a child of the command's span. An exception
    leaving it (a refusal, a duplicate, the database away) is recorded on it: the transaction did not
    commit."""
    if not recording():
        return untraced()
    return open_span(f"{command.value} transaction", record_errors=True)


def observed(observe: Callable[[Command, str, str], None]) -> Callable[[Command, str, str], None]:
    """``observe`` (the policy's report of each delivery's outcome, for metrics) that also sets the outcome on
    the command's span, which is current wherever the policy reports it."""

    def traced(command: Command, outcome: str, code: str) -> None:
        span = current_span()
        if span.is_recording():
            span.set_attribute("intermission.outcome", outcome)
            if code:
                span.set_attribute("error.type", code)
            if outcome in _FAILURES:
                failed(span, code or outcome)
        observe(command, outcome, code)

    return traced


def note_claimed(claimed: Claimed) -> None:
    """The current command's span claimed ``claimed``: name the run, and link to the pause it answered."""
    span = current_span()
    if not span.is_recording():
        return
    annotate(span, {"intermission.run_id": claimed.run.id})
    if claimed.suspension is not None:
        link(span, claimed.suspension.continuation.traceparent, LINK_PAUSE)


class BatchSpans:
    """The spans of a batch's commands (see the module docstring), ended by ``end``."""

    __slots__ = ("_spans",)

    def __init__(self) -> None:
        self._spans: dict[int, Span] = {}

    def start(self, message: AbstractIncomingMessage, command: Command) -> None:
        self._spans[id(message)] = started_span(
            f"{command.value} process",
            parent=extracted(message.headers),
            kind=SpanKind.CONSUMER,
            attributes=_attributes(message, command) if recording() else None,
        )

    @contextlib.contextmanager
    def transaction(self, size: int) -> Iterator[None]:
        """The batch's one transaction: a span linked to each command's span and linked from each; not made
        current, so nothing of one command is written in the trace of another."""
        if not recording():
            yield
            return
        spans = list(self._spans.values())
        shared = started_span(
            "commands transaction",
            attributes={"intermission.batch.size": size},
            links=[(span.get_span_context(), LINK_COMMAND) for span in spans],
        )
        for span in spans:
            if span.is_recording():
                span.add_link(shared.get_span_context(), {"intermission.link": LINK_BATCH})
        try:
            yield
        except BaseException as exc:
            shared.record_exception(exc)
            failed(shared, type(exc).__name__)
            raise
        finally:
            shared.end()

    def current(self, message: AbstractIncomingMessage) -> contextlib.AbstractContextManager[Span]:
        """The command's span, current within the block (not ended)."""
        span = self._spans.get(id(message))
        return use(span) if span is not None else contextlib.nullcontext(current_span())

    async def within(self, message: AbstractIncomingMessage, work: Awaitable[T]) -> T:
        with self.current(message):
            return await work

    def end(self, messages: Iterable[AbstractIncomingMessage] | None = None) -> None:
        """End the spans of ``messages`` (every one's when None)."""
        for key in [id(m) for m in messages] if messages is not None else list(self._spans):
            span = self._spans.pop(key, None)
            if span is not None:
                span.end()
