"""The page limits docs/semantics.md states, at their boundary on a running
server: `page_size` defaults to 100 and serves at most 1,000 (more is served
as 1,000, with a token for the rest); a negative one is refused."""

from __future__ import annotations

from typing import Any

import grpc

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.settings import Settings

DEFAULTS = Settings(database_url="sqlite:///unused.db")
MOST = DEFAULTS.max_page_size  # 1000
DEFAULT = DEFAULTS.default_page_size  # 100


def test_event_pages_hold_the_stated_most(ledger_harness: Any) -> None:
    harness = ledger_harness
    harness.make_lane()  # one lane_configured event
    for index in range(MOST):
        harness.reserve(f"r-{index}", request_bytes=1, max_output_tokens=0)
    listed = harness.ledger.ListEvents
    assert len(listed(pb.ListEventsRequest(), timeout=30).events) == DEFAULT
    at_most = listed(pb.ListEventsRequest(page_size=MOST), timeout=30)
    past = listed(pb.ListEventsRequest(page_size=MOST + 1), timeout=30)
    assert len(at_most.events) == len(past.events) == MOST
    assert at_most.next_page_token and past.next_page_token
    rest = listed(pb.ListEventsRequest(page_size=MOST, page_token=past.next_page_token))
    assert len(rest.events) == 1
    refused = harness.fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: listed(pb.ListEventsRequest(page_size=-1), timeout=30),
    )
    assert refused.field == "page_size"


def test_lane_pages_hold_the_stated_most(ledger_harness: Any) -> None:
    harness = ledger_harness
    for index in range(MOST + 1):
        harness.make_lane(f"lane-{index}")
    listed = harness.admin.ListLanes
    assert len(listed(pb.ListLanesRequest(), timeout=30).lanes) == DEFAULT
    past = listed(pb.ListLanesRequest(page_size=MOST + 1), timeout=30)
    assert len(past.lanes) == MOST and past.next_page_token
    rest = listed(pb.ListLanesRequest(page_size=MOST, page_token=past.next_page_token))
    assert len(rest.lanes) == 1 and not rest.next_page_token
