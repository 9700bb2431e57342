"""The server's side of recovery: rebuild at start when admissible, a clean
refusal when not (up, NOT_SERVING, every move UNAVAILABLE with the reason
RECOVERY_REQUIRED, the log still readable), and serving again once an
operator's `ledger recover` has made the projections whole. Also the CLI.
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_service import cli
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from tests.recovery.conftest import History

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Running:
    def __init__(self, server: LedgerServer) -> None:
        self.server = server
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        self.ledger = pb_grpc.LedgerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def status(self) -> int:
        answer = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return int(answer.status)

    def wait_for(self, status: int, seconds: float = 10.0) -> None:
        deadline = time.monotonic() + seconds
        while self.status() != status:
            assert time.monotonic() < deadline, f"health never became {status}"
            time.sleep(0.05)

    def reserve(self, rid: str) -> pb.ReserveResponse:
        request = pb.ReserveRequest(
            lane="recall", reservation_id=rid, model="jev", request_bytes=35_000,
            max_output_tokens=1000,
        )  # fmt: skip
        answer: pb.ReserveResponse = self.ledger.Reserve(request, timeout=10)
        return answer

    def refused(self, call: Callable[[], object]) -> str:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        error = caught.value
        assert isinstance(error, grpc.Call) and error.code() is grpc.StatusCode.UNAVAILABLE
        return str(dict(error.trailing_metadata() or ()).get("ledger-reason"))


@pytest.fixture
def start(tmp_path: pathlib.Path) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def run(history: History, **overrides: Any) -> Running:
        values: dict[str, Any] = {
            "database_url": history.url,
            "data_dir": tmp_path / "server",
            "listen": "127.0.0.1:0",
            "auth_enabled": False,
            "sweep_interval_seconds": 0.05,
            "recovery_check_interval_seconds": 0.1,
        }
        values.update(overrides)
        server = LedgerServer(Settings(**values))
        server.start()
        started.append(Running(server))
        return started[-1]

    yield run
    for running in started:
        running.channel.close()
        running.server.stop(0)


def _ledger(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_server_rebuilds_truncated_bookings_before_it_serves(
    sqlite_history: History,
    start: Callable[..., Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    history = sqlite_history
    before = history.projected_amounts()
    history.sql("DELETE FROM bookings")
    caplog.set_level(logging.INFO, logger="ledger.recovery")
    running = start(history)
    assert running.status() == SERVING
    assert history.projected_amounts() == before
    [manifest] = SqlRecoveryStore(history.engine).manifests()
    assert (manifest["verdict"], manifest["outcome"]) == ("ADMISSIBLE", "rebuilt")
    logged = [r.getMessage() for r in caplog.records if "recovery manifest" in r.getMessage()]
    assert logged and json.loads(logged[0].split(": ", 1)[1])["digest"] == manifest["digest"]
    assert running.reserve("after").decision == pb.ADMITTED


def test_over_budget_the_server_refuses_until_an_operator_recovers(
    sqlite_history: History,
    start: Callable[..., Running],
    capsys: pytest.CaptureFixture[str],
) -> None:
    history = sqlite_history
    history.sql("DELETE FROM bookings WHERE lane = 'recall'")
    running = start(history, recovery_budget_seconds=0.0)
    assert running.status() == NOT_SERVING
    assert running.refused(lambda: running.reserve("r-new")) == "RECOVERY_REQUIRED"
    balance = pb.GetBalanceRequest(lane="recall")
    assert running.refused(lambda: running.ledger.GetBalance(balance, timeout=5)) == (
        "RECOVERY_REQUIRED"
    )
    # The log is the authority and stays readable, with its hash chain.
    events = running.ledger.ListEvents(pb.ListEventsRequest(lane="recall"), timeout=5).events
    assert [len(event.hash) for event in events[:3]] == [64, 64, 64]
    assert events[0].previous_hash == "" and events[1].previous_hash == events[0].hash
    [manifest] = SqlRecoveryStore(history.engine).manifests()
    assert (manifest["verdict"], manifest["outcome"]) == ("EXCEEDS_BUDGET", "refused")
    code, out, err = _ledger(
        capsys, "recover", "--budget-seconds", "60", "--database-url", history.url
    )
    assert code == 0, err
    assert json.loads(out)["verdict"] == "ADMISSIBLE"
    assert "replay:" in err  # progress on stderr
    running.wait_for(SERVING)
    assert running.reserve("r-new").decision == pb.ADMITTED


def test_a_tampered_log_is_refused_and_named_by_verify(
    sqlite_history: History,
    start: Callable[..., Running],
    capsys: pytest.CaptureFixture[str],
) -> None:
    history = sqlite_history
    settled = history.scalar("SELECT MIN(seq) FROM events WHERE kind = 'settled'")
    history.tamper_event(int(str(settled)), 1)
    running = start(history)
    assert running.status() == NOT_SERVING
    assert running.refused(lambda: running.reserve("x")) == "RECOVERY_REQUIRED"
    url = ("--database-url", history.url)
    code, out, _ = _ledger(capsys, "verify", *url)
    assert code == 1 and f"first: broken link: event {settled} " in out
    [advice] = [line for line in out.splitlines() if line.startswith("next:")]
    assert advice.startswith("next: `ledger recover` plans a rebuild")
    code, out, _ = _ledger(capsys, "recover", "--budget-seconds", "60", *url)
    assert code == 1 and json.loads(out)["verdict"] == "RISK_TOO_HIGH"
    code, out, _ = _ledger(capsys, "recover", "--budget-seconds", "60", "--max-risk", "1", *url)
    assert code == 0 and json.loads(out)["verdict"] == "ADMISSIBLE"
    running.wait_for(SERVING)
    assert running.reserve("x").decision == pb.ADMITTED


@pytest.mark.parametrize(
    ("damage", "told"),
    [
        ("over budget", "ledger recover --budget-seconds"),
        ("tampered", "--max-risk 1"),
    ],
)
def test_a_refusal_tells_the_operator_in_the_log_what_to_do(
    sqlite_history: History,
    start: Callable[..., Running],
    caplog: pytest.LogCaptureFixture,
    damage: str,
    told: str,
) -> None:
    """A refused start is one the operator must act on: the log line that says
    moves are refused says how, for the verdict the planner gave."""
    caplog.set_level(logging.INFO)
    history = sqlite_history
    if damage == "over budget":
        history.sql("DELETE FROM bookings WHERE lane = 'recall'")
        running = start(history, recovery_budget_seconds=0.0)
    else:
        settled = history.scalar("SELECT MIN(seq) FROM events WHERE kind = 'settled'")
        history.tamper_event(int(str(settled)), 1)
        running = start(history)
    assert running.status() == NOT_SERVING
    [refused] = [r.getMessage() for r in caplog.records if "projections refused" in r.getMessage()]
    assert told in refused and "ledger verify" in refused, refused
    assert "serves again by itself" in refused, refused


def test_a_caller_of_a_refused_server_is_told_an_operator_must_act_not_to_retry(
    sqlite_history: History,
    start: Callable[..., Running],
) -> None:
    """The planner refused (a tampered log): no rebuild runs by itself, so
    "the ledger is recovering its projections from the log; retry later"
    was untrue for as long as nobody acted. The reason stays
    RECOVERY_REQUIRED; the message says what the log line says."""
    history = sqlite_history
    settled = history.scalar("SELECT MIN(seq) FROM events WHERE kind = 'settled'")
    history.tamper_event(int(str(settled)), 1)
    running = start(history)
    assert running.status() == NOT_SERVING
    with pytest.raises(grpc.RpcError) as caught:
        running.reserve("x")
    error = caught.value
    assert isinstance(error, grpc.Call) and error.code() is grpc.StatusCode.UNAVAILABLE
    assert dict(error.trailing_metadata() or ()).get("ledger-reason") == "RECOVERY_REQUIRED"
    said = error.details() or ""
    assert "retry later" not in said and "recovering" not in said, said
    assert "operator" in said and "ledger verify" in said and "--max-risk 1" in said, said


def test_verify_says_what_to_do_when_recover_cannot_see_the_broken_link(
    sqlite_history: History,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An event's hash changed before the newest snapshot, the projections
    whole: verify fails on it, but recover walks the chain only after the
    snapshot and says the projections are consistent. verify's "next" line
    sent the operator to recover alone, which ends the same way every time."""
    history = sqlite_history
    url = ("--database-url", history.url)
    assert _ledger(capsys, "snapshot", *url)[0] == 0
    refunded = int(str(history.scalar("SELECT MIN(seq) FROM events WHERE kind = 'refunded'")))
    history.sql(
        "DROP TRIGGER events_refuse_update",
        f"UPDATE events SET hash = '{'0' * 64}' WHERE seq = {refunded}",
        """CREATE TRIGGER events_refuse_update BEFORE UPDATE ON events
           BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
    )
    code, out, _ = _ledger(capsys, "recover", "--budget-seconds", "60", *url)
    assert code == 0, out
    code, out, _ = _ledger(capsys, "verify", *url)
    assert code == 1 and f"first: broken link: event {refunded} " in out, out
    assert "restore the database from a backup" in out, out


def test_a_snapshot_that_cannot_match_a_log_changed_before_it_is_not_served(
    sqlite_history: History,
    start: Callable[..., Running],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A booking's every event deleted by hand, before the newest snapshot
    and the verified point: the snapshot still holds the booking. The server
    restored it, saw the projections still differ from the log ("no
    snapshot: ... bookings are projected but the log answers ..."), and
    served them all the same."""
    history = sqlite_history
    assert history.recovery().take_snapshot() is not None
    first = "(SELECT MIN(seq) FROM events WHERE kind = 'reserved')"
    history.sql(
        "DROP TRIGGER events_refuse_delete",
        "DELETE FROM events WHERE (lane, reservation_id) = "
        f"(SELECT lane, reservation_id FROM events WHERE seq = {first})",
    )
    running = start(history)
    assert running.status() == NOT_SERVING
    assert running.refused(lambda: running.reserve("x")) == "RECOVERY_REQUIRED"
    url = ("--database-url", history.url)
    code, out, _ = _ledger(capsys, "recover", "--budget-seconds", "60", "--max-risk", "1", *url)
    assert code == 0 and json.loads(out)["chosen"] == ["log"], out
    running.wait_for(SERVING)
    assert running.reserve("x").decision == pb.ADMITTED


def test_a_refused_server_with_a_slow_sweeper_still_checks_at_its_own_interval(
    sqlite_history: History,
    start: Callable[..., Running],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The recovery checks rode on the sweeper's turns: with `--sweep-interval
    3600` a refused server took an operator's `ledger recover` up to an hour
    later, not at recovery_check_interval_seconds as docs/recovery.md says."""
    history = sqlite_history
    history.sql("DELETE FROM bookings WHERE lane = 'recall'")
    running = start(history, recovery_budget_seconds=0.0, sweep_interval_seconds=3600.0)
    assert running.status() == NOT_SERVING
    code, _, err = _ledger(
        capsys, "recover", "--budget-seconds", "60", "--database-url", history.url
    )
    assert code == 0, err
    running.wait_for(SERVING, seconds=5)


def test_a_move_that_finds_the_marker_gone_closes_the_gate_until_rebuilt(
    sqlite_history: History, start: Callable[..., Running]
) -> None:
    history = sqlite_history
    running = start(history)
    assert running.reserve("a").decision == pb.ADMITTED
    history.sql("DELETE FROM projection_position")
    assert running.refused(lambda: running.reserve("b")) == "RECOVERY_REQUIRED"
    # The server plans on its own (admissible here), rebuilds and serves again.
    running.wait_for(SERVING)
    assert running.reserve("b").decision == pb.ADMITTED
    assert history.scalar("SELECT state FROM projection_position") == "current"


def test_the_server_snapshots_every_n_events(
    sqlite_history: History, start: Callable[..., Running]
) -> None:
    history = sqlite_history
    running = start(history, snapshot_every_events=10)
    for index in range(12):
        running.reserve(f"s{index}")
    deadline = time.monotonic() + 10
    while not SqlRecoveryStore(history.engine).snapshots():
        assert time.monotonic() < deadline, "no snapshot was taken"
        time.sleep(0.05)


def test_snapshot_rebuild_and_verify_from_the_command_line(
    sqlite_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ("--database-url", sqlite_history.url)
    events = sqlite_history.scalar("SELECT COUNT(*) FROM events")
    code, out, _ = _ledger(capsys, "snapshot", *url)
    assert code == 0 and out.startswith(f"snapshot 1 at event {events}: 2 lanes, 40 bookings")
    code, out, err = _ledger(capsys, "rebuild", "--from-scratch", *url)
    assert code == 0 and out.startswith("rebuilt from log in ")
    assert f"replay: {events}/{events} (100%)" in err
    code, out, err = _ledger(capsys, "rebuild", *url)
    assert code == 0 and out.startswith("rebuilt from snapshot-1 in ")
    code, out, _ = _ledger(capsys, "verify", *url)
    assert code == 0 and out.startswith(f"verified {events} events, 2 lanes, 40 bookings")


def test_a_rebuild_stopped_by_a_broken_link_lets_recover_go_on_at_once(
    sqlite_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rebuild's message says `ledger recover --max-risk 1` accepts the
    break: that must work now, not once the stopped rebuild's lease runs out."""
    url = ("--database-url", sqlite_history.url)
    settled = sqlite_history.scalar("SELECT MIN(seq) FROM events WHERE kind = 'settled'")
    assert isinstance(settled, int)
    sqlite_history.tamper_event(settled, 1)
    code, _, err = _ledger(capsys, "rebuild", "--from-scratch", *url)
    assert code == 1 and "`ledger recover --max-risk 1` accepts them" in err, err
    code, out, err = _ledger(capsys, "recover", "--budget-seconds", "60", "--max-risk", "1", *url)
    assert code == 0, out + err


@pytest.mark.parametrize("sources", ["0", "-3"])
def test_recover_refuses_fewer_than_one_viable_source(
    sqlite_history: History, capsys: pytest.CaptureFixture[str], sources: str
) -> None:
    """0 is a value given, not the default left out."""
    url = ("--database-url", sqlite_history.url)
    code, _, err = _ledger(
        capsys, "recover", "--budget-seconds", "5", "--min-viable-sources", sources, *url
    )
    assert code == 2 and "at least one viable source" in err, err


def test_a_rebuild_from_the_command_line_ends_with_a_snapshot(
    sqlite_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/recovery.md: "every rebuild ends with one", `ledger rebuild` too."""
    url = ("--database-url", sqlite_history.url)
    events = sqlite_history.scalar("SELECT COUNT(*) FROM events")
    assert not SqlRecoveryStore(sqlite_history.engine).snapshots()
    code, out, _ = _ledger(capsys, "rebuild", "--from-scratch", *url)
    assert code == 0 and out.splitlines()[1] == f"snapshot 1 at event {events}"
    [taken] = SqlRecoveryStore(sqlite_history.engine).snapshots()
    assert taken.position_seq == events
    # At the log's end already: the rebuild from it takes no second one.
    code, out, _ = _ledger(capsys, "rebuild", *url)
    assert code == 0 and out.splitlines()[1] == f"snapshot 1 at event {events}"


def test_the_gate_sits_behind_authentication(
    sqlite_history: History, start: Callable[..., Running]
) -> None:
    history = sqlite_history
    history.sql("DELETE FROM projection_position")
    running = start(history, auth_enabled=True, recovery_budget_seconds=0.0)
    assert running.status() == NOT_SERVING
    with pytest.raises(grpc.RpcError) as caught:
        running.reserve("anonymous")
    error = caught.value
    assert isinstance(error, grpc.Call) and error.code() is grpc.StatusCode.UNAUTHENTICATED


def test_a_read_of_a_lane_row_deleted_by_hand_closes_the_gate_as_a_move_does(
    sqlite_history: History, start: Callable[..., Running]
) -> None:
    """GetBalance and GetLane of a lane whose row was deleted under a serving
    server were answered LANE_NOT_FOUND, final. Now RECOVERY_REQUIRED, which
    closes the gate: the server rebuilds the row from the log and serves
    again by itself."""
    history = sqlite_history
    running = start(history)
    admin = pb_grpc.LaneAdminStub(running.channel)
    assert running.status() == SERVING
    history.sql("DELETE FROM lanes WHERE lane = 'recall'")
    balance = pb.GetBalanceRequest(lane="recall")
    refused = running.refused(lambda: running.ledger.GetBalance(balance, timeout=5))
    assert refused == "RECOVERY_REQUIRED"
    running.wait_for(SERVING)
    assert running.ledger.GetBalance(balance, timeout=5).lane == "recall"
    assert admin.GetLane(pb.GetLaneRequest(lane="recall"), timeout=5).lane == "recall"
    with pytest.raises(grpc.RpcError) as caught:
        admin.GetLane(pb.GetLaneRequest(lane="nowhere"), timeout=5)
    assert isinstance(caught.value, grpc.Call)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND


def test_an_idle_server_sees_a_rebuild_begun_elsewhere(
    sqlite_history: History, start: Callable[..., Running]
) -> None:
    """A `ledger rebuild` run beside an idle server (or another replica's)
    claims the marker: the server turns NOT_SERVING at its next check, not
    at the next move or consistency check, and serves again once the
    claim's lease has run out and it has rebuilt."""
    history = sqlite_history
    running = start(history, consistency_check_interval_seconds=0.0)
    running.wait_for(SERVING)
    now_us = int(time.time() * 1_000_000)
    history.sql(
        "UPDATE projection_position SET state = 'rebuilding', owner = 'elsewhere:1', "
        f"updated_at_us = {now_us}"
    )
    running.wait_for(NOT_SERVING, seconds=5)
    history.sql("UPDATE projection_position SET updated_at_us = 0")  # its lease ran out
    running.wait_for(SERVING, seconds=10)
    assert running.reserve("after").decision == pb.ADMITTED
