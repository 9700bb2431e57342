"""A log whose replay would refuse an event (an event deleted by hand, in the
middle of the log) is not a source a plan may choose (docs/recovery.md, the
planner): the plan refuses it, naming the event, before anything is written."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import pytest

from ledger_service import cli
from ledger_service.domain.events import Outcome
from ledger_service.domain.moves import ReserveCommand, SettleCommand
from ledger_service.recovery.plan import RecoveryPolicy, Verdict
from ledger_service.recovery.rebuild import FULL_LOG_SOURCE, Route
from ledger_service.recovery.store import RebuildFailed
from tests.recovery.conftest import History, open_history

# More events than the planner's rate sample (recovery_sample_events, 2,000).
BOOKINGS = 1_300


@pytest.fixture(scope="module")
def long_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, int]:
    path = tmp_path_factory.mktemp("long") / "ledger.db"
    for history in open_history(f"sqlite:///{path}", bookings=BOOKINGS):
        now_us = history.clock.now_us()
    return path, now_us


@pytest.fixture
def long_history(
    long_template: tuple[pathlib.Path, int], tmp_path: pathlib.Path
) -> Iterator[History]:
    """A SQLite history of a few thousand events."""
    target = tmp_path / "copy.db"
    target.write_bytes(long_template[0].read_bytes())
    yield from open_history(f"sqlite:///{target}", long_template[1])


def _delete_a_settled_reserve_after(history: History, after_seq: int) -> tuple[int, int, str, str]:
    """Deletes by hand the first reserve past `after_seq` whose booking is
    settled later; (the reserve's seq, the settle's seq, lane, booking)."""
    reserve, settle, lane, booking = _first_settled_reserve(history, after_seq)
    history.sql("DROP TRIGGER events_refuse_delete", f"DELETE FROM events WHERE seq = {reserve}")
    return reserve, settle, lane, booking


def _first_settled_reserve(history: History, after_seq: int) -> tuple[int, int, str, str]:
    with history.engine.connect() as connection:
        row = connection.exec_driver_sql(
            "SELECT r.seq, s.seq, r.lane, r.reservation_id FROM events r JOIN events s "
            "ON s.lane = r.lane AND s.reservation_id = r.reservation_id AND s.kind = 'settled' "
            f"WHERE r.kind = 'reserved' AND r.seq > {after_seq} ORDER BY r.seq LIMIT 1"
        ).one()
    return int(row[0]), int(row[1]), str(row[2]), str(row[3])


def _recover(capsys: pytest.CaptureFixture[str], url: str, *more: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["recover", "--budget-seconds", "600", *more, "--database-url", url])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_log_with_an_event_deleted_past_the_rate_sample_is_refused_not_admitted(
    long_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reserve of a settled booking deleted past the planner's sample of
    2,000 events: the plan said ADMISSIBLE with --max-risk 1, then the
    rebuild failed on the settle ("event N cannot be applied"), leaving the
    projections empty and the marker `rebuilding`."""
    history = long_history
    assert int(history.scalar("SELECT MAX(seq) FROM events")) > 2_400  # type: ignore[arg-type]
    _, settle, lane, booking = _delete_a_settled_reserve_after(history, 2_100)
    bookings_before = history.scalar("SELECT COUNT(*) FROM bookings")

    code, out, err = _recover(capsys, history.url, "--max-risk", "1")

    assert code == 1, err
    manifest = json.loads(out)
    assert manifest["verdict"] == "HARD_ABORT", manifest
    assert "restore the database" in manifest["directive"] and "backup" in manifest["directive"]
    [log] = [source for source in manifest["sources"] if source["source_id"] == FULL_LOG_SOURCE]
    assert not log["possible"], log
    assert f"event {settle} cannot be applied" in log["detail"], log
    assert f"booking {booking!r}" in log["detail"] and f"lane {lane!r}" in log["detail"], log
    assert "no reserve before it" in log["detail"], log
    # Nothing was written: the projections and the marker are as they were.
    assert history.scalar("SELECT COUNT(*) FROM bookings") == bookings_before
    assert history.scalar("SELECT state FROM projection_position") == "current"


def test_the_default_policy_refuses_it_in_one_step(
    long_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not RISK_TOO_HIGH with a pointer to --max-risk 1, which cannot help."""
    _, settle, _, _ = _delete_a_settled_reserve_after(long_history, 2_100)
    code, out, err = _recover(capsys, long_history.url)
    assert code == 1, err
    manifest = json.loads(out)
    assert manifest["verdict"] == "HARD_ABORT", manifest
    assert f"event {settle} cannot be applied" in out


def test_an_event_deleted_within_the_rate_sample_is_a_refusal_too(
    long_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """Measuring the rate folds the log's first events: it used to fail on
    the settle, and `ledger recover` exited 2 without a manifest."""
    _, settle, _, _ = _delete_a_settled_reserve_after(long_history, 0)
    code, out, err = _recover(capsys, long_history.url, "--max-risk", "1")
    assert code == 1, err
    assert json.loads(out)["verdict"] == "HARD_ABORT"
    assert f"event {settle} cannot be applied" in out


def test_a_rebuild_that_meets_the_event_names_its_seq_lane_and_booking(
    long_history: History,
) -> None:
    """`ledger rebuild` skips the planner: it stops on the event, and says
    which it is and what is wrong with it."""
    _, settle, lane, booking = _delete_a_settled_reserve_after(long_history, 2_100)
    recovery = long_history.recovery(batch_events=1000)
    # Past the broken link, as a rebuild whose plan accepted it goes.
    accepted = tuple(recovery._walk(None, ()).breaks)
    assert [found.seq for found in accepted] == [settle]
    with pytest.raises(RebuildFailed) as failed:
        recovery.rebuild(Route(FULL_LOG_SOURCE, None, accepted))
    said = str(failed.value)
    assert f"event {settle} cannot be applied" in said, said
    assert f"the settled event of booking {booking!r} in lane {lane!r}" in said, said
    assert "no reserve before it in the log" in said, said


def test_a_whole_log_is_still_admitted(
    long_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    long_history.sql("DELETE FROM bookings")
    code, out, err = _recover(capsys, long_history.url)
    assert code == 0, err
    assert json.loads(out)["verdict"] == "ADMISSIBLE"
    assert cli.main(["verify", "--database-url", long_history.url]) == 0


def test_a_reserve_deleted_before_a_snapshot_whose_settle_follows_it_is_refused_after_one_try(
    long_history: History, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The snapshot's chain heads end on the deleted reserve, so the walk
    from it sees no broken link: the plan chose the snapshot, and the
    rebuild failed on the settle. It is now planned again, knowing the
    event, and refused (exit 1) instead of failing at every check."""
    history = long_history
    history.ledger.reserve(ReserveCommand("recall", "x", "jev", 35_000, 1000))
    reserve = int(history.scalar("SELECT MAX(seq) FROM events"))  # type: ignore[arg-type]
    assert history.recovery().take_snapshot() is not None
    history.ledger.settle(SettleCommand("recall", "x", Outcome.UNKNOWN))
    settle = reserve + 1
    history.sql("DROP TRIGGER events_refuse_delete", f"DELETE FROM events WHERE seq = {reserve}")

    code, out, err = _recover(capsys, history.url, "--max-risk", "1")

    assert code == 1, err
    manifest = json.loads(out)
    assert manifest["verdict"] == "HARD_ABORT", manifest
    refused = f"event {settle} cannot be applied: the settled event of booking 'x'"
    assert all(refused in source["detail"] for source in manifest["sources"]), manifest
    assert f"rebuild stopped: {refused}" in caplog.text, caplog.text


def test_the_plan_refuses_it_on_both_databases(history: History) -> None:
    """The dry run of the fold is the rebuild's, on SQLite and on PostgreSQL."""
    reserve, settle, lane, booking = _first_settled_reserve(history, 20)
    if history.engine.dialect.name == "sqlite":
        history.sql("DROP TRIGGER events_refuse_delete")
    else:
        history.sql("ALTER TABLE events DISABLE TRIGGER events_refuse_update_delete")
    history.sql(f"DELETE FROM events WHERE seq = {reserve}")
    recovery = history.recovery(sample_events=10)
    outcome = recovery.recover(RecoveryPolicy(600.0, 1.0), "test")
    assert outcome.manifest is not None and not outcome.ready
    assert outcome.manifest.verdict is Verdict.HARD_ABORT, outcome.manifest.to_json()
    [log] = outcome.manifest.sources
    refused = f"event {settle} cannot be applied: the settled event of booking {booking!r}"
    assert f"{refused} in lane {lane!r}" in log.detail, log.detail
    assert history.scalar("SELECT state FROM projection_position") == "current"
