"""A caller's trace headers cannot fill the server's log: OpenTelemetry's
propagator logged a WARNING for each traceparent past 512 characters and each
tracestate past 8,192 or with a malformed member (quoting it), one line a call,
for callers with no grant too (tracing runs before the grant check)."""

from __future__ import annotations

import logging

import grpc
import pytest

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer

CALLS = 60
VALID_TRACEPARENT = ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
BAD_HEADERS = (
    (("traceparent", "00-" + "a" * 600),),
    (VALID_TRACEPARENT, ("tracestate", "k=" + "v" * 9_000)),
    (VALID_TRACEPARENT, ("tracestate", "not a member " * 40)),
)


def test_malformed_trace_headers_are_logged_at_most_ten_a_second(
    server: LedgerServer, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        caplog.at_level(logging.DEBUG),
    ):
        balance = channel.unary_unary(
            "/ledger.v1.Ledger/GetBalance",
            request_serializer=pb.GetBalanceRequest.SerializeToString,
            response_deserializer=pb.Balance.FromString,
        )
        for call in range(CALLS):
            with pytest.raises(grpc.RpcError) as refused:
                balance(
                    pb.GetBalanceRequest(lane="recall"),
                    metadata=BAD_HEADERS[call % len(BAD_HEADERS)],
                    timeout=10,
                )
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    about_headers = [
        record
        for record in caplog.records
        if "traceparent" in record.getMessage()
        or "tracestate" in record.getMessage()
        or "w3c" in record.getMessage()
    ]
    assert 0 < len(about_headers) <= 10, [record.getMessage() for record in about_headers]
    assert all(len(record.getMessage()) < 500 for record in about_headers)
