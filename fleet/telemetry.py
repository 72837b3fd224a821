"""Exporting spans: the SDK's tracer provider, installed at process start only when the operator asks for it.

Intermission itself depends on the OpenTelemetry API alone (``intermission/tracing.py``): with nothing
installed here its tracer is the API's no-op, and a ``traceparent`` is only carried through. A worker or a
sweeper calls ``install_tracing`` first thing; it installs the SDK (the ``tracing`` extra) when the
standard variables name an exporter:

- ``OTEL_TRACES_EXPORTER``: ``otlp`` and/or ``console`` (comma-separated), or ``none``. Unset, spans are
  exported by OTLP when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and not at all otherwise. (The specification's default is
  ``otlp`` even unset; a fleet that exported to a collector nobody runs would pay for it for nothing.)
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``http/protobuf`` (the default,
  the extra's exporter) or ``grpc`` (needs ``opentelemetry-exporter-otlp-proto-grpc`` installed beside it).
  The endpoint, headers, timeout and compression are the exporter's own ``OTEL_EXPORTER_OTLP_*``.
- ``OTEL_SERVICE_NAME`` (or ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``), else ``intermission-worker``
  or ``intermission-sweeper``; ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*`` and ``OTEL_SDK_DISABLED`` as the SDK
  reads them.

A variable that asks for what cannot be done (an unknown exporter, the SDK not installed) stops the process
at start, naming it, as a bad setting of Intermission's own does. Spans are exported in batches from a
thread of the SDK's; the provider flushes them when the process exits.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Final

log = logging.getLogger("intermission.telemetry")

WORKER_SERVICE: Final = "intermission-worker"
SWEEPER_SERVICE: Final = "intermission-sweeper"

_EXPORTERS: Final = frozenset({"otlp", "console", "none"})


class TracingMisconfigured(ValueError):
    """The OTEL_* variables ask for tracing this installation cannot do."""


def exporters_asked(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the environment asks for (empty: none, and nothing is installed)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not named:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    asked = [name.strip() for name in named.split(",") if name.strip()]
    unknown = sorted(set(asked) - _EXPORTERS)
    if unknown:
        raise TracingMisconfigured(
            f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not an exporter this installation has "
            "(otlp, console or none)"
        )
    return [name for name in asked if name != "none"]


def _otlp_exporter(environ: Mapping[str, str]) -> Any:
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip() or "http/protobuf"
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError as exc:
            raise TracingMisconfigured(
                "OTEL_EXPORTER_OTLP_PROTOCOL: grpc needs opentelemetry-exporter-otlp-proto-grpc installed"
            ) from exc
        return GrpcSpanExporter()
    raise TracingMisconfigured(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not http/protobuf or grpc")


def install_tracing(default_service_name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Install the SDK's tracer provider with the exporters the environment asks for; whether it did.
    Call it once, at process start, before any span is made (a process has one tracer provider)."""
    environ = os.environ if environ is None else environ
    asked = exporters_asked(environ)
    if not asked:
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise TracingMisconfigured(
            f"OTEL_TRACES_EXPORTER: exporting spans ({', '.join(asked)}) needs the tracing extra: "
            "pip install 'intermission[tracing]'"
        ) from exc
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource)
    for name in asked:
        exporter = _otlp_exporter(environ) if name == "otlp" else ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info(
        "tracing: exporting spans",
        extra={"action": "tracing_installed", "exporters": asked, "service": resource.attributes.get(SERVICE_NAME)},
    )
    return True
