"""Exporters chosen by the standard OTEL_* variables: none by default, console,
or OTLP where the operator named a collector; a setting the server cannot honour
stops it at start with one line."""

from __future__ import annotations

import logging
import pathlib
import threading

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind

from ledger_service import cli
from ledger_service.telemetry import configure_telemetry, exporters_named


def processors(telemetry: object) -> tuple[object, ...]:
    # The SDK keeps them on its multi-processor; there is no public accessor.
    provider = telemetry.tracer_provider  # type: ignore[attr-defined]
    return tuple(provider._active_span_processor._span_processors)


def test_no_exporter_by_default_costs_no_span_processor_and_no_meter() -> None:
    quiet = configure_telemetry({})
    try:
        assert processors(quiet) == ()
        assert quiet.tracer_provider.sampler is ALWAYS_OFF
        assert quiet.meter is None
        span = quiet.tracer.start_span("ledger.v1.Ledger/Reserve", kind=SpanKind.SERVER)
        # Not recorded, but it has a trace id: the ledger stores it on events.
        assert not span.is_recording()
        assert span.get_span_context().is_valid
        span.end()
    finally:
        quiet.shutdown()
    assert exporters_named({"OTEL_TRACES_EXPORTER": "none"}, "OTEL_TRACES_EXPORTER") == ()


def test_console_exporters_write_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    loud = configure_telemetry(
        {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "console"}
    )
    try:
        (processor,) = processors(loud)
        assert isinstance(processor, SimpleSpanProcessor)
        assert loud.meter is not None
        loud.tracer.start_span("ledger.v1.Ledger/GetBalance").end()
    finally:
        loud.shutdown()
    captured = capsys.readouterr()
    assert '"name": "ledger.v1.Ledger/GetBalance"' in captured.err
    assert '"service.name": "lane-ledger"' in captured.err
    assert captured.out == ""


def test_otlp_goes_only_where_the_operator_points_it() -> None:
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        configure_telemetry({"OTEL_TRACES_EXPORTER": "otlp"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        configure_telemetry({"OTEL_METRICS_EXPORTER": "otlp"})
    sending = configure_telemetry(
        {
            "OTEL_TRACES_EXPORTER": "otlp,console",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
            "OTEL_SERVICE_NAME": "ledger-eu-1",
        }
    )
    try:
        batch, console = processors(sending)
        assert isinstance(batch, BatchSpanProcessor)
        assert isinstance(console, SimpleSpanProcessor)
        assert isinstance(batch._batch_processor._exporter, OTLPSpanExporter)  # type: ignore[attr-defined]
        assert sending.tracer_provider.resource.attributes["service.name"] == "ledger-eu-1"
    finally:
        sending.shutdown()


def test_an_unknown_exporter_stops_the_server_at_start(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="unknown exporter 'jaeger'"):
        configure_telemetry({"OTEL_TRACES_EXPORTER": "jaeger"})
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    code = cli.main(["serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"])
    assert code == 2
    assert "ledger serve: OTEL_TRACES_EXPORTER='zipkin': unknown exporter 'zipkin'" in (
        capsys.readouterr().err
    )


def test_the_signals_path_goes_on_the_endpoints_path_not_after_its_query() -> None:
    # 'http://host:4318/?k=key' sent spans to '/?k=key/v1/traces': the path "/",
    # where a collector answers 404, and the start line showed no /v1/traces.
    sending = configure_telemetry(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318/base/?k=key#part",
        }
    )
    try:
        (batch,) = processors(sending)
        exporter = batch._batch_processor._exporter  # type: ignore[attr-defined]
        assert exporter._endpoint == "http://127.0.0.1:4318/base/v1/traces?k=key#part"
        assert sending.description.startswith(
            "traces: otlp http/protobuf to http://127.0.0.1:4318/base/v1/traces;"
        )
    finally:
        sending.shutdown()


def test_otlp_over_http_protobuf_uses_the_sdks_http_exporters() -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    sending = configure_telemetry(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://user:secret@127.0.0.1:4318",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:9999/custom",
        }
    )
    try:
        (batch,) = processors(sending)
        exporter = batch._batch_processor._exporter  # type: ignore[attr-defined]
        assert isinstance(exporter, HttpSpanExporter)
        # The signal's path after the shared endpoint; a signal's own endpoint as it is.
        assert exporter._endpoint == "http://user:secret@127.0.0.1:4318/v1/traces"
        assert sending.meter_provider is not None
        (reader,) = sending.meter_provider._metric_readers  # type: ignore[attr-defined]
        assert isinstance(reader._exporter, HttpMetricExporter)
        assert reader._exporter._endpoint == "http://127.0.0.1:9999/custom"
        # Said at start, without the credentials in the URL.
        assert sending.description == (
            "traces: otlp http/protobuf to http://127.0.0.1:4318/v1/traces; "
            "metrics: otlp http/protobuf to http://127.0.0.1:9999/custom"
        )
    finally:
        sending.shutdown()
    with pytest.raises(ValueError, match="unknown protocol"):
        configure_telemetry(
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
            }
        )


def test_prometheus_metrics_are_scraped_from_a_running_server(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import socket
    import urllib.request

    from ledger_service.server import LedgerServer
    from tests.conftest import ledger_settings

    with socket.socket() as probe:  # a free port, given back for the exporter
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    telemetry = configure_telemetry(
        {
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
        }
    )
    caplog.set_level(logging.INFO)
    server = LedgerServer(ledger_settings(tmp_path, auth_enabled=False), telemetry=telemetry)
    server.start()
    try:
        import grpc

        from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
        from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            pb_grpc.LedgerStub(channel).ListEvents(pb.ListEventsRequest(), timeout=5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            scraped = response.read().decode()
    finally:
        server.stop(0)
        telemetry.shutdown()
    assert "rpc_server_duration" in scraped
    assert 'rpc_method="ListEvents"' in scraped
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("telemetry: ")]
    assert logged == [
        f"telemetry: traces: none; metrics: prometheus on http://127.0.0.1:{port}/metrics"
    ]


@pytest.mark.parametrize(
    ("endpoint", "shown"),
    [
        # A collector's key in the query string is a credential too.
        ("https://collector.example:4318/v1/traces?api_key=s3cret", "https://collector.example:4318/v1/traces"),
        ("http://user:s3cret@127.0.0.1:4318/v1/traces?token=s3cret#s3cret", "http://127.0.0.1:4318/v1/traces"),
        # An IPv6 collector keeps its brackets once the credentials are left out.
        ("http://user:s3cret@[::1]:4318/v1/traces", "http://[::1]:4318/v1/traces"),
    ],
)  # fmt: skip
def test_the_start_line_leaves_every_credential_of_an_endpoint_out(
    endpoint: str, shown: str
) -> None:
    sending = configure_telemetry(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
        }
    )
    try:
        assert "s3cret" not in sending.description
        assert sending.description == f"traces: otlp http/protobuf to {shown}; metrics: none"
    finally:
        sending.shutdown()


def test_shutdown_does_not_wait_for_a_collector_that_never_answers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A hanging collector held `ledger serve` 35 s past a 0.1 s drain: the SDK
    # waits up to 30 s for the last batch of spans, whatever the server's bound.
    from ledger_service import telemetry as module

    telemetry = configure_telemetry({})
    answered = threading.Event()

    def hangs() -> None:
        answered.wait()  # the collector's answer, which never comes in this test

    monkeypatch.setattr(telemetry.tracer_provider, "shutdown", hangs)
    monkeypatch.setattr(module, "SHUTDOWN_TIMEOUT_MILLIS", 50)
    stopping = threading.Thread(target=telemetry.shutdown, daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="ledger.server"):
            stopping.start()
            stopping.join(timeout=60)  # a safety net: unbounded, it waits for `answered`
            assert not stopping.is_alive(), "shutdown waited for the collector"
        assert not answered.is_set()
        assert "the buffered telemetry is dropped" in caplog.text
    finally:
        answered.set()


def test_a_bad_otlp_setting_is_refused_naming_the_variable_that_holds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The signal's own protocol was refused as OTEL_EXPORTER_OTLP_PROTOCOL, which
    # was not set, and OTEL_BSP_MAX_QUEUE_SIZE=-5 as "max_queue_size must be ...".
    otlp = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    with pytest.raises(ValueError) as protocol:
        configure_telemetry({**otlp, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert str(protocol.value).startswith("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json': ")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "-5")  # the SDK reads os.environ itself
    with pytest.raises(ValueError) as queue_size:
        configure_telemetry(otlp)
    assert str(queue_size.value).startswith("OTEL_BSP_MAX_QUEUE_SIZE='-5': max_queue_size ")


def test_spans_dropped_on_a_full_queue_are_counted_in_the_servers_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The SDK counts them (otel.sdk.processor.span.processed, error.type
    # queue_full) on the global meter provider, which the server never sets:
    # with the collector gone, nothing said how many spans were lost.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export import SpanExportResult

    from ledger_service import telemetry as module

    monkeypatch.setattr(module, "SHUTDOWN_TIMEOUT_MILLIS", 50)
    # A collector that does not answer until the test ends, off the network: a
    # real export left retrying after the 50 ms shutdown logged its failures
    # into later tests' captured logs.
    answered = threading.Event()

    def export(*_: object) -> SpanExportResult:
        answered.wait(10)
        return SpanExportResult.FAILURE

    monkeypatch.setattr(OTLPSpanExporter, "export", export)
    for variable, value in {
        "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "true",
        "OTEL_BSP_MAX_QUEUE_SIZE": "2",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2",
        "OTEL_BSP_SCHEDULE_DELAY": "600000",  # the worker sleeps: the queue stays full
    }.items():
        monkeypatch.setenv(variable, value)
    reader = InMemoryMetricReader()
    sending = configure_telemetry(
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        metric_reader=reader,
    )
    try:
        for _ in range(10):
            sending.tracer.start_span("ledger.v1.Ledger/Reserve").end()
        data = reader.get_metrics_data()
    finally:
        answered.set()
        sending.shutdown()
    assert data is not None
    dropped = [
        point.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "otel.sdk.processor.span.processed"
        for point in metric.data.data_points  # type: ignore[union-attr]
        if (point.attributes or {}).get("error.type") == "queue_full"
    ]
    assert sum(dropped) >= 1, data


@pytest.mark.parametrize(
    "variable",
    [
        "OTEL_METRIC_EXPORT_INTERVAL",
        "OTEL_METRIC_EXPORT_TIMEOUT",
        "OTEL_BSP_SCHEDULE_DELAY",
        "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
        "OTEL_BSP_EXPORT_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
    ],
)
@pytest.mark.parametrize("text", ["abc", "nan", "1.5e"])
def test_a_malformed_number_stops_the_start_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, text: str
) -> None:
    """The SDK warned ("Found invalid value for export interval, using
    default") or raised without a name, and the server ran on a default the
    operator did not choose. It is refused at start as a bad exporter is."""
    monkeypatch.setenv(variable, text)
    environ = {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "console",
        variable: text,
    }
    with pytest.raises(ValueError, match=f"^{variable}='{text}': not a number"):
        configure_telemetry(environ).shutdown()


@pytest.mark.parametrize("text", ["0", "-1"])
def test_a_metric_export_interval_of_zero_or_less_stops_the_start_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    # A number, so it passed the check, but the SDK's reader then raised without
    # the variable's name ("interval value -1.0 is invalid ...").
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", text)  # the SDK reads os.environ itself
    environ = {"OTEL_METRICS_EXPORTER": "console", "OTEL_METRIC_EXPORT_INTERVAL": text}
    with pytest.raises(ValueError, match=f"^OTEL_METRIC_EXPORT_INTERVAL='{text}': "):
        configure_telemetry(environ).shutdown()


def test_a_metric_export_interval_of_inf_turns_periodic_export_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The SDK documents an infinite interval as "no periodic export".
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "inf")
    environ = {"OTEL_METRICS_EXPORTER": "console", "OTEL_METRIC_EXPORT_INTERVAL": "inf"}
    configure_telemetry(environ).shutdown()


@pytest.mark.parametrize(
    ("protocol", "endpoint"),
    [
        ("grpc", "not a url"),
        ("grpc", "ftp://127.0.0.1:4317"),
        ("grpc", "http://"),
        ("grpc", "http://user:s3cret@:4317"),
        ("grpc", "http://user:s3cret@[::1:4317"),
        ("http/protobuf", "127.0.0.1:4318"),
        ("http/protobuf", "http//127.0.0.1:4318"),
    ],
)
def test_a_malformed_endpoint_is_refused_at_start_naming_its_variable(
    protocol: str, endpoint: str
) -> None:
    """An endpoint no exporter can send to started the server, which then dropped
    every batch ('not a url' was even shown on the start line): refused, as a
    missing one is, naming the variable and never its password."""
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        with pytest.raises(ValueError) as refused:
            configure_telemetry(
                {
                    "OTEL_TRACES_EXPORTER": "otlp",
                    "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                    variable: endpoint,
                }
            )
        assert str(refused.value).startswith(f"{variable}="), refused.value
        assert "s3cret" not in str(refused.value)


def test_an_endpoint_without_a_scheme_still_works_over_grpc() -> None:
    # The gRPC exporter takes HOST:PORT as it is.
    sending = configure_telemetry(
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}
    )
    sending.shutdown()
