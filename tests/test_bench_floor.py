"""The PostgreSQL floor (bench/pg_floor.py), the latency proxy (bench/latency_proxy.py)
and the table rows made of them (bench/report.py): ratios and targets computed
from given figures, the proxy's delay and order, the floor's move on a real
database. No speed is asserted but the proxy's delay being at least what it says."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from bench import latency_proxy, pg_floor, report
from tests import bench_servers

DELAY_SECONDS = 0.02


# The latency proxy ----------------------------------------------------------------


def test_the_proxy_adds_at_least_its_delay_each_way_and_counts_each_round_trip() -> None:
    with (
        latency_proxy.tcp_echo() as echo_address,
        latency_proxy.LatencyProxy(*echo_address, delay_seconds=DELAY_SECONDS) as proxy,
    ):
        taken = latency_proxy.ping_seconds(proxy.address, 3)
        assert proxy.turns == 3
        assert proxy.connections == 1
    assert min(taken) >= 2 * DELAY_SECONDS
    # A loose sanity bound only: the machine may be busy.
    assert max(taken) < 2 * DELAY_SECONDS + 1.0


def test_the_delay_can_change_while_the_proxy_runs() -> None:
    with (
        latency_proxy.tcp_echo() as echo_address,
        latency_proxy.LatencyProxy(*echo_address) as proxy,
    ):
        latency_proxy.ping_seconds(proxy.address, 1)
        proxy.delay_seconds = DELAY_SECONDS
        (delayed,) = latency_proxy.ping_seconds(proxy.address, 1)
    assert delayed >= 2 * DELAY_SECONDS


def test_the_proxy_keeps_the_order_of_what_it_forwards() -> None:
    messages = [f"message {number:04d};".encode() for number in range(300)]
    expected = b"".join(messages)
    with (
        latency_proxy.tcp_echo() as echo_address,
        latency_proxy.LatencyProxy(*echo_address, delay_seconds=0.002) as proxy,
        socket.create_connection(proxy.address, timeout=10) as connection,
    ):
        for message in messages:
            connection.sendall(message)  # many small chunks, none waiting for the last
        received = b""
        while len(received) < len(expected):
            chunk = connection.recv(65536)
            assert chunk, "the proxy closed the connection"
            received += chunk
    assert received == expected


def test_what_the_proxy_adds_is_measured_against_itself_without_delay() -> None:
    measured = latency_proxy.added_round_trip_seconds(DELAY_SECONDS, pings=3)
    assert measured["added_round_trip_seconds"] >= 2 * DELAY_SECONDS - 0.005
    assert measured["delayed_round_trip_seconds"] >= 2 * DELAY_SECONDS


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError):
        latency_proxy.LatencyProxy("127.0.0.1", 1, delay_seconds=-0.001)


# The table's rows -------------------------------------------------------------------


def _ledger_phase(pairs_per_second: float, server_cpu_ms_per_pair: float) -> dict[str, Any]:
    return {
        "throughput_per_second": pairs_per_second,
        "calls": int(pairs_per_second * 10),
        "latency": {"p50_ms": 80.0, "p99_ms": 160.0},
        "errors": {},
        "denied": 0,
        "lanes": 16,
        "server_usage": {"cpu_ms_per_call": server_cpu_ms_per_pair, "switches_per_call": 100},
    }


def _floor_phase(moves_per_second: float, cpu_ms: float, lanes: int) -> dict[str, Any]:
    return {
        "processes": 2,
        "connections_per_process": 8,
        "lanes": lanes,
        "moves": int(moves_per_second * 10),
        "moves_per_second": moves_per_second,
        "latency": {"p50_ms": 5.0, "p99_ms": 20.0},
        "errors": {},
        "client_cpu_ms_per_move": cpu_ms,
    }


def _results() -> dict[str, Any]:
    """The issue's figures: the ledger's 195 and 125 pairs/s, the floor's
    2,968 and 1,178 moves/s at 0.35 ms of client CPU a move."""
    return {
        "plan": {"saturating_calls": 16},
        "scenarios": {
            "postgres": {
                "phases": {
                    "floor_hot": _floor_phase(1178, 0.39, 1),
                    "hot": _ledger_phase(125, 8.0),
                    "floor_spread": _floor_phase(2968, 0.35, 16),
                    "spread": _ledger_phase(195, 4.0),
                }
            },
            "roundtrips": {
                "delay_seconds": 0.005,
                "proxy": {"added_round_trip_seconds": 0.0105},
                "ledger": {
                    "no_delay": {
                        "pairs": 40,
                        "reserve_mean_seconds": 0.004,
                        "settle_mean_seconds": 0.003,
                        "turns": 400,
                    },
                    "delayed": {
                        "pairs": 40,
                        "reserve_mean_seconds": 0.080,
                        "settle_mean_seconds": 0.070,
                        "turns": 560,
                    },
                },
                "floor": {
                    "no_delay": {"moves": 60, "move_mean_seconds": 0.002, "turns": 420},
                    "delayed": {"moves": 60, "move_mean_seconds": 0.0755, "turns": 420},
                },
            },
        },
    }


def _row(rows: list[report.Row], scenario: str) -> report.Row:
    (found,) = [row for row in rows if row.scenario == scenario]
    return found


def _target(targets: list[report.Target], name: str) -> report.Target:
    (found,) = [target for target in targets if target.name == name]
    return found


def test_the_ledgers_postgres_moves_are_ratios_of_the_floor_of_the_same_shape() -> None:
    rows, targets = report.evaluate(_results())
    # Two moves a pair: 390 moves/s against 2,968; 250 against 1,178.
    spread = _target(targets, "postgres spread lanes moves/s / floor moves/s")
    assert spread.measured == pytest.approx(390 / 2968)
    assert spread.met is False
    hot = _target(targets, "postgres 1 hot lane moves/s / floor moves/s")
    assert hot.measured == pytest.approx(250 / 1178)
    row = _row(rows, "postgres moves vs floor, 16 lanes")
    assert (row.per_second, row.versus, row.met) == (390, "13% of floor", False)
    assert row.target == ">= 35% of floor"
    floor = _row(rows, "postgres floor (bare transaction), 16 lanes, 2 x 8 connections")
    assert floor.per_second == 2968
    assert "client 0.35 ms CPU a move" in floor.notes


def test_the_servers_cpu_a_move_is_set_against_the_floors_client_cpu() -> None:
    rows, targets = report.evaluate(_results())
    # 4.0 ms a pair over both replicas: 2.0 ms a move, 5.7 times 0.35.
    spread = _target(targets, "postgres spread lanes server CPU a move / floor client CPU a move")
    assert spread.measured == pytest.approx(2.0 / 0.35)
    assert spread.met is False
    row = _row(rows, "postgres server CPU a move vs floor, 16 lanes")
    assert row.versus == "2.00 ms: 5.7x floor client 0.35 ms"
    assert row.met is False


def test_the_targets_are_met_at_their_limits() -> None:
    results = _results()
    phases = results["scenarios"]["postgres"]["phases"]
    # 35% of the floor exactly, and 3x its client CPU exactly.
    phases["spread"] = _ledger_phase(2968 * 0.35 / 2, 0.35 * 3 * 2)
    _, targets = report.evaluate(results)
    assert _target(targets, "postgres spread lanes moves/s / floor moves/s").met is True
    cpu = "postgres spread lanes server CPU a move / floor client CPU a move"
    assert _target(targets, cpu).met is True


def test_round_trips_a_move_are_counted_by_the_proxy_and_timed() -> None:
    rows, targets = report.evaluate(_results())
    # Judged on the proxy's count with no delay: 400 turns over 80 moves.
    ledger = _target(targets, "round trips to the database a move (ledger, postgres)")
    assert ledger.measured == pytest.approx(5.0)
    assert ledger.met is True
    row = _row(rows, "round trips a move, ledger on postgres, 1 client")
    assert row.versus == "5.0 round trips"
    # Timed: a pair took 0.150 s with the delay and 0.007 s without, 0.0715 s
    # a move added over 10.5 ms a round trip; 560 turns over 80 moves delayed.
    assert row.notes.startswith(
        "counted 5.0/7.0 a move (no delay/delayed); timed 6.8 (Reserve 7.2, Settle 6.4)"
    )
    floor = _row(rows, "round trips a move, floor (bare transaction)")
    assert floor.versus == "7.0 round trips"
    assert "the proxy counted 7.0 a move" in floor.notes


def test_no_round_trips_without_an_added_round_trip() -> None:
    assert report.round_trips_per_move(0.08, 0.004, 0.0) is None
    assert report.round_trips_per_move(0.074, 0.004, 0.01) == pytest.approx(7.0)


def test_a_skipped_postgres_leaves_every_target_unjudged() -> None:
    results = {
        "plan": {"saturating_calls": 16},
        "scenarios": {
            "postgres": {"skipped": "--skip-postgres"},
            "roundtrips": {"skipped": "--skip-postgres"},
        },
    }
    rows, targets = report.evaluate(results)
    floor_targets = [
        target for target in targets if "floor" in target.name or "round trips" in target.name
    ]
    assert len(floor_targets) == 6
    assert all(target.measured is None and target.met is None for target in floor_targets)
    row = _row(rows, "round trips a move, ledger on postgres, 1 client")
    assert row.notes == "skipped: --skip-postgres"


# The floor on a real database -------------------------------------------------------


@pytest.fixture
def floor_url() -> Iterator[str]:
    """A fresh schema holding the floor's tables and one lane, `floor-00`."""
    with bench_servers.fresh_postgres_schema() as schema_url:
        pg_floor.create_tables(schema_url, ["floor-00"])
        yield schema_url


def _count(url: str, query: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(sa.text(query)).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_the_floors_move_writes_an_event_a_booking_and_the_lane(floor_url: str) -> None:
    mover = pg_floor.Mover(pg_floor.conninfo(floor_url), "floor-00")
    try:
        mover.move("r-1")
        mover.move("r-2")
        with pytest.raises(RuntimeError, match="already booked"):
            mover.move("r-1")
    finally:
        mover.close()
    assert _count(floor_url, "SELECT count(*) FROM events") == 2
    assert _count(floor_url, "SELECT count(*) FROM bookings") == 2
    assert _count(floor_url, "SELECT version FROM lanes WHERE lane = 'floor-00'") == 3
    answered = "SELECT count(*) FROM bookings b JOIN events e ON e.seq = b.answer_seq"
    assert _count(floor_url, answered) == 2


@pytest.mark.postgres
def test_the_floor_reports_moves_and_client_cpu(floor_url: str) -> None:
    workload = pg_floor.FloorWorkload(
        conninfo=pg_floor.conninfo(floor_url),
        lanes=("floor-00",),
        processes=1,
        connections=2,
        warmup_seconds=0.1,
        measure_seconds=0.3,
        id_prefix=f"t{uuid.uuid4().hex[:6]}",
    )
    started = time.monotonic()
    result = pg_floor.measure(workload)
    assert time.monotonic() - started < 60
    assert result["errors"] == {}
    assert result["moves"] > 0 and result["moves_per_second"] > 0
    assert result["client_cpu_ms_per_move"] is not None
    assert result["latency"]["count"] == result["moves"]
    assert _count(floor_url, "SELECT count(*) FROM bookings") >= result["moves"]
