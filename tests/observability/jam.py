"""The recall jam's situation (docs/semantics.md, "Why it exists"), scaled
down: a lane whose window is full of estimates, UNKNOWN outcomes booked at their
holds and holds that expired, while its real spend is tiny, so that most of its Reserves are denied.

limit 10_000 nanos; every hold is the cap of 10_000 bytes and 500 output tokens,
486 nanos. Each group is reserved one second after the previous one:

- t0:    3 calls succeed with 100 input tokens:        3 x 10  =    30 real
- t0+1:  10 calls time out, settled UNKNOWN at the hold: 10 x 486 = 4_860
- t0+2:  8 holds with a 1 s ttl that nobody ends:        8 x 486 = 3_888
- t0+3:  2 calls refused with HTTP 403:                   2 x 0
- t0+5:  1 open hold:                                              486
         5 Reserves of 300_000 bytes (cap 8_772) denied: 736 is left

spent 9_264 of 10_000 (92.6%), estimates 8_748 against 30 real (291.6 times),
5 of 29 Reserves denied (17.2%).
"""

from __future__ import annotations

from typing import Any

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

LIMIT_NANOS = 10_000
HOLD_NANOS = 486
DENIED_BYTES = 300_000


def make_jam(ledger: Any) -> None:
    ledger.put_lane(limit_nanos=LIMIT_NANOS)
    for number in range(3):
        ledger.reserve(f"s{number}")
        ledger.settle(f"s{number}", pb.SUCCEEDED, input_tokens=100)
    ledger.advance_seconds(1)
    for number in range(10):
        ledger.reserve(f"u{number}")
        ledger.settle(f"u{number}", pb.UNKNOWN)
    ledger.advance_seconds(1)
    for number in range(8):
        ledger.reserve(f"e{number}", ttl_seconds=1)
    ledger.advance_seconds(1)
    for number in range(2):
        ledger.reserve(f"f{number}")
        ledger.refund(f"f{number}")
    ledger.advance_seconds(2)
    ledger.reserve("open")
    for number in range(5):
        response = ledger.reserve(f"d{number}", request_bytes=DENIED_BYTES)
        assert response.decision == pb.DENIED, response
