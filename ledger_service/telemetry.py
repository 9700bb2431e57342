"""OpenTelemetry for the server process, configured once at start from the
standard OTEL_* environment variables (docs/observability.md).

- OTEL_TRACES_EXPORTER: `none` (the default), `console` (to stderr, so stdout
  keeps the server's own lines) or `otlp`, or a comma-separated list of them.
  OTEL_METRICS_EXPORTER: the same, and `prometheus`: a scrape endpoint on
  OTEL_EXPORTER_PROMETHEUS_HOST:OTEL_EXPORTER_PROMETHEUS_PORT (localhost:9464).
- `otlp` speaks OTEL_EXPORTER_OTLP_PROTOCOL (or the signal's own
  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / ..._METRICS_PROTOCOL): `grpc` (the
  default) or `http/protobuf`, through the SDK's own exporters, and only where
  the operator named a collector: OTEL_EXPORTER_OTLP_ENDPOINT (over HTTP the
  signal's path, /v1/traces or /v1/metrics, is appended) or the signal's own
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / ..._METRICS_ENDPOINT, taken as it is.
  Without one the server refuses to start rather than send to a default
  address nobody chose.
- OTEL_SERVICE_NAME (default `lane-ledger`), OTEL_TRACES_SAMPLER,
  OTEL_METRIC_EXPORT_INTERVAL and the OTLP exporters' own variables (headers,
  certificate, timeout) are read as the SDK reads them.

`Telemetry.description` says what is active; the server logs it at start.

No exporter costs nearly nothing: the tracer then has no span processor and
samples nothing, so spans are non-recording (they still carry trace ids, which
the ledger stores on its events), and there is no meter at all.

The providers are the server's own, not OpenTelemetry's global ones, so that
several servers in one process (tests) each keep theirs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import math
import os
import re
import sys
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

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
METRIC_EXPORTERS = (*EXPORTERS, "prometheus")
PROTOCOLS = ("grpc", "http/protobuf")
# OTLP over HTTP: the path of each signal under OTEL_EXPORTER_OTLP_ENDPOINT.
HTTP_PATHS = {"TRACES": "v1/traces", "METRICS": "v1/metrics"}
# The variable behind each argument of the SDK's BatchSpanProcessor (which reads os.environ).
_BSP_VARIABLES = {
    "max_queue_size": "OTEL_BSP_MAX_QUEUE_SIZE",
    "schedule_delay_millis": "OTEL_BSP_SCHEDULE_DELAY",
    "max_export_batch_size": "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
}
PROMETHEUS_HOST = "localhost"
PROMETHEUS_PORT = 9464
# Bounds the wait for the last batches (spans and metrics together) at shutdown.
SHUTDOWN_TIMEOUT_MILLIS = 5_000

log = logging.getLogger("ledger.server")


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
    # What is exported where, for the start-up log line.
    description: str = "traces: none; metrics: none"
    # Stops what serves a scrape (Prometheus), at shutdown.
    closers: tuple[Callable[[], None], ...] = ()
    # False when the tracer records no span (nothing would read one): then
    # what a span would carry is never gathered (api/tracing.py).
    records_spans: bool = True

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
        """Exports what is still buffered and stops the exporters, waiting at
        most SHUTDOWN_TIMEOUT_MILLIS in all: the SDK waits up to 30 s for a
        collector that does not answer, and the process must not wait with it.
        What is left then is dropped (its thread is a daemon)."""
        failed: list[BaseException] = []
        flushing = threading.Thread(
            target=self._flush, args=(failed,), name="telemetry-shutdown", daemon=True
        )
        flushing.start()
        flushing.join(SHUTDOWN_TIMEOUT_MILLIS / 1000)
        for close in self.closers:
            close()
        if flushing.is_alive():
            log.warning(
                "telemetry: the collector took no last batch within %.1f s: the buffered "
                "telemetry is dropped",
                SHUTDOWN_TIMEOUT_MILLIS / 1000,
            )
        elif failed:
            raise failed[0]

    def _flush(self, failed: list[BaseException]) -> None:
        try:
            self.tracer_provider.shutdown()
            if self.meter_provider is not None:
                self.meter_provider.shutdown(timeout_millis=SHUTDOWN_TIMEOUT_MILLIS)
        except Exception as error:  # raised again by shutdown(), in the caller's thread
            failed.append(error)


def exporters_named(
    environ: Mapping[str, str], variable: str, known: tuple[str, ...] = EXPORTERS
) -> tuple[str, ...]:
    """The exporters an OTEL_*_EXPORTER variable names; none when unset."""
    names = [name.strip().lower() for name in environ.get(variable, "none").split(",")]
    unknown = [name for name in names if name and name not in known]
    if unknown:
        raise ValueError(
            f"{variable}={environ.get(variable, '')!r}: unknown exporter {unknown[0]!r} "
            f"(use {', '.join(known)})"
        )
    return tuple(dict.fromkeys(name for name in names if name and name != "none"))


@dataclasses.dataclass(frozen=True)
class _Otlp:
    """Where and how one signal goes over OTLP."""

    protocol: str
    endpoint: str

    def describe(self) -> str:
        return f"otlp {self.protocol} to {_without_credentials(self.endpoint)}"


def _otlp(environ: Mapping[str, str], signal: str) -> _Otlp:
    # The signal's own variable wins, and is the one a refusal names.
    variable = f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"
    if not environ.get(variable):
        variable = "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = (environ.get(variable) or "grpc").strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"{variable}={protocol!r}: unknown protocol (use grpc or http/protobuf)")
    own = environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    shared = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not (own or shared):
        raise ValueError(
            f"OTEL_{signal}_EXPORTER=otlp needs OTEL_EXPORTER_OTLP_ENDPOINT (the collector's "
            "address, e.g. http://127.0.0.1:4317, or :4318 over http/protobuf)"
        )
    endpoint = own or str(shared)
    _check_endpoint(
        f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT" if own else "OTEL_EXPORTER_OTLP_ENDPOINT",
        endpoint,
        protocol,
    )
    if not own and protocol == "http/protobuf":
        endpoint = _with_path(endpoint, HTTP_PATHS[signal])
    return _Otlp(protocol, endpoint)


# HOST:PORT, which the gRPC exporter takes without a scheme.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}")


def _check_endpoint(variable: str, endpoint: str, protocol: str) -> None:
    """Refuses an endpoint no exporter can send to (no http:// or https://
    scheme and host, or, over gRPC, no HOST:PORT): it would start the server and
    drop every batch. The refusal shows the endpoint without its credentials."""
    try:
        parts = urllib.parse.urlsplit(endpoint.strip())
        if parts.scheme in ("http", "https") and parts.hostname:
            return
        shown = repr(_without_credentials(endpoint)[:100])
    except ValueError:  # an unbalanced '[' of an IPv6 host
        shown = "(not a URL)"
    if protocol == "grpc" and _HOST_PORT.fullmatch(endpoint.strip()):
        return
    wanted = "http://HOST:PORT or https://HOST:PORT" + (
        ", or HOST:PORT" if protocol == "grpc" else ""
    )
    raise ValueError(
        f"{variable}={shown}: not a collector's address over {protocol} (use {wanted})"
    )


def _with_path(url: str, path: str) -> str:
    """`url` with `path` after its own path: before any query or fragment."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{path}"))


def _without_credentials(url: str) -> str:
    """`url` as the start line shows it: without user info, query or fragment,
    where a collector's password, key or token may be (the host keeps its case
    and an IPv6 address its brackets)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query="", fragment=""))


# The SDK's OTLP exporter for each signal and protocol: (module, class).
_OTLP_EXPORTERS = {
    ("TRACES", "grpc"): (
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "OTLPSpanExporter",
    ),
    ("TRACES", "http/protobuf"): (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "OTLPSpanExporter",
    ),
    ("METRICS", "grpc"): (
        "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
        "OTLPMetricExporter",
    ),
    ("METRICS", "http/protobuf"): (
        "opentelemetry.exporter.otlp.proto.http.metric_exporter",
        "OTLPMetricExporter",
    ),
}


def _otlp_exporter(environ: Mapping[str, str], signal: str) -> tuple[Any, str]:
    """The SDK's OTLP exporter the variables name for `signal`, and what it is."""
    otlp = _otlp(environ, signal)
    module, name = _OTLP_EXPORTERS[(signal, otlp.protocol)]
    exporter_class = getattr(importlib.import_module(module), name)
    return exporter_class(endpoint=otlp.endpoint), otlp.describe()


def _span_processors(
    environ: Mapping[str, str], meter_provider: metrics.MeterProvider
) -> tuple[list[SpanProcessor], list[str]]:
    processors: list[SpanProcessor] = []
    described: list[str] = []
    for name in exporters_named(environ, "OTEL_TRACES_EXPORTER"):
        if name == "console":
            processors.append(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
            described.append("console (stderr)")
            continue
        exporter, description = _otlp_exporter(environ, "TRACES")
        processors.append(_batch(exporter, meter_provider))
        described.append(description)
    return processors, described


def _batch(exporter: SpanExporter, meter_provider: metrics.MeterProvider) -> BatchSpanProcessor:
    """The SDK's batching of spans, set by OTEL_BSP_*; a bad value is refused
    naming the variable (the SDK names its own argument). Its own metrics (spans
    dropped on a full queue, when OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true) go
    to the server's meter provider: the global one is never set, so they went nowhere."""
    try:
        return BatchSpanProcessor(exporter, meter_provider=meter_provider)
    except ValueError as error:
        argument = str(error).split(" ", 1)[0]
        variable = _BSP_VARIABLES.get(argument)
        if variable is None:
            raise
        raise ValueError(f"{variable}={os.environ.get(variable, '')!r}: {error}") from error


def _metric_readers(
    environ: Mapping[str, str],
) -> tuple[list[MetricReader], list[str], list[Callable[[], None]]]:
    readers: list[MetricReader] = []
    described: list[str] = []
    closers: list[Callable[[], None]] = []
    for name in exporters_named(environ, "OTEL_METRICS_EXPORTER", METRIC_EXPORTERS):
        if name == "prometheus":
            reader, where, close = _prometheus(environ)
            readers.append(reader)
            described.append(f"prometheus on http://{where}/metrics")
            closers.append(close)
            continue
        exporter: MetricExporter
        if name == "console":
            exporter, description = ConsoleMetricExporter(out=sys.stderr), "console (stderr)"
        else:
            exporter, description = _otlp_exporter(environ, "METRICS")
        readers.append(PeriodicExportingMetricReader(exporter))
        described.append(description)
    return readers, described, closers


def _prometheus(environ: Mapping[str, str]) -> tuple[MetricReader, str, Callable[[], None]]:
    """A reader whose metrics are scraped, and the HTTP server that serves them."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, start_http_server

    host = environ.get("OTEL_EXPORTER_PROMETHEUS_HOST") or PROMETHEUS_HOST
    text = environ.get("OTEL_EXPORTER_PROMETHEUS_PORT") or str(PROMETHEUS_PORT)
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"OTEL_EXPORTER_PROMETHEUS_PORT={text!r}: not a port")
    reader = PrometheusMetricReader()
    try:
        server, thread = start_http_server(int(text), addr=host)
    except OSError as error:
        REGISTRY.unregister(reader._collector)
        raise ValueError(
            f"cannot serve Prometheus metrics on {host}:{text}: {error.strerror}"
        ) from error
    port = server.server_address[1]

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return reader, f"{host}:{port}", close


# The SDK's numbers that the server's readers, batcher and exporters read, and
# how the SDK parses each. A malformed one only warned ("Found invalid value for
# export interval, using default") or raised unnamed, and the server ran on a
# value nobody chose: it stops the start, naming the variable.
_EXPORT_INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL"
_NUMBER_VARIABLES: dict[str, Callable[[str], float]] = {
    _EXPORT_INTERVAL: float,
    "OTEL_METRIC_EXPORT_TIMEOUT": float,
    "OTEL_BSP_SCHEDULE_DELAY": int,
    "OTEL_BSP_MAX_QUEUE_SIZE": int,
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": int,
    "OTEL_BSP_EXPORT_TIMEOUT": int,
    "OTEL_EXPORTER_OTLP_TIMEOUT": float,
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": float,
    "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": float,
}


def _check_numbers(environ: Mapping[str, str]) -> None:
    """Raises ValueError naming the first OTEL_* number that is set but malformed."""
    for variable, parse in _NUMBER_VARIABLES.items():
        text = environ.get(variable, "").strip()
        if not text:
            continue
        try:
            number = parse(text)
        except ValueError:
            number = math.nan
        if variable == _EXPORT_INTERVAL and number == math.inf:
            continue  # the SDK's "no periodic export"
        if not math.isfinite(number):
            kind = "a whole number" if parse is int else "a finite number"
            raise ValueError(f"{variable}={text!r}: not a number ({kind} expected)")
        if variable == _EXPORT_INTERVAL and number <= 0:
            # A number, but the SDK's reader raises on it without the variable's name.
            raise ValueError(f"{variable}={text!r}: milliseconds between exports, above 0")


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
    _check_numbers(environ)
    resource = Resource.create(
        {
            "service.name": environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
            "service.version": _version(),
        }
    )
    readers, metric_names, closers = _metric_readers(environ)
    if metric_reader is not None:
        readers.append(metric_reader)
        metric_names.append("in process")
    meter_provider = (
        MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
        if readers
        else None
    )
    processors, traces = _span_processors(environ, meter_provider or metrics.NoOpMeterProvider())
    if span_exporter is not None:
        processors.append(SimpleSpanProcessor(span_exporter))
        traces.append("in process")
    tracer_provider = TracerProvider(
        # Nothing would read a recorded span: record none, but keep the trace ids.
        sampler=None if processors else ALWAYS_OFF,
        resource=resource,
        shutdown_on_exit=False,
        meter_provider=metrics.NoOpMeterProvider(),
    )
    for processor in processors:
        tracer_provider.add_span_processor(processor)
    description = (
        f"traces: {', '.join(traces) or 'none'}; metrics: {', '.join(metric_names) or 'none'}"
    )
    return Telemetry(
        tracer_provider, meter_provider, description, tuple(closers), records_spans=bool(processors)
    )
