"""A bare Settle's or Refund's own arguments out of the ledger's range are
refused before any call with the InvalidArgument the ledger would send (its
field, reason and words: ledger_service/domain/moves.py, SettleCommand and
RefundCommand), as a Reserve's are, so that one `except InvalidArgument`
catches both. A plain ValueError escaped a lane's handler before."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from ledger_client import InvalidArgument, LaneClient, Usage

# Nothing listens at the address: a call that went out would fail as
# LedgerUnavailable instead.
NOWHERE = "127.0.0.1:9"

SETTLE_STATUS = "http_status: must be between 100 and 599"
REFUND_STATUS = "http_status: must be between 400 and 499"
BILLED = "billed_nanos: must be between 0 and 4611686018427387904"

CASES: list[tuple[str, Callable[[LaneClient], object], str, str]] = [
    (
        "settle, negative status",
        lambda c: c.settle("r-1", http_status=-1),
        "http_status",
        SETTLE_STATUS,
    ),
    ("settle, status 99", lambda c: c.settle("r-1", http_status=99), "http_status", SETTLE_STATUS),
    (
        "settle, status 600",
        lambda c: c.settle("r-1", http_status=600),
        "http_status",
        SETTLE_STATUS,
    ),
    (
        "settle, negative billed",
        lambda c: c.settle("r-1", billed_at_most_nanos=-1),
        "billed_nanos",
        BILLED,
    ),
    (
        "settle, billed past 2^62",
        lambda c: c.settle("r-1", billed_at_most_nanos=2**62 + 1),
        "billed_nanos",
        BILLED,
    ),
    (
        "refund, negative status",
        lambda c: c.refund("r-1", http_status=-429),
        "http_status",
        REFUND_STATUS,
    ),
    (
        "refund, status 700",
        lambda c: c.refund("r-1", http_status=700),
        "http_status",
        REFUND_STATUS,
    ),
]


@pytest.mark.parametrize(("why", "call", "field", "message"), CASES, ids=[c[0] for c in CASES])
def test_an_end_argument_out_of_range_is_the_ledgers_invalid_argument(
    why: str, call: Callable[[LaneClient], object], field: str, message: str
) -> None:
    with LaneClient(NOWHERE, "lane") as client, pytest.raises(InvalidArgument) as caught:
        call(client)
    error = caught.value
    assert type(error) is InvalidArgument, why
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert (error.reason, error.field, error.message) == ("INVALID_ARGUMENT", field, message)


def test_a_bound_on_the_bill_beside_known_usage_is_refused_not_ignored() -> None:
    """`billed_at_most_nanos` bounds an UNKNOWN charge; with usage the charge
    is the usage's, so the bound would be dropped without a word."""
    with LaneClient(NOWHERE, "lane") as client, pytest.raises(InvalidArgument) as caught:
        client.settle("r-1", Usage(input_tokens=10), billed_at_most_nanos=5)
    assert caught.value.field == "billed_at_most_nanos"
    assert "without usage" in caught.value.message
