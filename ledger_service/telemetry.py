"""OpenTelemetry for the server process, configured once at start from the
standard OTEL_* environment variables (docs/observability.md).

- OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER: `none` (the default), `console`
  (to stderr, so stdout keeps the server's own lines) or `otlp` (gRPC), or a
  comma-separated list of them.
- `otlp` only where the operator named a collector: OTEL_EXPORTER_OTLP_ENDPOINT
  (or the signal's own OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
  OTEL_EXPORTER_OTLP_METRICS_ENDPOINT). Without one the server refuses to start
  rather than send to a default address nobody chose.
- OTEL_SERVICE_NAME (default `lane-ledger`), OTEL_TRACES_SAMPLER,
  OTEL_METRIC_EXPORT_INTERVAL and the OTLP exporter's own variables (headers,
  certificate, timeout) are read as the SDK reads them.

No exporter costs nearly nothing: the tracer then has no span processor and
samples nothing, so spans are non-recording (they still carry trace ids, which
the ledger stores on its events), and there is no meter at all.

The providers are the server's own, not OpenTelemetry's global ones, so that
several servers in one process (tests) each keep theirs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
from collections.abc import Mapping

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

INSTRUMENTATION_NAME = "ledger_service"
DEFAULT_SERVICE_NAME = "lane-ledger"
EXPORTERS = ("otlp", "console", "none")
# Bounds the wait for the last batch at shutdown.
SHUTDOWN_TIMEOUT_MILLIS = 5_000


def _version() -> str:
    try:
        return importlib.metadata.version("ledger-service")
    except importlib.metadata.PackageNotFoundError:
        return "0"


@dataclasses.dataclass(frozen=True)
class Telemetry:
    """The server's tracer provider and, when metrics are exported, its meter provider."""

    tracer_provider: TracerProvider
    meter_provider: MeterProvider | None = None

    @property
    def tracer(self) -> trace.Tracer:
        return self.tracer_provider.get_tracer(INSTRUMENTATION_NAME, _version())

    @property
    def meter(self) -> metrics.Meter | None:
        """None when nothing reads metrics: then the server measures nothing."""
        if self.meter_provider is None:
            return None
        return self.meter_provider.get_meter(INSTRUMENTATION_NAME, _version())

    def shutdown(self) -> None:
        """Exports what is still buffered and stops the exporters."""
        self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown(timeout_millis=SHUTDOWN_TIMEOUT_MILLIS)


def exporters_named(environ: Mapping[str, str], variable: str) -> tuple[str, ...]:
    """The exporters an OTEL_*_EXPORTER variable names; none when unset."""
    names = [name.strip().lower() for name in environ.get(variable, "none").split(",")]
    unknown = [name for name in names if name and name not in EXPORTERS]
    if unknown:
        raise ValueError(
            f"{variable}={environ.get(variable, '')!r}: unknown exporter {unknown[0]!r} "
            f"(use {', '.join(EXPORTERS)})"
        )
    return tuple(dict.fromkeys(name for name in names if name and name != "none"))


def _otlp_endpoint(environ: Mapping[str, str], signal: str) -> str:
    endpoint = environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint:
        raise ValueError(
            f"OTEL_{signal}_EXPORTER=otlp needs OTEL_EXPORTER_OTLP_ENDPOINT (the collector's "
            "address, e.g. http://127.0.0.1:4317)"
        )
    return endpoint


def _span_processors(environ: Mapping[str, str]) -> list[SpanProcessor]:
    processors: list[SpanProcessor] = []
    for name in exporters_named(environ, "OTEL_TRACES_EXPORTER"):
        if name == "console":
            processors.append(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=_otlp_endpoint(environ, "TRACES"))
            processors.append(BatchSpanProcessor(exporter))
    return processors


def _metric_readers(environ: Mapping[str, str]) -> list[MetricReader]:
    readers: list[MetricReader] = []
    for name in exporters_named(environ, "OTEL_METRICS_EXPORTER"):
        exporter: MetricExporter
        if name == "console":
            exporter = ConsoleMetricExporter(out=sys.stderr)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter,
            )

            exporter = OTLPMetricExporter(endpoint=_otlp_endpoint(environ, "METRICS"))
        readers.append(PeriodicExportingMetricReader(exporter))
    return readers


def configure_telemetry(
    environ: Mapping[str, str] | None = None,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Telemetry:
    """The server's telemetry, from OTEL_* variables (default: os.environ).

    `span_exporter` and `metric_reader` are added to what the variables name,
    for tests (the SDK's in-memory exporter and reader). Raises ValueError on a
    setting it cannot honour.
    """
    environ = os.environ if environ is None else environ
    resource = Resource.create(
        {
            "service.name": environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
            "service.version": _version(),
        }
    )
    processors = _span_processors(environ)
    if span_exporter is not None:
        processors.append(SimpleSpanProcessor(span_exporter))
    readers = _metric_readers(environ)
    if metric_reader is not None:
        readers.append(metric_reader)
    tracer_provider = TracerProvider(
        # Nothing would read a recorded span: record none, but keep the trace ids.
        sampler=None if processors else ALWAYS_OFF,
        resource=resource,
        shutdown_on_exit=False,
        meter_provider=metrics.NoOpMeterProvider(),
    )
    for processor in processors:
        tracer_provider.add_span_processor(processor)
    meter_provider = (
        MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
        if readers
        else None
    )
    return Telemetry(tracer_provider, meter_provider)
