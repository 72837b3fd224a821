"""Trace context across messages: the W3C ``traceparent`` of commands, stored pauses and events, and the
spans every layer opens, over the OpenTelemetry API only.

A run has ONE trace: the trace of the ``run.start`` that began it (the host's, when its command carried a
``traceparent``; otherwise one the worker begins). It outlives any one process because the run records
the span context it is in, as a ``traceparent`` string, in its stored continuation
(``Continuation.traceparent``): the start writes it with the run's first snapshot, and every pause writes
the pause's own span context with the pause. Whatever continues the run later (a resume on another worker
days later, a takeover after a crash) reads it back and continues that trace; every event the run causes
carries a ``traceparent`` of it.

Without an SDK (the ``tracing`` extra not installed, or no exporter configured: ``fleet/telemetry.py``) the
API's tracer is a no-op. Nothing here then creates a span object: ``open_span`` makes the PARENT current
(the command's extracted context, the run's recorded one) as the API's non-recording span, so a
``traceparent`` still travels from a command to the run's events and its stored pause, and log lines name
the trace id; and a command that carries none costs a dictionary lookup.

This module is the contract's neighbour (``intermission/wire.py``): every layer may import it, and it
imports nothing of ours but the header's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from intermission.wire import TRACEPARENT_HEADER

# The instrumentation scope every span of Intermission is created under.
TRACER_NAME: Final = "intermission"

# A ProxyTracer: it follows the tracer provider a process installs later (fleet/telemetry.py).
_tracer = trace.get_tracer(TRACER_NAME)
_propagator = TraceContextTextMapPropagator()

# Link attributes that say what a link means.
LINK_KIND: Final = "intermission.link"
LINK_PAUSE: Final = "pause"
LINK_COMMAND: Final = "command"
LINK_TAKEN_OVER: Final = "taken_over"
LINK_BATCH: Final = "batch_transaction"

_NOTHING: Final = contextlib.nullcontext(trace.INVALID_SPAN)


class _StringHeaders(Getter[Mapping[str, object]]):
    """AMQP headers as the propagator reads them: only string values. A header table is the sender's word
    (a ``traceparent`` that is a number, a byte array or a table is ignored, never an error)."""

    def get(self, carrier: Mapping[str, object], key: str) -> list[str] | None:
        value = carrier.get(key)
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, object]) -> list[str]:
        return [key for key in carrier if isinstance(key, str)]


_headers = _StringHeaders()


_NOT_RECORDING: Final = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
# A process installs its tracer provider once (the API refuses a second), so once one records, it always will.
_installed = False


def recording() -> bool:
    """Whether a tracer provider that records spans is installed (the SDK, configured by the operator).

    Asked several times per command, so it reads the API's global as the API's own ProxyTracer does:
    ``get_tracer_provider()`` looks the environment up on every call while none is installed (about a
    microsecond), which would be most of what tracing costs a worker that exports nothing."""
    global _installed
    if not _installed:
        provider = trace._TRACER_PROVIDER
        _installed = provider is not None and not isinstance(provider, _NOT_RECORDING)
    return _installed


# --- traceparent <-> span context ---------------------------------------------------------------------


def extracted(headers: Mapping[str, object] | None) -> SpanContext | None:
    """The span context a message's headers carry (W3C ``traceparent``, and ``tracestate`` with it), or None:
    absent, malformed, or not a string."""
    if not headers or TRACEPARENT_HEADER not in headers:
        return None
    context = _propagator.extract(headers, getter=_headers)
    found = trace.get_current_span(context).get_span_context()
    return found if found.is_valid else None


def parsed(traceparent: str | None) -> SpanContext | None:
    """A stored ``traceparent`` as a (remote) span context, or None."""
    return extracted({TRACEPARENT_HEADER: traceparent}) if traceparent else None


def traceparent_of(span_context: SpanContext) -> str | None:
    """The W3C ``traceparent`` of a span context (None when it is not valid)."""
    if not span_context.is_valid:
        return None
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{span_context.trace_flags:02x}"


def current_traceparent() -> str | None:
    """The ``traceparent`` of the span current here (a recording span, or the non-recording context a
    command or a run carried in), None when there is none."""
    return traceparent_of(trace.get_current_span().get_span_context())


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id (32 hex digits) a ``traceparent`` names, None when it is not one."""
    found = parsed(traceparent)
    return f"{found.trace_id:032x}" if found is not None else None


def headers_with_trace(headers: dict[str, str | int | bool | float], traceparent: str | None) -> None:
    """Add ``traceparent`` to an event's header table when there is one (no header at all otherwise)."""
    if traceparent:
        headers[TRACEPARENT_HEADER] = traceparent


# --- spans --------------------------------------------------------------------------------------------


def open_span(
    name: str,
    *,
    parent: SpanContext | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue] | None = None,
    links: Sequence[tuple[SpanContext, str]] = (),
    record_errors: bool = False,
) -> contextlib.AbstractContextManager[Span]:
    """A span named ``name``, current within the block and ended after it.

    ``parent`` is its parent span context (a remote one: a command's, a run's recorded one); None makes it
    the child of the span current here. ``links`` are ``(span context, what the link means)``.

    ``record_errors`` false (the run's spans): an exception leaving the block is not an error of the span,
    since a run leaves its steps by exceptions that are no failure (a pause, a stop at a boundary, an end
    asked for); whoever knows it failed says so (``failed``).

    Without a recording provider no span is created: the block runs with ``parent`` current (as the API's
    non-recording span) when one is given, else as it is.
    """
    if not recording():
        if parent is None:
            return _NOTHING
        return trace.use_span(NonRecordingSpan(parent), end_on_exit=False)
    context: Context | None = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else None
    span = _tracer.start_span(
        name,
        context=context,
        kind=kind,
        attributes=attributes,
        links=[Link(linked, {LINK_KIND: what}) for linked, what in links if linked.is_valid] or None,
    )
    return trace.use_span(span, end_on_exit=True, record_exception=record_errors, set_status_on_exception=record_errors)


def started_span(
    name: str,
    *,
    parent: SpanContext | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue] | None = None,
    links: Iterable[tuple[SpanContext, str]] = (),
) -> Span:
    """A span that is not made current: its caller ends it (``span.end()``). Without a recording provider,
    the non-recording span of ``parent`` (or the invalid span), which ending does nothing to."""
    if not recording():
        return NonRecordingSpan(parent) if parent is not None else trace.INVALID_SPAN
    context = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else Context()
    return _tracer.start_span(
        name,
        context=context,
        kind=kind,
        attributes=attributes,
        links=[Link(linked, {LINK_KIND: what}) for linked, what in links if linked.is_valid] or None,
    )


def current_span() -> Span:
    return trace.get_current_span()


def untraced() -> contextlib.AbstractContextManager[Span]:
    """A block that opens no span (what ``open_span`` is when nothing records and there is no parent)."""
    return _NOTHING


def annotate(span: Span, attributes: Mapping[str, AttributeValue]) -> None:
    """Set attributes on a span that records (nothing is built for one that does not)."""
    if span.is_recording():
        span.set_attributes(attributes)


def link(span: Span, traceparent: str | None, what: str) -> None:
    """Link a recording span to the span a stored ``traceparent`` names (a pause's), when there is one."""
    if traceparent and span.is_recording():
        linked = parsed(traceparent)
        if linked is not None:
            span.add_link(linked, {LINK_KIND: what})


def failed(span: Span, description: str) -> None:
    """Mark a recording span as failed, with why."""
    if span.is_recording():
        span.set_status(trace.Status(trace.StatusCode.ERROR, description))


def use(span: Span) -> contextlib.AbstractContextManager[Span]:
    """Make a span started with ``started_span`` current within a block, without ending it."""
    if not span.get_span_context().is_valid:
        return _NOTHING
    return trace.use_span(span, end_on_exit=False)


def tool_span(name: str, call_id: str, *, retry_safe: bool) -> contextlib.AbstractContextManager[Span]:
    """A tool call's span (OpenTelemetry's GenAI conventions: ``execute_tool <name>``), a child of the step
    that made the call. A tool that fails is marked by its caller (``failed``)."""
    if not recording():
        return _NOTHING
    return open_span(
        f"execute_tool {name}",
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
            "intermission.tool.retry_safe": retry_safe,
        },
    )
