"""Every RPC with edge values, as a hostile or careless caller sends them, on
SQLite and PostgreSQL: a seeded random loop (fixed seed, bounded count), so a
failure replays. Each refusal must be a client's status (never INTERNAL,
UNKNOWN or UNAVAILABLE), carry a reason that is a row of
clients/cases/errors.json with that row's status, name its field in the
message, leak no SQL, path or traceback, and change no event. Afterwards the
server is SERVING, takes a normal Reserve and has logged no error."""

from __future__ import annotations

import json
import logging
import pathlib
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from tests.conftest import ledger_settings

SEED = 20261206
CALLS = 150
ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = json.loads((ROOT / "clients" / "cases" / "errors.json").read_text(encoding="utf-8"))
STATUS_OF = {row["reason"]: row["status"] for row in TABLE["reasons"]}
NOT_A_CLIENTS_MISTAKE = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                         grpc.StatusCode.UNAVAILABLE}  # fmt: skip
LEAK = re.compile(r"Traceback|File \"|sqlalchemy|psycopg|sqlite|SELECT |INSERT |/tmp/|\.py\b", re.I)
I64 = 2**63 - 1
TEXTS = ["", " ", "\t\n", "a" * 1024, "e\u0301", "\u00e9", "\u202eabc", "a\x00b", "😀",
         "\x01\x7f", "Fuzz", "fuzz\u200b", "\uff46\uff55\uff5a\uff5a", "../etc/passwd",
         "'; drop table events;--", "%s%n"]  # fmt: skip
NUMBERS = [0, -1, 1, I64, -I64 - 1, 2**31, 2**62 + 1, 10**12 + 1, 2**40 + 1]
ROWS = [b"reservation_id,billed_nanos\nr-1,-5\n", b"\xff\xfe\x00",
        b"reservation_id,billed_usd\nr-1,1e999999999\n",
        b'{"reservation_id": "r-1", "billed_usd": "1e999999999"}\n',
        b'{"reservation_id": "r-1", "billed_nanos": 1e30}\n', b"[1,2]\n",
        b'{"a":' * 5000 + b"\n", b"reservation_id,billed_nanos\n\"r-1,5\n"]  # fmt: skip


@pytest.fixture
def stubs(
    database_url: str,
    tmp_path: pathlib.Path,
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
) -> Iterator[grpc.Channel]:
    """A channel with the admin grant to a server on `database_url`."""
    server = LedgerServer(ledger_settings(tmp_path, database_url=database_url))
    server.start()
    try:
        yield open_ledger_channel(server)
    finally:
        server.stop(0)


class Caller:
    """Random requests, each mostly sound with one or more edge values."""

    def __init__(self, channel: grpc.Channel, rnd: random.Random) -> None:
        self.ledger = pb_grpc.LedgerStub(channel)
        self.admin = pb_grpc.LaneAdminStub(channel)
        self.clock = pb_grpc.TestClockStub(channel)
        self.rnd = rnd

    def text(self, sound: str) -> str:
        return sound if self.rnd.random() < 0.5 else self.rnd.choice(TEXTS)

    def number(self, sound: int) -> int:
        return sound if self.rnd.random() < 0.5 else self.rnd.choice(NUMBERS)

    def duration(self) -> duration_pb2.Duration:
        seconds = self.rnd.choice([0, -1, 120, 315576000000, -315576000000])
        return duration_pb2.Duration(seconds=seconds, nanos=self.rnd.choice([0, -1, 10**9]))

    def timestamp(self) -> timestamp_pb2.Timestamp:
        seconds = self.rnd.choice([-62135596801, -1, 0, 253402300800, I64])
        return timestamp_pb2.Timestamp(seconds=seconds, nanos=self.rnd.choice([0, -1, 10**9]))

    def lane(self) -> pb.Lane:
        lane = pb.Lane(lane=self.text("fuzz"), limit_nanos=self.number(10**9),
                       expire_charge=self.rnd.choice([0, 1, 2, 3, -1]),
                       parent=self.rnd.choice(["", "fuzz", "nope", "Fuzz"]))  # fmt: skip
        lane.window.CopyFrom(self.duration())
        lane.hold_ttl.CopyFrom(self.duration())
        lane.bytes_per_token = self.rnd.choice([0.0, -1.0, float("nan"), float("inf"), 3.5])
        lane.prices[self.text("m")].CopyFrom(
            pb.ModelPrice(
                input_nanos_per_million_tokens=self.number(1000),
                output_nanos_per_million_tokens=self.number(4000),
            )
        )
        return lane

    def moves(self) -> list[Callable[[], Any]]:
        """The calls that may book something."""
        text, number = self.text, self.number
        return [
            lambda: self.admin.PutLane(pb.PutLaneRequest(lane=self.lane())),
            lambda: self.ledger.Reserve(pb.ReserveRequest(
                lane=text("fuzz"), reservation_id=text("r-1"), model=text("m"),
                request_bytes=number(100), max_output_tokens=number(10), ttl=self.duration())),
            lambda: self.ledger.Settle(pb.SettleRequest(
                lane=text("fuzz"), reservation_id=text("r-1"), outcome=self.rnd.choice([0, 3, -1]),
                input_tokens=number(1), output_tokens=number(1), http_status=number(200))),
            lambda: self.ledger.Refund(pb.RefundRequest(
                lane=text("fuzz"), reservation_id=text("r-1"),
                http_status=self.rnd.choice([0, 200, 399, 500, -1, I64]), reason=text(""))),
            lambda: self.ledger.Correct(pb.CorrectRequest(
                lane=text("fuzz"), reservation_id=text("r-1"), charge_nanos=number(1),
                reason=text("why"), correction_id=text("c-1"))),
            lambda: self.ledger.Reconcile(pb.ReconcileRequest(
                format=self.rnd.choice([0, 1, 2, 3]), content=self.rnd.choice(ROWS),
                default_lane=text("fuzz"))),
        ]  # fmt: skip

    def reads(self) -> list[Callable[[], Any]]:
        """The calls that book nothing, and the test clock."""
        text = self.text
        page = self.rnd.choice([-1, -(2**31), 2**31 - 1])
        return [
            lambda: self.admin.GetLane(pb.GetLaneRequest(lane=text("fuzz"))),
            lambda: self.admin.ListLanes(pb.ListLanesRequest(page_size=page, page_token=text(""))),
            lambda: self.ledger.GetBalance(pb.GetBalanceRequest(lane=text("fuzz"))),
            lambda: self.ledger.GetBooking(pb.GetBookingRequest(lane=text("fuzz"),
                                                                reservation_id=text("r-1"))),
            lambda: self.ledger.ListEvents(pb.ListEventsRequest(
                lane=text(""), reservation_id=text(""), kinds=[text("reserved")] * 2,
                page_size=page, page_token=text(""), after_seq=self.number(0))),
            lambda: list(self.ledger.WatchEvents(pb.WatchEventsRequest(
                lane=text("fuzz"), after_seq=self.rnd.choice([-1, -I64 - 1])), timeout=10)),
            lambda: self.ledger.GetAudit(pb.GetAuditRequest(lane=text("fuzz"), biggest=page)),
            lambda: self.clock.SetTime(self.timestamp()),
            lambda: self.clock.Advance(self.duration()),
        ]  # fmt: skip


def _event_count(ledger: pb_grpc.LedgerStub) -> int:
    count, token = 0, ""
    while True:
        page = ledger.ListEvents(pb.ListEventsRequest(page_size=1000, page_token=token))
        count += sum(event.kind != "expired" for event in page.events)
        token = page.next_page_token
        if not token:
            return count


def _check_refusal(error: grpc.RpcError) -> None:
    code, message = error.code(), error.details() or ""
    trailers = {item.key: item.value for item in error.trailing_metadata() or ()}
    assert code not in NOT_A_CLIENTS_MISTAKE, (code, message)
    reason = trailers.get("ledger-reason")
    assert isinstance(reason, str) and STATUS_OF.get(reason) == code.name, (code, reason, message)
    field = trailers.get("ledger-field")
    if code is grpc.StatusCode.INVALID_ARGUMENT and reason != "UNDECODABLE_REQUEST":
        assert isinstance(field, str) and field.split(".")[-1].split("[")[0] in message, message
    shown = [message, *(str(v) for k, v in trailers.items() if k != "grpc-status-details-bin")]
    assert not any(LEAK.search(text) for text in shown), shown


def test_edge_values_are_refused_cleanly_and_change_nothing(
    stubs: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    caller = Caller(stubs, random.Random(SEED))
    lane = pb.Lane(lane="fuzz", limit_nanos=10**9, prices={"m": pb.ModelPrice(
        input_nanos_per_million_tokens=1000, output_nanos_per_million_tokens=4000)})  # fmt: skip
    caller.admin.PutLane(pb.PutLaneRequest(lane=lane))
    for _ in range(CALLS):
        moves = caller.rnd.random() < 0.6
        call = caller.rnd.choice(caller.moves() if moves else caller.reads())
        before = _event_count(caller.ledger)
        try:
            call()
        except grpc.RpcError as error:
            _check_refusal(error)
            assert _event_count(caller.ledger) == before
    _a_huge_exponent_is_a_bad_row(caller.ledger)
    health = health_pb2_grpc.HealthStub(stubs).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    answer = caller.ledger.Reserve(pb.ReserveRequest(
        lane="fuzz", reservation_id="after-the-fuzz", model="m", request_bytes=100,
        max_output_tokens=10))  # fmt: skip
    assert answer.decision in (pb.ADMITTED, pb.DENIED)
    # A client's mistake is no server error: no traceback, no ERROR line.
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def _a_huge_exponent_is_a_bad_row(ledger: pb_grpc.LedgerStub) -> None:
    """int() of 1e999999999 dollars held the server's GIL for minutes."""
    content = b"reservation_id,billed_usd\nr-1,1e999999999\n"
    report = ledger.Reconcile(
        pb.ReconcileRequest(format=pb.ReconcileRequest.CSV, content=content, default_lane="fuzz")
    )
    assert report.bad_count == 1 and report.rows[0].field == "billed_usd", report
