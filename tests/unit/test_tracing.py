"""The propagation helpers (intermission/tracing.py), the log filter that names the trace (fleet/logs.py),
and which exporter the OTEL_* variables ask for (fleet/telemetry.py)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from intermission.engine import events as outbox
from intermission.fleet.logs import json_handler
from intermission.fleet.telemetry import TracingMisconfigured, exporters_asked
from intermission.fleet.telemetry import _otlp_exporter as otlp_exporter
from intermission.tracing import (
    current_traceparent,
    extracted,
    headers_with_trace,
    parsed,
    trace_id_of,
    traceparent_of,
)
from intermission.wire import SCHEMA_VERSION, SCHEMA_VERSION_HEADER, TRACEPARENT_HEADER

ROOT = Path(__file__).resolve().parents[2]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_traceparent_parses_and_formats_back_the_same() -> None:
    found = parsed(TRACEPARENT)
    assert found is not None
    assert found.is_remote
    assert found.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert found.span_id == 0x00F067AA0BA902B7
    assert found.trace_flags == TraceFlags.SAMPLED
    assert traceparent_of(found) == TRACEPARENT
    assert trace_id_of(TRACEPARENT) == "4bf92f3577b34da6a3ce929d0e0e4736"
    # Not sampled stays not sampled.
    unsampled = TRACEPARENT[:-2] + "00"
    assert traceparent_of(parsed(unsampled) or trace.INVALID_SPAN_CONTEXT) == unsampled


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {},
        {SCHEMA_VERSION_HEADER: 1},
        {TRACEPARENT_HEADER: ""},
        {TRACEPARENT_HEADER: "not a traceparent"},
        {TRACEPARENT_HEADER: "00-00000000000000000000000000000000-00f067aa0ba902b7-01"},  # an invalid trace id
        {TRACEPARENT_HEADER: "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"},  # an invalid span id
        {TRACEPARENT_HEADER: "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},  # a forbidden version
        # The sender's word, in any type an AMQP table can hold: ignored, never an error.
        {TRACEPARENT_HEADER: TRACEPARENT.encode()},
        {TRACEPARENT_HEADER: bytearray(TRACEPARENT.encode())},
        {TRACEPARENT_HEADER: 42},
        {TRACEPARENT_HEADER: [TRACEPARENT]},
        {TRACEPARENT_HEADER: {"traceparent": TRACEPARENT}},
        {TRACEPARENT_HEADER: None},
    ],
)
def test_headers_without_a_usable_traceparent_carry_no_context(headers: dict[str, object] | None) -> None:
    assert extracted(headers) is None


def test_a_commands_headers_carry_its_context_with_its_tracestate() -> None:
    found = extracted({SCHEMA_VERSION_HEADER: 1, TRACEPARENT_HEADER: TRACEPARENT, "tracestate": "vendor=abc"})
    assert found is not None
    assert traceparent_of(found) == TRACEPARENT
    assert found.trace_state.get("vendor") == "abc"


def test_an_events_headers_get_a_traceparent_only_when_there_is_one() -> None:
    headers: dict[str, str | int | bool | float] = {SCHEMA_VERSION_HEADER: SCHEMA_VERSION}
    headers_with_trace(headers, None)
    assert headers == {SCHEMA_VERSION_HEADER: SCHEMA_VERSION}
    headers_with_trace(headers, TRACEPARENT)
    assert headers == {SCHEMA_VERSION_HEADER: SCHEMA_VERSION, TRACEPARENT_HEADER: TRACEPARENT}


def test_outbox_events_carry_the_traceparent_they_are_given() -> None:
    from intermission.schemas.events import RunEvent, RunEventKind
    from intermission.schemas.scope import Scope

    event = RunEvent(kind=RunEventKind.COMPLETED, run_id="r", revision=2, scope=Scope(app="a", tenant="t"))
    assert TRACEPARENT_HEADER not in outbox.run_event(event, None).headers
    traced = outbox.run_event(event, None, traceparent=TRACEPARENT)
    assert traced.headers[TRACEPARENT_HEADER] == TRACEPARENT
    # The hand-over publishes exactly what the row holds: the headers survive the transition's row.
    *_, headers = traced.columns()
    assert json.loads(headers) == traced.headers


def test_the_current_context_is_the_traceparent_to_carry() -> None:
    assert current_traceparent() is None
    span_context = parsed(TRACEPARENT)
    assert span_context is not None
    with trace.use_span(NonRecordingSpan(span_context)):
        assert current_traceparent() == TRACEPARENT
    assert current_traceparent() is None


def test_a_log_record_made_in_a_span_names_its_trace_and_span() -> None:
    stream = io.StringIO()
    logger = logging.getLogger("intermission.test_tracing")
    logger.propagate = False
    logger.addHandler(json_handler(stream))
    logger.setLevel(logging.INFO)
    context = SpanContext(trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736, span_id=0x00F067AA0BA902B7, is_remote=False)
    with trace.use_span(NonRecordingSpan(context)):
        logger.info("inside", extra={"action": "inside"})
    logger.info("outside", extra={"action": "outside"})
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert inside["span_id"] == "00f067aa0ba902b7"
    assert "trace_id" not in outside
    assert "span_id" not in outside


@pytest.mark.parametrize(
    ("environ", "asked"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
    ],
)
def test_the_otel_variables_name_the_exporters(environ: dict[str, str], asked: list[str]) -> None:
    assert exporters_asked(environ) == asked


def test_an_exporter_this_installation_has_not_is_refused_by_name() -> None:
    with pytest.raises(TracingMisconfigured, match="OTEL_TRACES_EXPORTER: zipkin"):
        exporters_asked({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(TracingMisconfigured, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_the_otlp_exporter_is_the_extras_http_one_by_default() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    made = otlp_exporter({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    assert isinstance(made, OTLPSpanExporter)


# Without any tracer provider (a process of its own: the tests may have installed one in this one), a
# command's traceparent is carried through to what the run writes, and nothing records.
_WITHOUT_A_PROVIDER = f"""
from opentelemetry import trace
from intermission.tracing import open_span, current_traceparent, extracted, recording, started_span, use
from intermission.consumers.command_spans import transaction_span
from intermission.fleet.run_spans import continuing
from intermission.schemas.run import Run, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Continuation, Progress
from intermission.wire import Command

assert not recording()
host = extracted({{"traceparent": "{TRACEPARENT}"}})
with open_span("run.start process", parent=host) as span:
    assert not span.is_recording()
    with transaction_span(Command.START), open_span("run.step"):
        assert current_traceparent() == "{TRACEPARENT}"
with open_span("nothing"):
    assert current_traceparent() is None
batched = started_span("run.resume process", parent=host)
with use(batched):
    assert current_traceparent() == "{TRACEPARENT}"
# A run resumed by a command without a trace continues the trace its pause recorded.
scope = Scope(app="a", tenant="t")
run = Run(id="r", scope=scope, agent_id="demo", state=RunState.RUNNING, revision=1)
progress = Progress(run_id="r", owner="w", continuation=Continuation(traceparent="{TRACEPARENT}"))
with continuing(run, progress):
    assert current_traceparent() == "{TRACEPARENT}"
print("ok")
"""


def test_without_a_tracer_provider_a_traceparent_is_carried_through_and_nothing_records() -> None:
    done = subprocess.run(  # noqa: S603 - our own interpreter and script
        [sys.executable, "-c", _WITHOUT_A_PROVIDER], cwd=ROOT, capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok"


_INSTALLING = """
import os
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from intermission.fleet.telemetry import install_tracing
from intermission.tracing import open_span, recording

assert not install_tracing("intermission-worker", {})  # nothing asked: the API's no-op stays
assert not recording()
environ = dict(os.environ, OTEL_TRACES_EXPORTER="console")
os.environ.pop("OTEL_SERVICE_NAME", None)
assert install_tracing("intermission-sweeper", environ)
provider = trace.get_tracer_provider()
assert isinstance(provider, TracerProvider)
assert provider.resource.attributes["service.name"] == "intermission-sweeper"
assert recording()
with open_span("probe") as span:
    assert span.is_recording()
print("ok")
"""


def test_a_process_installs_the_sdk_only_when_an_exporter_is_named() -> None:
    done = subprocess.run(  # noqa: S603 - our own interpreter and script
        [sys.executable, "-c", _INSTALLING],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        # The console exporter prints the probe span (as JSON) when the process exits.
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "ok"
    assert '"name": "probe"' in done.stdout
