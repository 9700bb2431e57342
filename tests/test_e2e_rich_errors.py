"""Every refusal carries gRPC's rich error model beside the ledger's own trailers:
`grpc-status-details-bin`, a google.rpc.Status with the call's code and message
and one ErrorInfo (the ledger-reason, domain ledger.v1, ledger-field in its
metadata), which grpcurl, Envoy and most gRPC clients read."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer


def _refusal(call: Any) -> tuple[grpc.Call, status_pb2.Status, error_details_pb2.ErrorInfo]:
    try:
        call()
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        trailers = dict(error.trailing_metadata() or ())
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        (detail,) = status.details
        info = error_details_pb2.ErrorInfo()
        assert detail.Unpack(info)
        # What grpcio-status checks: the details agree with the call itself.
        assert status.code == error.code().value[0]
        assert status.message == error.details()
        assert info.reason == trailers["ledger-reason"]
        assert info.domain == "ledger.v1"
        return error, status, info
    raise AssertionError("the call was not refused")


def test_a_domain_refusal_names_its_reason_and_field(ledger_harness: Any) -> None:
    ledger_harness.make_lane()
    stub = ledger_harness.ledger
    bad = pb.ReserveRequest(
        lane="recall", reservation_id="r", model="jev", request_bytes=-1, max_output_tokens=1
    )
    error, _, info = _refusal(lambda: stub.Reserve(bad, timeout=5))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.reason == "INVALID_ARGUMENT" and dict(info.metadata) == {"field": "request_bytes"}
    missing = pb.GetBalanceRequest(lane="nowhere")
    error, _, info = _refusal(lambda: stub.GetBalance(missing, timeout=5))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert info.reason == "LANE_NOT_FOUND" and dict(info.metadata) == {}


def test_auth_refusals_carry_it_too(server: LedgerServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.LedgerStub(channel)
        error, _, info = _refusal(
            lambda: stub.GetBalance(pb.GetBalanceRequest(lane="recall"), timeout=5)
        )
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED
    assert info.reason == "UNAUTHENTICATED"
