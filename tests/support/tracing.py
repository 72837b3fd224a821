"""The SDK's tracer provider with an in-memory exporter, for the tests that read the spans a run made.

A process has ONE tracer provider, set once: the first test that asks installs it and it stays for the rest
of the session. It records (and the code under test takes its recording path) from then on, but keeps
finished spans only inside ``recorded()``, so the tests after it do not fill memory with spans nobody reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class _Switched(SimpleSpanProcessor):
    """Exports a finished span only while ``on``."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        super().__init__(exporter)
        self.on = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.on:
            super().on_end(span)


_exporter = InMemorySpanExporter()
_processor = _Switched(_exporter)
_provider = TracerProvider()
_provider.add_span_processor(_processor)


def _install() -> None:
    if trace.get_tracer_provider() is not _provider:
        trace.set_tracer_provider(_provider)
    if trace.get_tracer_provider() is not _provider:
        raise RuntimeError("another tracer provider was installed in this process before the tests' own")


@contextmanager
def recorded() -> Iterator[InMemorySpanExporter]:
    """The exporter that holds every span finished within the block (and only those)."""
    _install()
    _exporter.clear()
    _processor.on = True
    try:
        yield _exporter
    finally:
        _processor.on = False
        _exporter.clear()
