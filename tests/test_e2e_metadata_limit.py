"""A call's headers have one limit, max_metadata_bytes (16 KiB): gRPC's own
pair of limits (8 KiB soft, 16 KiB hard) refused calls between the two at
random, so the same call passed or failed by chance (15,000 bytes of one
header: 2 of 20 passed)."""

from __future__ import annotations

import grpc

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.settings import Settings

REPEATS = 20
# gRPC's own grpc-timeout header varies by a few bytes from call to call.
JITTER_BYTES = 16


def _refusals(stub: pb_grpc.LedgerStub, size: int, repeats: int = 1) -> int:
    """How many of `repeats` calls with a `size`-byte header gRPC refused."""
    refused = 0
    for _ in range(repeats):
        try:
            stub.GetBalance(
                pb.GetBalanceRequest(lane="recall"),
                metadata=(("x-padding", "v" * size),),
                timeout=30,
            )
        except grpc.RpcError as error:
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert "metadata size" in (error.details() or "")
            refused += 1
    return refused


def test_the_header_limit_is_one_deterministic_bound(ledger_harness: object) -> None:
    stub: pb_grpc.LedgerStub = ledger_harness.ledger  # type: ignore[attr-defined]
    ledger_harness.make_lane()  # type: ignore[attr-defined]
    limit = Settings(database_url="sqlite:///unused.db").max_metadata_bytes
    low, high = 0, limit  # accepted, refused
    while high - low > 1:
        middle = (low + high) // 2
        if _refusals(stub, middle):
            high = middle
        else:
            low = middle
    # Headers of gRPC's own and the grant take the rest; past 8 KiB, under the old soft limit.
    assert limit - 2048 < low < limit
    assert _refusals(stub, low - JITTER_BYTES, REPEATS) == 0
    assert _refusals(stub, low + JITTER_BYTES, REPEATS) == REPEATS
