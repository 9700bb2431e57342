"""The incident of docs/semantics.md ("Why it exists") as a test: it cannot happen on this ledger.

Recall fell back on 1,539 of 1,685 live attempts while real spend was about
$0.0014 of a $0.50 daily budget: unknown outcomes were booked at 16 to 750 times
the real bill, refused calls (HTTP 403) were charged, and bookings never aged
out of the "daily" window.

Here the same lane makes 1,685 calls of mixed sizes (2 KB to 300 KB, 200 to
1,000 max output tokens) within one window, real charges totalling about
1.4e6 nanos ($0.0014); some time out (UNKNOWN), some are refused (403). The
lane gives a realistic estimate, so an UNKNOWN costs about its real bill. Then:
no budget denial at all, refused calls cost zero, and after one idle window the
lane's spent is exactly zero.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

CALLS = 1_685
SEED = 20260924
LIMIT_NANOS = 500_000_000  # $0.50
WINDOW_SECONDS = 86_400
# JEV at $0.055 / $0.22 per million input / output tokens puts the real bill of
# these 1,685 calls at about $0.0014, as in the incident.
PRICE_IN = 55_000
PRICE_OUT = 220_000
TIMEOUT_SHARE = 0.07
REFUSED_SHARE = 0.04
# Calls go out in batches: the reserves of a batch in flight together, then their ends.
BATCH = 8
# 1,685 calls spread over about 20 hours of the 24-hour window.
SECONDS_BETWEEN_BATCHES = 20 * 3_600 * BATCH // CALLS
RPC_TIMEOUT_SECONDS = 30


@dataclasses.dataclass(frozen=True)
class Call:
    reservation_id: str
    request_bytes: int
    max_output_tokens: int
    input_tokens: int
    output_tokens: int
    # succeeded, unknown (a timeout) or refused (403)
    ending: str

    @property
    def real_cost_nanos(self) -> int:
        return price(self.input_tokens, PRICE_IN) + price(self.output_tokens, PRICE_OUT)

    @property
    def estimate_nanos(self) -> int:
        """What the lane expects: 4 bytes per token in, 60 % of max_output_tokens out."""
        expected_in = math.ceil(self.request_bytes / 4)
        expected_out = math.ceil(self.max_output_tokens * 0.6)
        return price(expected_in, PRICE_IN) + price(expected_out, PRICE_OUT)

    @property
    def cap_nanos(self) -> int:
        tokens_in = math.ceil(self.request_bytes * 2 / 7)  # 3.5 bytes per token
        return price(tokens_in, PRICE_IN) + price(self.max_output_tokens, PRICE_OUT)


def price(tokens: int, nanos_per_million: int) -> int:
    return -(-tokens * nanos_per_million // 1_000_000)


def recall_calls() -> list[Call]:
    rng = random.Random(SEED)
    calls = []
    for number in range(CALLS):
        request_bytes = int(math.exp(rng.uniform(math.log(2_000), math.log(300_000))))
        max_output_tokens = rng.randint(200, 1_000)
        roll = rng.random()
        ending = (
            "unknown"
            if roll < TIMEOUT_SHARE
            else "refused"
            if roll < TIMEOUT_SHARE + REFUSED_SHARE
            else "succeeded"
        )
        calls.append(
            Call(
                reservation_id=f"recall-{number:04d}",
                request_bytes=request_bytes,
                max_output_tokens=max_output_tokens,
                input_tokens=math.ceil(request_bytes / 4),
                output_tokens=rng.randint(max_output_tokens // 5, max_output_tokens),
                ending=ending,
            )
        )
    return calls


def reserve_request(call: Call) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        lane="recall",
        reservation_id=call.reservation_id,
        model="jev",
        request_bytes=call.request_bytes,
        max_output_tokens=call.max_output_tokens,
        estimate_nanos=call.estimate_nanos,
    )


def end_call(ledger: Any, call: Call) -> Any:
    """Starts the Settle or Refund that ends `call`; returns its future."""
    if call.ending == "refused":
        request = pb.RefundRequest(
            lane="recall", reservation_id=call.reservation_id, http_status=403
        )
        return ledger.Refund.future(request, timeout=RPC_TIMEOUT_SECONDS)
    if call.ending == "unknown":
        settle = pb.SettleRequest(
            lane="recall", reservation_id=call.reservation_id, outcome=pb.UNKNOWN
        )
    else:
        settle = pb.SettleRequest(
            lane="recall",
            reservation_id=call.reservation_id,
            outcome=pb.SUCCEEDED,
            input_tokens=call.input_tokens,
            output_tokens=call.output_tokens,
            http_status=200,
        )
    return ledger.Settle.future(settle, timeout=RPC_TIMEOUT_SECONDS)


def test_the_recall_jam_cannot_happen(ledger_harness: Any) -> None:
    harness = ledger_harness
    harness.make_lane(
        limit_nanos=LIMIT_NANOS,
        window_seconds=WINDOW_SECONDS,
        prices={"jev": (PRICE_IN, PRICE_OUT)},
    )
    calls = recall_calls()
    real_nanos = sum(call.real_cost_nanos for call in calls if call.ending == "succeeded")
    assert 1_200_000 <= real_nanos <= 1_600_000, "the scenario's real spend is about $0.0014"
    expected_charge = {
        "succeeded": lambda call: call.real_cost_nanos,
        "unknown": lambda call: min(call.estimate_nanos, call.cap_nanos),
        "refused": lambda call: 0,
    }

    denials = 0
    charged: dict[str, int] = {}
    for start in range(0, CALLS, BATCH):
        batch = calls[start : start + BATCH]
        reserves = [
            harness.ledger.Reserve.future(reserve_request(call), timeout=RPC_TIMEOUT_SECONDS)
            for call in batch
        ]
        answers = [future.result() for future in reserves]
        denials += sum(answer.decision != pb.ADMITTED for answer in answers)
        for call, answer in zip(batch, answers, strict=True):
            assert answer.hold_nanos == min(call.estimate_nanos, call.cap_nanos)
        ends = [end_call(harness.ledger, call) for call in batch]
        for call, future in zip(batch, ends, strict=True):
            answer = future.result()
            if call.ending != "refused":
                charged[call.reservation_id] = answer.charged_nanos
        harness.advance_us(SECONDS_BETWEEN_BATCHES * 1_000_000)

    assert denials == 0, f"{denials} of {CALLS} calls fell back on budget"
    for call in calls:
        if call.ending != "refused":
            assert charged[call.reservation_id] == expected_charge[call.ending](call), call
    unknown = [call for call in calls if call.ending == "unknown"]
    for call in unknown:
        # An unknown outcome costs about its real bill, never 16 to 750 times it.
        assert charged[call.reservation_id] <= 2 * call.real_cost_nanos + 1, call

    balance = harness.balance()
    total = sum(expected_charge[call.ending](call) for call in calls)
    assert (balance.spent_nanos, balance.charged_nanos, balance.held_nanos) == (total, total, 0)
    assert balance.open_bookings == 0
    assert balance.spent_nanos < LIMIT_NANOS // 100, "the lane used under 1 % of its budget"

    refunded = harness.events("recall", kinds=["refunded"])
    assert len(refunded) == sum(call.ending == "refused" for call in calls) > 0
    assert all(event.amount_nanos == 0 and event.http_status == 403 for event in refunded)
    assert not harness.events("recall", kinds=["denied"])

    harness.advance_us(WINDOW_SECONDS * 1_000_000)
    idle = harness.balance()
    assert (idle.spent_nanos, idle.held_nanos, idle.charged_nanos) == (0, 0, 0)
    assert idle.available_nanos == LIMIT_NANOS
