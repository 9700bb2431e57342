"""Thousands of invalid requests, and what must never come back.

A seeded generator (LEDGER_FUZZ_SEED picks another seed; the seed is in every
failure message) sends bad credentials, undecodable bytes, requests with a
broken field, oversized messages and junk metadata. Every answer must have a
definite status (never UNKNOWN, and never INTERNAL: bad input is the caller's
fault, not a crash), must leak no SQL, path, URL or traceback, and the event
log must be exactly as it was.
"""

from __future__ import annotations

import math
import os
import random
import re
import string
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from google.protobuf.message import Message

from ledger_service.domain.grants import Scope
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from tests.security.conftest import (
    HOME_LANE,
    JEV_PRICE,
    Method,
    Outcome,
    SecureLedger,
    all_methods,
    bearer,
)

SEED = int(os.environ.get("LEDGER_FUZZ_SEED", "20261130"))
REQUESTS = 4000
TIME_BUDGET_SECONDS = 25.0
STREAM_TIMEOUT_SECONDS = 2.0
MAX_INT64 = 2**63 - 1
# Leaks: SQL, drivers, database URLs, paths and tracebacks. The generator never
# produces these itself, so a match can only come from the server.
LEAK = re.compile(
    r"SELECT|INSERT|UPDATE |DELETE |Traceback|sqlalchemy|psycopg|sqlite|postgres"
    r"|File \"|site-packages|\.py\b|/tmp|ledger_service|Exception calling|Exception iterating"
    r"|Error in service handler|RPC Aborted|OperationalError|IntegrityError",
    re.IGNORECASE,
)
# Every status a bad request may get. INTERNAL and UNKNOWN are not among them.
ACCEPTABLE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED,  # a method the servicer does not implement yet
}
# What the generator's text is made of: no '.', '/' or upper case, so that no
# echoed input can look like a path, a file name or an SQL keyword.
SAFE_CHARACTERS = string.ascii_lowercase + string.digits + "-_:@+"
ODD_CHARACTERS = [" ", "\t", "\x00", "\x7f", "é", "☃", "\u202e", "\U0001f4b8", "'", '"', "%"]


class Generator:
    def __init__(self, rng: random.Random, ledger: SecureLedger) -> None:
        self.rng = rng
        self.ledger = ledger
        self.methods = {method.name: method for method in all_methods()}

    # Values.

    def text(self, low: int = 1, high: int = 40) -> str:
        return "".join(self.rng.choices(SAFE_CHARACTERS, k=self.rng.randint(low, high)))

    def bad_name(self) -> str:
        """A lane or model name no rule accepts."""
        # A name ending in "\n" is left out: the core accepts it today (see
        # test_a_trailing_newline_is_not_a_valid_name).
        choice = self.rng.randrange(4)
        if choice == 0:
            return ""
        if choice == 1:
            return "a" * self.rng.choice([201, 1000, 5000])
        if choice == 2:
            return self.text(1, 10) + self.rng.choice(ODD_CHARACTERS) + self.text(0, 10)
        return "-" + self.text()

    def unknown_lane(self) -> str:
        return "nolane-" + self.text(4, 20)

    def bad_id(self) -> str:
        choice = self.rng.randrange(3)
        if choice == 0:
            return ""
        if choice == 1:
            return "r" * self.rng.choice([201, 1000, 20_000])
        # Not a final "\n": see test_a_trailing_newline_is_not_a_valid_name.
        return self.text(1, 10) + self.rng.choice([" ", "\x00", "é", "☃"]) + self.text(0, 5)

    def negative(self) -> int:
        return self.rng.choice([-1, -(2**31), -MAX_INT64 - 1, -self.rng.randint(1, 10**12)])

    def bad_duration(self) -> duration_pb2.Duration:
        return self.rng.choice(
            [
                duration_pb2.Duration(seconds=-1),
                duration_pb2.Duration(seconds=MAX_INT64),
                duration_pb2.Duration(seconds=-MAX_INT64),
                duration_pb2.Duration(seconds=1, nanos=-5),
                duration_pb2.Duration(nanos=2_000_000_000),
                duration_pb2.Duration(seconds=10**12),
            ]
        )

    # Requests: each breaks at least one rule, so none may change anything.

    def reserve(self) -> Message:
        request = pb.ReserveRequest(
            lane=HOME_LANE, reservation_id="fz-" + self.text(), model="jev",
            request_bytes=self.rng.randint(0, 10_000), max_output_tokens=self.rng.randint(0, 500),
        )  # fmt: skip
        breaks: list[Callable[[], None]] = [
            lambda: setattr(request, "lane", self.bad_name()),
            lambda: setattr(request, "lane", self.unknown_lane()),
            lambda: setattr(request, "reservation_id", self.bad_id()),
            lambda: setattr(request, "model", self.bad_name()),
            lambda: setattr(request, "model", "nomodel-" + self.text()),
            lambda: setattr(request, "request_bytes", self.negative()),
            lambda: setattr(request, "max_output_tokens", self.negative()),
            lambda: setattr(request, "estimate_nanos", self.negative()),
            lambda: request.ttl.CopyFrom(self.bad_duration()),
            lambda: request.ttl.CopyFrom(duration_pb2.Duration(seconds=121)),
        ]
        self._break(breaks)
        return request

    def settle(self) -> Message:
        # No booking exists on the fuzzing server, so even a valid Settle ends NOT_FOUND.
        request = pb.SettleRequest(
            lane=self.rng.choice([HOME_LANE, self.unknown_lane()]),
            reservation_id="fz-" + self.text(), outcome=self.rng.choice([pb.SUCCEEDED, pb.UNKNOWN]),
        )  # fmt: skip
        breaks: list[Callable[[], None]] = [
            lambda: setattr(request, "lane", self.bad_name()),
            lambda: setattr(request, "reservation_id", self.bad_id()),
            lambda: setattr(request, "outcome", self.rng.choice([0, 3, 99, 2**31 - 1, -1])),
            lambda: setattr(request, "input_tokens", self.negative()),
            lambda: setattr(request, "output_tokens", self.negative()),
            lambda: setattr(request, "billed_nanos", self.negative()),
            lambda: setattr(request, "http_status", self.rng.choice([-1, 10**6, MAX_INT64])),
        ]
        self._break(breaks)
        return request

    def refund(self) -> Message:
        request = pb.RefundRequest(
            lane=self.rng.choice([HOME_LANE, self.unknown_lane()]),
            reservation_id="fz-" + self.text(), http_status=403,
        )  # fmt: skip
        breaks: list[Callable[[], None]] = [
            lambda: setattr(request, "lane", self.bad_name()),
            lambda: setattr(request, "reservation_id", self.bad_id()),
            lambda: setattr(request, "http_status", self.rng.choice([-1, 200, 999, MAX_INT64])),
            lambda: setattr(request, "reason", "x" * self.rng.choice([10_000, 100_000])),
        ]
        self._break(breaks)
        return request

    def put_lane(self) -> Message:
        lane = pb.Lane(lane="fzlane-" + self.text(), limit_nanos=10**9, prices={"jev": JEV_PRICE})
        breaks: list[Callable[[], None]] = [
            lambda: setattr(lane, "lane", self.bad_name()),
            lambda: setattr(lane, "limit_nanos", self.rng.choice([0, *[self.negative()] * 3])),
            lambda: setattr(lane, "limit_nanos", MAX_INT64),
            lambda: lane.window.CopyFrom(self.bad_duration()),
            lambda: lane.window.CopyFrom(duration_pb2.Duration(seconds=0)),
            lambda: lane.hold_ttl.CopyFrom(self.bad_duration()),
            lambda: lane.hold_ttl.CopyFrom(duration_pb2.Duration(seconds=0)),
            lambda: setattr(
                lane, "bytes_per_token", self.rng.choice([math.nan, math.inf, -1.0, 0.0, 1e300])
            ),
            lambda: setattr(lane, "overhead_tokens", self.negative()),
            lambda: lane.prices.clear(),
            lambda: lane.prices[self.bad_name() or " "].CopyFrom(JEV_PRICE),
            lambda: lane.prices["jev"].CopyFrom(
                pb.ModelPrice(input_nanos_per_million_tokens=self.negative())
            ),
            lambda: setattr(lane, "expire_charge", self.rng.choice([3, 99, -7])),
        ]
        self._break(breaks)
        return pb.PutLaneRequest(lane=lane)

    def read(self, name: str) -> Message:
        method = self.methods[name]
        request: Any = method.request_class()
        fields = request.DESCRIPTOR.fields_by_name
        breaks: list[Callable[[], None]] = []
        if "lane" in fields:
            breaks += [
                lambda: setattr(request, "lane", self.bad_name() or " "),
                lambda: setattr(request, "lane", self.unknown_lane()),
            ]
        if "reservation_id" in fields and name == "GetBooking":
            breaks.append(lambda: setattr(request, "reservation_id", self.bad_id()))
        if "after_seq" in fields:
            breaks.append(lambda: setattr(request, "after_seq", self.negative()))
        if "page_size" in fields:
            breaks.append(lambda: setattr(request, "page_size", -self.rng.randint(1, 2**31 - 1)))
        if "page_token" in fields:
            breaks.append(lambda: setattr(request, "page_token", self.text(1, 300) + "!"))
        if "kinds" in fields:
            breaks.append(lambda: request.kinds.append(self.text()))
        if name == "GetBooking":
            request.lane = HOME_LANE
            request.reservation_id = "fz-" + self.text()
        self._break(breaks)
        message: Message = request
        return message

    def set_time(self) -> Message:
        return self.rng.choice(
            [
                timestamp_pb2.Timestamp(seconds=-(10**12)),
                timestamp_pb2.Timestamp(seconds=MAX_INT64),
                timestamp_pb2.Timestamp(seconds=1, nanos=-1),
                timestamp_pb2.Timestamp(seconds=1, nanos=1_000_000_000),
            ]
        )

    def advance(self) -> Message:
        return self.bad_duration()

    def _break(self, breaks: list[Callable[[], None]]) -> None:
        for corrupt in self.rng.sample(breaks, k=self.rng.randint(1, min(3, len(breaks)))):
            corrupt()

    def structured(self) -> tuple[Method, Message]:
        makers: dict[str, Callable[[], Message]] = {
            "Reserve": self.reserve,
            "Settle": self.settle,
            "Refund": self.refund,
            "PutLane": self.put_lane,
            "SetTime": self.set_time,
            "Advance": self.advance,
        }
        for name in ("GetBalance", "GetBooking", "ListEvents", "WatchEvents", "GetLane"):
            makers[name] = lambda name=name: self.read(name)  # type: ignore[misc]
        makers["ListLanes"] = lambda: self.read("ListLanes")
        name = self.rng.choice(sorted(makers))
        return self.methods[name], makers[name]()

    # Metadata.

    def noise(self) -> list[tuple[str, str | bytes]]:
        """Metadata that must change nothing: binary junk, bad traceparents."""
        noise: list[tuple[str, str | bytes]] = []
        if self.rng.random() < 0.5:
            noise.append(("x-junk-bin", self.rng.randbytes(self.rng.randint(0, 64))))
        if self.rng.random() < 0.3:
            noise.append(("traceparent", self.text(0, 80)))
        if self.rng.random() < 0.2:
            noise.append(("x-junk", self.text(0, 200)))
        return noise

    def bad_credentials(self) -> list[tuple[str, str | bytes]]:
        valid = self.ledger.server.admin_grant
        choice = self.rng.randrange(6)
        if choice == 0:
            return []
        if choice == 1:
            return [("authorization", "Bearer " + self.text(0, 300))]
        if choice == 2:
            position = self.rng.randrange(len(valid))
            flipped = self.rng.choice([c for c in "AQgw-_" if c != valid[position]])
            return [*bearer(valid[:position] + flipped + valid[position + 1 :])]
        if choice == 3:
            return [("authorization-bin", self.rng.randbytes(40))]
        if choice == 4:
            return [("authorization", "Bearer lg1.k1." + self.text(10, 100) + "." + self.text())]
        return [("authorization", self.rng.choice(["Bearer", "bearer  ", "Token x", valid]))]


def _leaks(outcome: Outcome) -> list[str]:
    texts = [outcome.details, *(str(value) for value in outcome.trailing.values())]
    return [match.group(0) for text in texts for match in [LEAK.search(text)] if match]


def test_thousands_of_invalid_requests_change_nothing_and_leak_nothing(
    start_secure_ledger: Callable[..., SecureLedger],
) -> None:
    ledger = start_secure_ledger()
    rng = random.Random(SEED)
    generate = Generator(rng, ledger)
    events_before = ledger.event_count()
    lane_grant = ledger.forge.grant([HOME_LANE], [Scope.CHARGE, Scope.READ])
    counts: dict[grpc.StatusCode, int] = {}
    known = set(generate.methods) - {"GetAudit", "Reconcile"}
    started = time.monotonic()
    sent = 0
    for sent in range(1, REQUESTS + 1):
        kind = rng.random()
        if kind < 0.2:
            method = rng.choice(all_methods())
            request: Message | bytes = rng.randbytes(rng.randint(0, 64))
            metadata = generate.bad_credentials()
        elif kind < 0.35:
            method = rng.choice([m for m in all_methods() if m.name in known])
            request = rng.randbytes(rng.randint(1, 200))
            metadata = list(bearer(ledger.server.admin_grant))
        else:
            method, request = generate.structured()
            grant = lane_grant if rng.random() < 0.3 else ledger.server.admin_grant
            metadata = list(bearer(grant))
        outcome = ledger.caller.call(
            method,
            request,
            [*metadata, *generate.noise()],
            timeout=STREAM_TIMEOUT_SECONDS if method.streaming else 10.0,
        )
        counts[outcome.code] = counts.get(outcome.code, 0) + 1
        context = f"seed {SEED}, request {sent}: {method.path} {request!r:.300} -> {outcome}"
        assert outcome.code in ACCEPTABLE or (
            outcome.code is grpc.StatusCode.OK and isinstance(request, bytes)
        ), context
        assert not _leaks(outcome), context
        if time.monotonic() - started > TIME_BUDGET_SECONDS:
            break
    assert sent >= 1000, f"only {sent} requests in {TIME_BUDGET_SECONDS} s: {counts}"
    assert ledger.event_count() == events_before, f"seed {SEED}: {counts}"
    # Every kind of refusal was exercised.
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    ):
        assert counts.get(code, 0) > 0, counts


@pytest.mark.parametrize("size_bytes", [2 * 1024 * 1024, 10 * 1024 * 1024])
def test_oversized_messages_are_resource_exhausted(
    shared_ledger: SecureLedger, size_bytes: int
) -> None:
    before = shared_ledger.event_count()
    methods = {method.name: method for method in all_methods()}
    huge_id = pb.ReserveRequest(
        lane=HOME_LANE, reservation_id="r" * size_bytes, model="jev", request_bytes=1
    )
    for metadata in (shared_ledger.admin, ()):
        outcome = shared_ledger.caller.call(methods["Reserve"], huge_id, metadata)
        assert outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
        assert not _leaks(outcome)
    assert shared_ledger.event_count() == before


def test_a_thousand_character_id_is_invalid_argument(shared_ledger: SecureLedger) -> None:
    before = shared_ledger.event_count()
    methods = {method.name: method for method in all_methods()}
    for name, request in (
        ("Reserve", pb.ReserveRequest(lane=HOME_LANE, reservation_id="r" * 1000, model="jev")),
        (
            "Settle",
            pb.SettleRequest(lane=HOME_LANE, reservation_id="r" * 1000, outcome=pb.SUCCEEDED),
        ),
        ("Refund", pb.RefundRequest(lane=HOME_LANE, reservation_id="r" * 1000, http_status=403)),
        ("GetBooking", pb.GetBookingRequest(lane=HOME_LANE, reservation_id="r" * 1000)),
    ):
        outcome = shared_ledger.caller.call(methods[name], request, shared_ledger.admin)
        assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, (name, outcome)
        assert outcome.trailing.get("ledger-field") == "reservation_id", (name, outcome)
    assert shared_ledger.event_count() == before


ENUM_LANE = pb.Lane(lane="enumlane", limit_nanos=1, prices={"jev": JEV_PRICE})
ENUM_LANE.expire_charge = 42  # type: ignore[assignment]


def test_unknown_enum_numbers_and_empty_lanes_are_invalid_argument(
    shared_ledger: SecureLedger,
) -> None:
    before = shared_ledger.event_count()
    methods = {method.name: method for method in all_methods()}
    cases: list[tuple[str, Message, str]] = [
        ("Settle", pb.SettleRequest(lane=HOME_LANE, reservation_id="x", outcome=99), "outcome"),  # type: ignore[arg-type]
        ("Settle", pb.SettleRequest(lane=HOME_LANE, reservation_id="x"), "outcome"),
        ("PutLane", pb.PutLaneRequest(lane=ENUM_LANE), "lane.expire_charge"),
        ("Reserve", pb.ReserveRequest(lane="", reservation_id="x", model="jev"), "lane"),
        ("GetBalance", pb.GetBalanceRequest(lane=""), "lane"),
        ("GetLane", pb.GetLaneRequest(lane=""), "lane"),
    ]
    for name, request, field in cases:
        outcome = shared_ledger.caller.call(methods[name], request, shared_ledger.admin)
        assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, (name, outcome)
        assert outcome.trailing.get("ledger-field") == field, (name, outcome)
    assert shared_ledger.event_count() == before


def test_non_utf8_binary_metadata_changes_nothing(shared_ledger: SecureLedger) -> None:
    balance = next(m for m in all_methods() if m.name == "GetBalance")
    junk = (("x-junk-bin", b"\xff\xfe\xfd\x00\x80"), ("traceparent", "00-zz-zz-01"))
    outcome = shared_ledger.caller.call(
        balance, pb.GetBalanceRequest(lane=HOME_LANE), (*shared_ledger.admin, *junk)
    )
    assert outcome.code is grpc.StatusCode.OK, outcome
    outcome = shared_ledger.caller.call(balance, pb.GetBalanceRequest(lane=HOME_LANE), junk)
    assert outcome.code is grpc.StatusCode.UNAUTHENTICATED, outcome


@pytest.mark.parametrize("where", ["lane", "model", "reservation_id"])
def test_a_trailing_newline_is_not_a_valid_name(shared_ledger: SecureLedger, where: str) -> None:
    before = shared_ledger.event_count()
    methods = {method.name: method for method in all_methods()}
    if where == "reservation_id":
        method = methods["Reserve"]
        request: Message = pb.ReserveRequest(
            lane=HOME_LANE, reservation_id="newline\n", model="jev", request_bytes=1
        )
    else:
        method = methods["PutLane"]
        lane, model = ("newline\n", "jev") if where == "lane" else ("newline", "jev\n")
        request = pb.PutLaneRequest(
            lane=pb.Lane(lane=lane, limit_nanos=1000, prices={model: JEV_PRICE})
        )
    outcome = shared_ledger.caller.call(method, request, shared_ledger.admin)
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
    field = {"lane": "lane.lane", "model": "lane.prices", "reservation_id": "reservation_id"}
    assert str(outcome.trailing.get("ledger-field", "")).startswith(field[where]), outcome
    assert shared_ledger.event_count() == before
