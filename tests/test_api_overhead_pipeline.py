"""The interceptors are composed once per method (api/pipeline.py), yet every call
is still judged on its own metadata: a cached handler never carries one call's
grant or trace parent into the next."""

from __future__ import annotations

import collections
from typing import Any

import grpc
import pytest

from ledger_service.api.errors import ErrorInterceptor
from ledger_service.api.pipeline import MethodPipeline
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer

LIST_LANES = "/ledger.v1.LaneAdmin/ListLanes"
TIMEOUT_SECONDS = 30.0


def _call(
    channel: grpc.Channel, method: str, payload: bytes, metadata: tuple[tuple[str, str], ...]
) -> tuple[grpc.StatusCode, dict[str, str]]:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        call(payload, metadata=metadata, timeout=TIMEOUT_SECONDS)
    except grpc.RpcError as error:
        received: Any = error.trailing_metadata() or ()
        trailers = {key: str(value) for key, value in received}
        return error.code(), trailers
    return grpc.StatusCode.OK, {}


def test_each_call_is_judged_on_its_own_grant(server: LedgerServer) -> None:
    valid = (("authorization", f"Bearer {server.admin_grant}"),)
    forged = (("authorization", f"Bearer {server.admin_grant[:-4]}AAAA"),)
    request = pb.ListLanesRequest().SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        answers = [
            _call(channel, LIST_LANES, request, metadata)[0]
            for metadata in (valid, (), valid, forged, valid)
        ]
    assert answers == [
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OK,
    ]


def test_undecodable_bytes_are_decoded_only_for_a_valid_grant(server: LedgerServer) -> None:
    garbage = b"\xff\xff\xff\xff"
    valid = (("authorization", f"Bearer {server.admin_grant}"),)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        refused, refused_trailers = _call(channel, LIST_LANES, garbage, ())
        undecodable, undecodable_trailers = _call(channel, LIST_LANES, garbage, valid)
    assert refused is grpc.StatusCode.UNAUTHENTICATED
    assert refused_trailers["ledger-reason"] == "UNAUTHENTICATED"
    assert undecodable is grpc.StatusCode.INVALID_ARGUMENT
    assert undecodable_trailers["ledger-reason"] == "UNDECODABLE_REQUEST"


class _Details(
    collections.namedtuple("_Details", "method invocation_metadata"),
    grpc.HandlerCallDetails,
):
    pass


class _Counting(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.calls = 0

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.calls += 1
        return continuation(details)


def test_a_method_is_composed_once_and_again_when_its_handler_changes() -> None:
    counting = _Counting()
    pipeline = MethodPipeline([ErrorInterceptor(), counting])
    first = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    second = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    details = _Details("/ledger.v1.Ledger/Reserve", ())
    composed = pipeline.intercept_service(lambda _: first, details)
    assert pipeline.intercept_service(lambda _: first, details) is composed
    assert counting.calls == 1
    assert pipeline.intercept_service(lambda _: second, details) is not composed
    assert counting.calls == 2
    assert pipeline.intercept_service(lambda _: None, _Details("/no.Such/Method", ())) is None


def test_a_failing_lookup_is_answered_by_the_error_table() -> None:
    def failing(_details: Any) -> Any:
        raise RuntimeError("secret detail")

    pipeline = MethodPipeline([ErrorInterceptor()])
    handler = pipeline.intercept_service(failing, _Details("/ledger.v1.Ledger/Reserve", ()))
    assert handler is not None and handler.unary_unary is not None

    class Aborted(Exception):
        pass

    class Context:
        code: grpc.StatusCode | None = None
        details = ""

        def set_trailing_metadata(self, _metadata: Any) -> None:
            return None

        def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.code, self.details = code, details
            raise Aborted()

    context: Any = Context()
    with pytest.raises(Aborted):
        handler.unary_unary(b"", context)
    assert context.code is grpc.StatusCode.INTERNAL
    assert "secret" not in context.details
