"""JSON logs: every record carries a stable ``action`` name and, where it has them, the run id and scope;
a record made while a span is current carries its ``trace_id`` and ``span_id`` (``TraceIds``), so the log
lines of a run name the run's trace."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter


class TraceIds(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` (lowercase hex, as in a ``traceparent``) to a record made while a
    span is current: a recording one, or the context a command or a run carried in when nothing records
    (intermission/tracing.py). Records made outside any trace are left as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            record.trace_id = f"{span_context.trace_id:032x}"
            record.span_id = f"{span_context.span_id:016x}"
        return True


def json_handler(stream: TextIO) -> logging.Handler:
    """A handler writing one JSON object per record to ``stream``, with the trace ids of ``TraceIds``."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s", rename_fields={"levelname": "level"})
    )
    handler.addFilter(TraceIds())
    return handler


def configure(level: str = "INFO") -> None:
    root = logging.getLogger()
    root.handlers[:] = [json_handler(sys.stderr)]
    root.setLevel(level.upper())
    # aio-pika and aiormq narrate every reconnect attempt at INFO.
    logging.getLogger("aiormq").setLevel(logging.WARNING)
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
