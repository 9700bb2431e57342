"""Every RPC is a SERVER span joined to the lane's trace, and the ledger stores
that trace id on the events the call writes (docs/semantics.md)."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from ledger_client import ClientSettings, LaneClient
from ledger_client.outcomes import Usage
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer
from ledger_service.telemetry import configure_telemetry

RESERVE = "ledger.v1.Ledger/Reserve"
SETTLE = "ledger.v1.Ledger/Settle"
CLIENT_SETTINGS = ClientSettings(deadline_seconds=10.0, replay_interval_seconds=None)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
STREAM_WAIT_SECONDS = 10.0


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def one_span(exporter: InMemorySpanExporter, name: str, kind: SpanKind) -> ReadableSpan:
    found = [span for span in spans_named(exporter, name) if span.kind is kind]
    assert len(found) == 1, [(span.name, span.kind) for span in exporter.get_finished_spans()]
    return found[0]


def hex_trace_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.trace_id, "032x")


def test_a_reserve_and_settle_by_the_lane_client_make_one_trace(
    traced_server: LedgerServer, ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    ledger.put_lane()
    tracer = trace.get_tracer("recall-step")
    address = f"127.0.0.1:{traced_server.port}"
    with (
        LaneClient(
            address, "recall", grant=traced_server.admin_grant, settings=CLIENT_SETTINGS
        ) as client,
        tracer.start_as_current_span("recall step") as step,
    ):
        reservation = client.reserve("jev", 10_000, 500, reservation_id="traced-1")
        client.settle(reservation.reservation_id, Usage(input_tokens=1_000, output_tokens=10))
    trace_id = format(step.get_span_context().trace_id, "032x")

    for name in (RESERVE, SETTLE):
        client_span = one_span(span_exporter, name, SpanKind.CLIENT)
        server_span = one_span(span_exporter, name, SpanKind.SERVER)
        assert hex_trace_id(client_span) == hex_trace_id(server_span) == trace_id
        assert server_span.parent is not None and client_span.context is not None
        assert server_span.parent.span_id == client_span.context.span_id
        assert client_span.parent is not None
        assert client_span.parent.span_id == step.get_span_context().span_id
        assert client_span.attributes is not None
        assert client_span.attributes["rpc.grpc.status_code"] == 0
        assert client_span.attributes["server.port"] == traced_server.port

    reserve = one_span(span_exporter, RESERVE, SpanKind.SERVER).attributes
    assert reserve is not None
    assert {key: reserve[key] for key in sorted(reserve) if not key.startswith("network.")} == {
        "rpc.system": "grpc",
        "rpc.service": "ledger.v1.Ledger",
        "rpc.method": "Reserve",
        "rpc.grpc.status_code": 0,
        "server.address": "127.0.0.1",
        "server.port": traced_server.port,
        "ledger.lane": "recall",
        "ledger.reservation_id": "traced-1",
        "ledger.model": "jev",
        "ledger.decision": "admitted",
        "ledger.hold_nanos": 486,
        "ledger.cap_nanos": 486,
        "ledger.spent_nanos": 486,
        "ledger.held_nanos": 486,
        "ledger.limit_nanos": 500_000_000,
        "ledger.open_bookings": 1,
    }
    assert reserve["network.peer.address"] == "127.0.0.1"
    settle = one_span(span_exporter, SETTLE, SpanKind.SERVER).attributes
    assert settle is not None
    # 1_000 input tokens at 100_000 nanos per million, 10 output at 400_000: 100 + 4.
    assert settle["ledger.charge_nanos"] == 104
    assert settle["ledger.outcome"] == "succeeded"
    assert settle["ledger.booking_state"] == "settled"
    assert (settle["ledger.spent_nanos"], settle["ledger.limit_nanos"]) == (104, 500_000_000)

    events = ledger.events(reservation_id="traced-1")
    assert [event.kind for event in events] == ["reserved", "settled"]
    assert {event.trace_id for event in events} == {trace_id}


def test_a_call_without_traceparent_gets_a_fresh_trace_id_on_its_events(
    ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    ledger.put_lane()
    ledger.reserve("first")
    ledger.reserve("second")
    by_id = {event.reservation_id: event.trace_id for event in ledger.events(kinds=["reserved"])}
    servers = [span for span in spans_named(span_exporter, RESERVE)]
    assert sorted(by_id.values()) == sorted(hex_trace_id(span) for span in servers)
    assert len(set(by_id.values())) == 2
    assert all(len(value) == 32 and int(value, 16) for value in by_id.values())
    assert all(span.parent is None for span in servers)


def test_a_traceparent_from_any_caller_is_the_events_trace_id(
    ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    ledger.put_lane()
    ledger.reserve("traced", metadata=TRACEPARENT)
    ledger.reserve("badly", metadata=(("traceparent", "00-zz-zz-01"),))
    by_id = {event.reservation_id: event.trace_id for event in ledger.events(kinds=["reserved"])}
    assert by_id["traced"] == TRACE_ID
    assert by_id["badly"] not in ("", TRACE_ID)
    traced = [s for s in spans_named(span_exporter, RESERVE) if hex_trace_id(s) == TRACE_ID]
    assert len(traced) == 1
    assert traced[0].parent is not None and traced[0].parent.span_id == 0x00F067AA0BA902B7


def test_refused_and_failed_calls_are_traced_with_their_status(
    ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    with pytest.raises(grpc.RpcError) as unknown_lane:
        ledger.reserve("r1", lane="nobody")
    assert unknown_lane.value.code() is grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as anonymous:
        ledger.anonymous.GetBalance(pb.GetBalanceRequest(lane="recall"), timeout=10)
    assert anonymous.value.code() is grpc.StatusCode.UNAUTHENTICATED

    not_found = one_span(span_exporter, RESERVE, SpanKind.SERVER)
    assert not_found.attributes is not None
    assert not_found.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert not_found.attributes["ledger.lane"] == "nobody"
    # A caller's mistake is not the server's error (RPC conventions).
    assert not_found.status.status_code is StatusCode.UNSET
    refused = one_span(span_exporter, "ledger.v1.Ledger/GetBalance", SpanKind.SERVER)
    assert refused.attributes is not None
    assert refused.attributes["rpc.grpc.status_code"] == 16
    # Refused before its request was decoded: the span names no lane.
    assert "ledger.lane" not in refused.attributes


def test_a_failed_calls_span_says_why_as_its_caller_was_told(
    ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    # The span had the status code alone: NOT_FOUND for an unknown lane and for
    # an unknown booking alike, and SHUTTING_DOWN or a dead database both UNAVAILABLE.
    with pytest.raises(grpc.RpcError) as unknown_lane:
        ledger.reserve("r1", lane="nobody")
    told = dict(unknown_lane.value.trailing_metadata())["ledger-reason"]
    with pytest.raises(grpc.RpcError) as anonymous:
        ledger.anonymous.GetBalance(pb.GetBalanceRequest(lane="recall"), timeout=10)
    refused_for = dict(anonymous.value.trailing_metadata())["ledger-reason"]

    not_found = one_span(span_exporter, RESERVE, SpanKind.SERVER)
    assert not_found.attributes is not None
    assert told and not_found.attributes["ledger.reason"] == told
    refused = one_span(span_exporter, "ledger.v1.Ledger/GetBalance", SpanKind.SERVER)
    assert refused.attributes is not None
    assert refused.attributes["ledger.reason"] == refused_for == "UNAUTHENTICATED"


def test_a_stream_is_one_span_for_its_whole_life(
    ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    ledger.put_lane()
    ledger.reserve("r1")
    stream = ledger.ledger.WatchEvents(
        pb.WatchEventsRequest(lane="recall"), metadata=TRACEPARENT, timeout=STREAM_WAIT_SECONDS
    )
    received = [next(stream), next(stream)]
    stream.cancel()
    assert [event.kind for event in received] == ["lane_configured", "reserved"]
    deadline = time.monotonic() + STREAM_WAIT_SECONDS
    while not spans_named(span_exporter, "ledger.v1.Ledger/WatchEvents"):
        assert time.monotonic() < deadline, "the stream's span never ended"
        time.sleep(0.05)
    (watch,) = spans_named(span_exporter, "ledger.v1.Ledger/WatchEvents")
    assert watch.kind is SpanKind.SERVER
    assert hex_trace_id(watch) == TRACE_ID
    assert watch.attributes is not None
    assert watch.attributes["ledger.lane"] == "recall"
    assert watch.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert watch.attributes["ledger.messages_sent"] >= 2


def test_health_checks_are_not_traced(
    traced_server: LedgerServer, span_exporter: InMemorySpanExporter
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{traced_server.port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert span_exporter.get_finished_spans() == ()


def test_without_an_exporter_spans_are_not_recorded_but_trace_ids_are_kept(
    server_with: Any, connect: Any, span_exporter: InMemorySpanExporter
) -> None:
    quiet = configure_telemetry({})
    assert quiet.meter is None
    try:
        ledger = connect(server_with(quiet))
        ledger.put_lane()
        ledger.reserve("traced", metadata=TRACEPARENT)
        ledger.reserve("fresh")
        by_id = {e.reservation_id: e.trace_id for e in ledger.events(kinds=["reserved"])}
    finally:
        quiet.shutdown()
    assert by_id["traced"] == TRACE_ID
    assert len(by_id["fresh"]) == 32 and by_id["fresh"] != TRACE_ID
    assert span_exporter.get_finished_spans() == ()


def test_the_absent_test_clock_checks_the_grant_and_is_traced_like_every_rpc(
    server_with: Any, telemetry: Any, span_exporter: InMemorySpanExporter
) -> None:
    """docs/security.md, docs/observability.md: on a server without --test-clock
    the TestClock RPCs are still checked for an admin grant first and traced,
    then answer UNIMPLEMENTED; an unknown caller learns nothing more."""
    from google.protobuf import empty_pb2

    from ledger_service.domain.clock import SystemClock
    from ledger_service.domain.grants import Scope
    from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc

    server = server_with(telemetry, test_clock=False)
    now_us = SystemClock().now_us()
    charge = server.keyring.issue(
        ["recall"], [Scope.CHARGE], issued_at_us=now_us, expires_at_us=now_us + 3_600_000_000
    )
    callers = {
        "anonymous": ((), grpc.StatusCode.UNAUTHENTICATED),
        "charge": ((("authorization", f"Bearer {charge}"),), grpc.StatusCode.PERMISSION_DENIED),
        "admin": (
            (("authorization", f"Bearer {server.admin_grant}"),),
            grpc.StatusCode.UNIMPLEMENTED,
        ),
    }
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        clock = pb_grpc.TestClockStub(channel)
        for metadata, expected in callers.values():
            with pytest.raises(grpc.RpcError) as refused:
                clock.GetTime(empty_pb2.Empty(), metadata=metadata, timeout=10)
            assert refused.value.code() is expected
            if expected is grpc.StatusCode.UNIMPLEMENTED:
                assert "--test-clock" in (refused.value.details() or "")
    spans = spans_named(span_exporter, "ledger.v1.TestClock/GetTime")
    codes = [span.attributes["rpc.grpc.status_code"] for span in spans if span.attributes]
    assert codes == [expected.value[0] for _, expected in callers.values()]


@pytest.mark.parametrize(
    ("content", "default_lane", "expected"),
    [
        # Rows that name no lane: the default lane is the lane of the call.
        (b"reservation_id,billed_nanos\nr1,5\n", "recall", {"recall"}),
        # Rows that name their lane, all one: that lane.
        (b"reservation_id,billed_nanos,lane\nr1,5,recall\n", "", {"recall"}),
        # Rows of several lanes: no one lane to name.
        (b"reservation_id,billed_nanos,lane\nr1,5,recall\nr2,5,filter\n", "recall", set()),
    ],
)
def test_a_reconcile_span_names_the_lane_its_rows_are_of(
    ledger: Any,
    span_exporter: InMemorySpanExporter,
    content: bytes,
    default_lane: str,
    expected: set[str],
) -> None:
    """docs/observability.md: `ledger.lane` on every call about one lane; a
    Reconcile is about the lanes its rows name, and also carries its default lane."""
    ledger.put_lane("recall")
    ledger.put_lane("filter")
    ledger.ledger.Reconcile(
        pb.ReconcileRequest(
            format=pb.ReconcileRequest.CSV,
            content=content,
            default_lane=default_lane,
            dry_run=True,
        ),
        timeout=10,
    )
    span = one_span(span_exporter, "ledger.v1.Ledger/Reconcile", SpanKind.SERVER)
    assert span.attributes is not None
    assert ({span.attributes["ledger.lane"]} if "ledger.lane" in span.attributes else set()) == (
        expected
    )
    assert span.attributes.get("ledger.default_lane") == (default_lane or None)


def _move_attributes(exporter: InMemorySpanExporter) -> list[tuple[str, int, dict[str, Any]]]:
    """Each move's span: its method, status code and ledger.* attributes."""
    found = []
    for span in exporter.get_finished_spans():
        if span.name in {RESERVE, SETTLE, "ledger.v1.Ledger/Refund"} and span.attributes:
            ledger_attributes = {
                key: value for key, value in span.attributes.items() if key.startswith("ledger.")
            }
            found.append((span.name, span.attributes["rpc.grpc.status_code"], ledger_attributes))
    return found


def test_a_failed_move_claims_no_outcome_it_did_not_book(
    ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    """docs/observability.md: `ledger.outcome`, the decision and the charge are on
    moves that were answered; a refused one names only what its request asked."""
    ledger.put_lane("recall")
    ledger.reserve("open", ttl_seconds=60)
    refused = [
        lambda: ledger.reserve("r", lane="nobody"),  # NOT_FOUND
        lambda: ledger.settle("nope", pb.SUCCEEDED, input_tokens=1),  # NOT_FOUND
        lambda: ledger.settle("nope", pb.UNKNOWN),  # NOT_FOUND
        lambda: ledger.refund("nope"),  # NOT_FOUND
        lambda: ledger.settle("open", pb.SUCCEEDED),  # SETTLE_WITHOUT_USAGE
    ]
    span_exporter.clear()
    for move in refused:
        with pytest.raises(grpc.RpcError):
            move()
    failed = _move_attributes(span_exporter)
    assert len(failed) == len(refused)
    for name, code, attributes in failed:
        assert code != 0, name
        claimed = {"ledger.outcome", "ledger.decision", "ledger.charge_nanos"} & set(attributes)
        assert not claimed, (name, attributes)
    # The expired booking: a late UNKNOWN is answered and changes nothing; the
    # span says what the lane reported and what the booking is booked as.
    ledger.advance_seconds(61)
    span_exporter.clear()
    ledger.settle("open", pb.UNKNOWN)
    [(_, code, attributes)] = _move_attributes(span_exporter)
    assert code == 0
    assert attributes["ledger.outcome"] == "unknown"
    assert attributes["ledger.booking_state"] == "expired"


def test_a_model_call_inside_the_lanes_span_joins_the_lanes_trace(
    traced_server: LedgerServer, ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    """model_call, the lane's one-block API, sends a traceparent of its own; with
    no trace id given it must take the current OpenTelemetry context's, as the
    bare moves do (docs/observability.md, "The lane's side"), not a fresh one."""
    ledger.put_lane()
    tracer = trace.get_tracer("recall-step")
    address = f"127.0.0.1:{traced_server.port}"
    with (
        LaneClient(
            address, "recall", grant=traced_server.admin_grant, settings=CLIENT_SETTINGS
        ) as client,
        tracer.start_as_current_span("recall step") as step,
        client.model_call("jev", 10_000, 500, reservation_id="traced-call") as call,
    ):
        call.answered(200, Usage(input_tokens=1_000, output_tokens=10))
    trace_id = format(step.get_span_context().trace_id, "032x")

    assert call.trace_id == trace_id
    for name in (RESERVE, SETTLE):
        client_span = one_span(span_exporter, name, SpanKind.CLIENT)
        server_span = one_span(span_exporter, name, SpanKind.SERVER)
        assert hex_trace_id(client_span) == hex_trace_id(server_span) == trace_id
        assert client_span.parent is not None
        assert client_span.parent.span_id == step.get_span_context().span_id
    events = ledger.events(reservation_id="traced-call")
    assert {event.trace_id for event in events} == {trace_id}


def test_a_model_call_given_a_trace_id_keeps_it_inside_another_trace(
    traced_server: LedgerServer, ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    ledger.put_lane()
    tracer = trace.get_tracer("recall-step")
    address = f"127.0.0.1:{traced_server.port}"
    with (
        LaneClient(
            address, "recall", grant=traced_server.admin_grant, settings=CLIENT_SETTINGS
        ) as client,
        tracer.start_as_current_span("recall step"),
        client.model_call("jev", 10_000, 500, trace_id=TRACE_ID, reservation_id="given") as call,
    ):
        call.answered(200, Usage(input_tokens=1_000, output_tokens=10))
    assert {event.trace_id for event in ledger.events(reservation_id="given")} == {TRACE_ID}
    assert hex_trace_id(one_span(span_exporter, RESERVE, SpanKind.SERVER)) == TRACE_ID


def test_a_call_whose_request_never_came_is_traced_with_its_status(
    traced_server: LedgerServer, span_exporter: InMemorySpanExporter
) -> None:
    """The request-arrival bound ends such calls outside the tracing interceptor
    (CANCELLED, or INVALID_ARGUMENT with no whole message): they had no span and
    no rpc.server.duration, so a slow-loris flood showed in no telemetry."""
    method = "/ledger.v1.Ledger/GetBalance"
    with (
        grpc.insecure_channel(f"127.0.0.1:{traced_server.port}") as channel,
        pytest.raises(grpc.RpcError) as empty,
    ):
        channel.stream_unary(method)(iter(()), timeout=10)
    assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    span = one_span(span_exporter, method.lstrip("/"), SpanKind.SERVER)
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


class _FailedContext:
    """What the tracing interceptor reads of a call the error table answered
    UNAVAILABLE with a reason."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("ledger-reason", "STORE_UNAVAILABLE"),)


def test_a_server_errors_status_names_its_reason(span_exporter: InMemorySpanExporter) -> None:
    # "UNAVAILABLE" alone did not tell a dead database from a draining server.
    from ledger_service.api.tracing import TracingInterceptor

    tracer = trace.get_tracer_provider().get_tracer("test")
    interceptor = TracingInterceptor(tracer)
    traced = interceptor._traced_unary(lambda request, context: None, "/ledger.v1.Ledger/Reserve")
    traced(None, _FailedContext())
    span = one_span(span_exporter, RESERVE, SpanKind.SERVER)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "UNAVAILABLE STORE_UNAVAILABLE"
    assert span.attributes is not None and span.attributes["ledger.reason"] == "STORE_UNAVAILABLE"


def test_a_refused_settles_span_names_its_reason_once(
    ledger: Any, span_exporter: InMemorySpanExporter
) -> None:
    # The metrics' own note, `ledger.refused`, also went onto the span: an
    # attribute no doc names, saying what `ledger.reason` says.
    ledger.put_lane()
    ledger.reserve("r1")
    with pytest.raises(grpc.RpcError):
        ledger.settle("r1", pb.SUCCEEDED, output_tokens=10)
    span = one_span(span_exporter, SETTLE, SpanKind.SERVER)
    assert span.attributes is not None
    assert span.attributes["ledger.reason"] == "SETTLE_WITHOUT_USAGE"
    assert not [key for key in span.attributes if key == "ledger.refused"]
