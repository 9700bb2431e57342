"""Exporters chosen by the standard OTEL_* variables: none by default, console,
or OTLP where the operator named a collector; a setting the server cannot honour
stops it at start with one line."""

from __future__ import annotations

import pathlib

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
