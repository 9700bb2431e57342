"""Broken projections, snapshots and events, and each verdict of the planner.

`history` runs on SQLite and PostgreSQL; `sqlite_history` on SQLite only, for
what does not depend on the dialect (the suite must stay fast).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from ledger_service.application.audit import Auditor
from ledger_service.application.ports import EventQuery
from ledger_service.domain.errors import BookingNotFound, LaneNotFound, RecoveryRequired
from ledger_service.domain.events import Outcome
from ledger_service.domain.moves import RefundCommand, ReserveCommand, SettleCommand
from ledger_service.recovery.plan import RecoveryPolicy, Verdict
from ledger_service.recovery.rebuild import (
    FULL_LOG_SOURCE,
    SNAPSHOT_ROWS_PER_EVENT,
    Recovery,
    RecoveryGuard,
    Route,
)
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.recovery.verify import VerificationReport, Verifier
from tests.recovery.conftest import History, open_history
from tests.storage.conftest import RECALL

DEFAULT = RecoveryPolicy(max_budget_seconds=60.0, max_risk_score=0.3)


def _verify(history: History) -> list[str]:
    report = Verifier(SqlRecoveryStore(history.engine), 25).verify(history.clock.now_us())
    return report.findings


BROKEN = "its content does not match its hash: altered after append"


def _report(history: History) -> VerificationReport:
    return Verifier(SqlRecoveryStore(history.engine), 25).verify(history.clock.now_us())


def _manifests(history: History) -> list[dict[str, object]]:
    return [dict(row) for row in SqlRecoveryStore(history.engine).manifests()]


def test_a_consistent_database_needs_nothing(sqlite_history: History) -> None:
    history = sqlite_history
    assert _verify(history) == []
    recovery = history.recovery()
    assert recovery.assess().consistent
    outcome = recovery.recover(DEFAULT, "test")
    assert outcome.ready and outcome.manifest is None
    assert _manifests(history) == []


def test_truncated_bookings_are_rebuilt_from_the_log(history: History) -> None:
    before = history.projected_amounts()
    balance = history.ledger.balance("recall")
    history.sql("DELETE FROM bookings")
    recovery = history.recovery()
    assessment = recovery.assess()
    assert assessment.findings == (
        f"0 bookings are projected but the log answers {len(before)} reservations",
    )
    outcome = recovery.recover(DEFAULT, "test")
    assert outcome.ready and outcome.manifest is not None
    assert outcome.manifest.verdict is Verdict.ADMISSIBLE and outcome.manifest.chosen == ("log",)
    assert history.projected_amounts() == before
    assert history.ledger.balance("recall") == balance
    assert _verify(history) == []
    [row] = _manifests(history)
    assert (row["verdict"], row["outcome"]) == ("ADMISSIBLE", "rebuilt")
    assert row["digest"] == outcome.manifest.digest
    # The rebuild left a verified snapshot for next time.
    [snapshot] = recovery.store.snapshots()
    assert snapshot.chain_verified and recovery.check_snapshot(snapshot) == ""


def test_an_altered_lane_row_is_found_at_start_and_rebuilt(history: History) -> None:
    """A lanes row that still decodes but is no longer its latest
    configuration (one flipped byte of a model's name in its prices): the
    assessment, not only `ledger verify`, sees it, so that a server does not
    serve from it and refuse a caller's model as the caller's mistake."""
    history.sql(
        "UPDATE lanes SET prices_json = replace(prices_json, '\"jev\"', '\"kev\"') "
        "WHERE lane = 'recall'"
    )
    assert any("lane 'recall': prices" in finding for finding in _verify(history))
    recovery = history.recovery()
    assessment = recovery.assess()
    assert "1 lane differs from its latest configuration in the log" in assessment.findings
    outcome = recovery.recover(DEFAULT, "test")
    assert outcome.ready and outcome.manifest is not None
    assert outcome.manifest.chosen == ("log",)
    assert _verify(history) == [] and recovery.assess().consistent


def test_an_altered_booking_amount_is_found_and_rebuilt(sqlite_history: History) -> None:
    history = sqlite_history
    before = history.projected_amounts()
    history.sql("UPDATE bookings SET amount_nanos = amount_nanos + 1 WHERE reservation_id = 'r7'")
    findings = _verify(history)
    assert any("booking recall/r7: amount_nanos is" in f for f in findings), findings
    recovery = history.recovery()
    assert recovery.assess().findings == ("1 booking differs from its latest event in the log",)
    assert recovery.recover(DEFAULT, "test").ready
    assert history.projected_amounts() == before and _verify(history) == []


def test_verify_names_a_booking_missing_from_the_projection_and_one_not_in_the_log(
    history: History,
) -> None:
    # r7 gone from the projection, and its row back under an id no event has.
    history.sql(
        "UPDATE bookings SET reservation_id = 'r7-unlogged' WHERE reservation_id = 'r7'",
    )
    findings = _verify(history)
    assert "booking recall/r7-unlogged is projected but not in the log" in findings, findings
    assert "booking recall/r7 is in the log but missing from the projection" in findings, findings
    assert len(findings) == 3, findings  # and the facts: "1 bookings differ from ..."


@pytest.mark.postgres
def test_a_damaged_kept_window_is_found_by_verify_and_mended_by_a_rebuild(
    postgres_schema_url: str,
) -> None:
    """PostgreSQL keeps each budget's window sums in window_states, and a move
    reads them: a row altered there would deny Reserves the log can afford."""
    for history in open_history(postgres_schema_url, bookings=8):
        history.ledger.reserve(ReserveCommand("recall", "kept", "jev", 35_000, 1000))
        balance = history.ledger.balance("recall")
        history.sql(
            "UPDATE window_states SET amount_nanos = amount_nanos + 100000000000 "
            "WHERE lane = 'recall'"
        )
        assert history.ledger.balance("recall") != balance, "the damage must show"
        findings = _verify(history)
        assert any("lane 'recall' kept window" in f for f in findings), findings
        history.recovery().rebuild(Route(FULL_LOG_SOURCE, None))
        assert history.ledger.balance("recall") == balance
        assert _verify(history) == []
        # A kept window moved past the log would move the lane's time with it.
        history.ledger.reserve(ReserveCommand("recall", "later", "jev", 35_000, 1000))
        history.sql("UPDATE window_states SET as_of_us = as_of_us + 3600000000")
        findings = _verify(history)
        assert any("kept window is moved to" in f for f in findings), findings


def test_without_its_position_marker_the_ledger_takes_no_move_until_rebuilt(
    sqlite_history: History,
) -> None:
    history = sqlite_history
    history.sql("DELETE FROM projection_position")
    with pytest.raises(RecoveryRequired):
        history.ledger.reserve(ReserveCommand("recall", "new", "jev", 35_000, 1000))
    recovery = history.recovery()
    assert recovery.assess().findings == ("the projections' position marker is missing",)
    outcome = recovery.recover(DEFAULT, "test")
    assert outcome.ready and outcome.manifest is not None
    assert outcome.manifest.verdict is Verdict.ADMISSIBLE
    assert history.ledger.reserve(ReserveCommand("recall", "new", "jev", 35_000, 1000)).admitted
    assert _verify(history) == []


def test_a_tampered_snapshot_is_never_restored(history: History) -> None:
    recovery = history.recovery()
    snapshot = recovery.take_snapshot()
    assert snapshot is not None
    history.sql(f"UPDATE snapshots SET digest = '{'0' * 64}'", "DELETE FROM bookings")
    # Two sources must agree, and only the log is trustworthy: refused, untouched.
    two = RecoveryPolicy(60.0, 0.3, min_viable_sources=2)
    refused = recovery.recover(two, "test")
    assert not refused.ready and refused.manifest is not None
    assert refused.manifest.verdict is Verdict.RISK_TOO_HIGH
    sources = {source.source_id: source for source in refused.manifest.sources}
    tampered = sources[f"snapshot-{snapshot.snapshot_id}"]
    assert tampered.risk_score == 1.0 and "do not give its recorded digest" in tampered.detail
    assert history.scalar("SELECT COUNT(*) FROM bookings") == 0
    assert history.scalar("SELECT state FROM projection_position") == "current"
    assert not tampered.possible  # its restore would fail on the digest
    # One source is enough: the log, not the snapshot, even when any risk is
    # accepted (the cheaper snapshot used to be chosen, and its restore failed).
    outcome = recovery.recover(RecoveryPolicy(60.0, 1.0, 1), "test")
    assert outcome.ready and outcome.manifest is not None
    assert outcome.manifest.chosen == ("log",)
    assert _verify(history) == []


def test_a_tampered_event_breaks_the_chain_and_only_an_operator_accepts_it(
    history: History,
) -> None:
    settled = history.scalar("SELECT MIN(seq) FROM events WHERE kind = 'settled'")
    assert isinstance(settled, int)
    history.tamper_event(settled, 1)
    findings = _verify(history)
    assert findings[0].startswith(f"broken link: event {settled} ")
    assert "altered after append" in findings[0]
    recovery = history.recovery()
    assessment = recovery.assess()
    assert any(f"first: event {settled} " in finding for finding in assessment.findings)
    refused = recovery.recover(DEFAULT, "test")
    assert not refused.ready and refused.manifest is not None
    assert refused.manifest.verdict is Verdict.RISK_TOO_HIGH
    [log_source] = refused.manifest.sources
    assert log_source.risk_score == 1.0
    # An operator may accept the risk (`ledger recover --max-risk 1`): the log
    # is replayed as it is, and a snapshot after the break anchors later checks.
    accepted = recovery.recover(RecoveryPolicy(60.0, 1.0), "operator")
    assert accepted.ready and recovery.assess().consistent
    assert accepted.manifest is not None
    lane = history.scalar(f"SELECT lane FROM events WHERE seq = {settled}")
    assert accepted.manifest.accepted == (f"event {settled} (lane {lane!r}): {BROKEN}",)
    # The evidence stays (the log is append-only): verify names the link, and
    # the recovery that accepted it, every time; and it passes, so that a
    # verify on a schedule goes on telling new damage from what was accepted.
    report = _report(history)
    assert report.findings == [] and report.ok
    [named] = report.accepted
    assert named.startswith(f"broken link: event {settled} (lane {lane!r}): {BROKEN}")
    assert "accepted by recovery manifest" in named and "operator" in named


def test_verify_after_an_accepted_recovery_passes_and_says_what_was_accepted(
    sqlite_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ledger recover --max-risk 1` accepts the log as it is; `ledger verify`
    then exits 0 and lists what was accepted, instead of failing for ever
    with advice to run `recover` again, which finds nothing to do. A link
    broken after the acceptance is a finding again."""
    from ledger_service import cli

    history = sqlite_history
    first, second = (
        int(str(seq))
        for seq in history.engine.connect()
        .exec_driver_sql("SELECT seq FROM events WHERE kind = 'settled' ORDER BY seq LIMIT 2")
        .scalars()
    )
    history.tamper_event(first, 1)
    url = history.url
    assert cli.main(["recover", "--database-url", url, "--budget-seconds", "60",
                     "--max-risk", "1"]) == 0  # fmt: skip
    capsys.readouterr()
    assert cli.main(["verify", "--database-url", url]) == 0
    said = capsys.readouterr().out
    assert ": OK" in said and "1 broken link accepted" in said, said
    assert f"event {first} " in said and "accepted by recovery manifest" in said, said
    assert "next:" not in said
    history.tamper_event(second, 1)
    assert cli.main(["verify", "--database-url", url]) == 1
    said = capsys.readouterr().out
    assert f"first: broken link: event {second} " in said, said


def test_a_tampered_event_before_a_snapshot_is_bypassed_by_the_snapshot(
    sqlite_history: History,
) -> None:
    history = sqlite_history
    recovery = history.recovery()
    assert recovery.take_snapshot() is not None
    before = history.projected_amounts()
    # A reserved event whose booking ended later: no booking names it as its latest.
    reserved = history.scalar(
        "SELECT MIN(answer_seq) FROM bookings WHERE ended_seq > 0 AND state = 'settled'"
    )
    assert isinstance(reserved, int)
    history.tamper_event(reserved, 1)
    # The start-up check walks the chain from the newest snapshot: bounded, so it
    # does not see this; `ledger verify` walks everything and does.
    assert recovery.assess().consistent
    assert _verify(history)[0].startswith(f"broken link: event {reserved} ")
    history.sql("DELETE FROM bookings")
    outcome = recovery.recover(DEFAULT, "test")
    assert outcome.ready and outcome.manifest is not None
    # The snapshot is the cheaper source: the log before it is not read again.
    assert outcome.manifest.chosen == ("snapshot-1",)
    assert history.projected_amounts() == before
    # With the snapshot tampered as well, the log would be replayed from its
    # start: its links are checked first, and the plan is refused before any write.
    history.sql(f"UPDATE snapshots SET digest = '{'0' * 64}'", "DELETE FROM bookings")
    refused = recovery.recover(DEFAULT, "test")
    assert refused.manifest is not None and refused.manifest.verdict is Verdict.RISK_TOO_HIGH
    sources = {source.source_id: source for source in refused.manifest.sources}
    assert sources["log"].risk_score == 1.0 and f"first event {reserved} " in sources["log"].detail
    assert history.scalar("SELECT state FROM projection_position") == "current"


def test_an_altered_latest_event_before_a_snapshot_is_refused_not_rebuilt_again_and_again(
    sqlite_history: History,
) -> None:
    """The snapshot holds what the event said before it was altered: restored,
    its booking still differs from the log, and a server would rebuild from it
    at every check. The altered event is a broken link the operator accepts."""
    history = sqlite_history
    recovery = history.recovery()
    assert recovery.take_snapshot() is not None
    ended = history.scalar("SELECT MIN(ended_seq) FROM bookings WHERE state = 'settled'")
    assert isinstance(ended, int)
    history.tamper_event(ended, 1)
    assessment = recovery.assess()
    assert f"broken link: event {ended} " in "; ".join(assessment.findings)
    refused = recovery.recover(DEFAULT, "test")
    assert not refused.ready and refused.manifest is not None
    assert refused.manifest.verdict is Verdict.RISK_TOO_HIGH, refused.manifest.to_json()
    sources = {source.source_id: source for source in refused.manifest.sources}
    assert not sources["snapshot-1"].possible
    accepted = recovery.recover(RecoveryPolicy(60.0, 1.0), "test")
    assert accepted.ready and accepted.manifest is not None
    assert accepted.manifest.chosen == ("log",)
    assert recovery.assess().consistent


def test_a_budget_too_small_is_a_clean_refusal(sqlite_history: History) -> None:
    history = sqlite_history
    history.sql("DELETE FROM bookings WHERE lane = 'dreaming'")
    recovery = history.recovery()
    refused = recovery.recover(RecoveryPolicy(0.0, 0.3), "test")
    assert not refused.ready and refused.manifest is not None
    assert refused.manifest.verdict is Verdict.EXCEEDS_BUDGET
    assert refused.manifest.total_cost_seconds > 0
    # Nothing was touched: no half-built state.
    assert history.scalar("SELECT COUNT(*) FROM bookings WHERE lane = 'dreaming'") == 0
    assert history.scalar("SELECT state FROM projection_position") == "current"
    assert [row["outcome"] for row in _manifests(history)] == ["refused"]
    assert recovery.recover(RecoveryPolicy(60.0, 0.3), "operator").ready
    assert _verify(history) == []


def test_projections_ahead_of_the_log_are_a_hard_abort(sqlite_history: History) -> None:
    history = sqlite_history
    history.sql("UPDATE projection_position SET last_seq = last_seq + 10")
    recovery = history.recovery()
    refused = recovery.recover(DEFAULT, "test")
    assert refused.manifest is not None
    assert refused.manifest.verdict is Verdict.HARD_ABORT
    assert any("no source holds the events in between" in f for f in refused.manifest.findings)
    # An operator who knows the log is right restores to its end.
    accepting = history.recovery(accept_log_head=True)
    assert accepting.recover(DEFAULT, "operator").ready
    assert _verify(history) == []


def test_an_interrupted_rebuild_is_planned_again_and_a_live_one_is_left_alone(
    sqlite_history: History,
) -> None:
    history = sqlite_history
    before = history.projected_amounts()
    dead = history.recovery(owner="dead")
    route = dead.plan(dead.assess(), DEFAULT).routes["log"]
    dead.rebuild_uncommitted(route)  # ... and the process dies before finishing
    alive = history.recovery(owner="alive")
    outcome = alive.recover(DEFAULT, "test")
    assert not outcome.ready and outcome.manifest is None
    assert "a rebuild by dead is in progress" in outcome.detail
    history.sql("UPDATE projection_position SET updated_at_us = 0")  # its lease ran out
    head = history.scalar("SELECT MAX(seq) FROM events")
    assert alive.assess().findings == (f"a rebuild by dead stopped at event {head}",)
    assert alive.recover(DEFAULT, "test").ready
    assert history.projected_amounts() == before and _verify(history) == []


def test_a_rebuild_runs_in_bounded_batches_with_progress(sqlite_history: History) -> None:
    history = sqlite_history
    recovery: Recovery = history.recovery()
    snapshot = recovery.take_snapshot()
    assert snapshot is not None
    for index in range(30):
        history.ledger.reserve(ReserveCommand("recall", f"tail{index}", "jev", 35_000, 1000))
    seen: list[tuple[str, int, int]] = []
    plan = recovery.plan(recovery.assess(), DEFAULT)
    recovery.rebuild(
        plan.routes[f"snapshot-{snapshot.snapshot_id}"],
        lambda phase, done, total, _elapsed: seen.append((phase, done, total)),
    )
    restored = [done for phase, done, total in seen if phase == "restore"]
    assert restored[-1] == snapshot.rows and restored == sorted(restored)
    assert [entry for entry in seen if entry[0] == "replay"] == [
        ("replay", 25, 30),
        ("replay", 30, 30),
    ]
    seen.clear()
    recovery.rebuild(plan.routes["log"], lambda p, d, t, _e: seen.append((p, d, t)))
    events = history.scalar("SELECT COUNT(*) FROM events")
    assert isinstance(events, int)
    assert [done for _, done, _ in seen] == [*range(25, events, 25), events]
    assert _verify(history) == []


def test_snapshots_come_further_apart_as_the_projections_grow(history: History) -> None:
    """A snapshot copies every row: the server's interval is at least the
    newest snapshot's rows over SNAPSHOT_ROWS_PER_EVENT events, so each event
    pays for a bounded share of the copying."""
    recovery = history.recovery()
    snapshot = recovery.take_snapshot()
    assert snapshot is not None
    spacing = snapshot.rows // SNAPSHOT_ROWS_PER_EVENT
    assert spacing >= 2, "the history is too small to show the spacing"
    assert not recovery.snapshot_due(1)
    for index in range(spacing - 1):
        history.ledger.reserve(ReserveCommand("recall", f"spaced{index}", "jev", 35_000, 1000))
    assert not recovery.snapshot_due(1), "due before its rows were paid for"
    history.ledger.reserve(ReserveCommand("recall", "spaced-last", "jev", 35_000, 1000))
    assert recovery.snapshot_due(1)
    assert not recovery.snapshot_due(spacing + 1), "the configured interval still holds"


def test_verify_reports_progress_within_a_lane(sqlite_history: History) -> None:
    # One lane may hold the whole log: progress comes every batch of events,
    # not only at the end of each lane.
    seen: list[tuple[str, int, int]] = []
    report = Verifier(SqlRecoveryStore(sqlite_history.engine), 10).verify(
        sqlite_history.clock.now_us(),
        lambda phase, done, total, elapsed: seen.append((phase, done, total)),
    )
    assert report.ok
    assert len(seen) > report.lanes + 2, seen
    assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen)
    assert seen[-1] == ("verify", report.events, report.events)


def test_a_server_waiting_for_another_rebuild_says_so_once(
    sqlite_history: History, caplog: pytest.LogCaptureFixture
) -> None:
    """A server restarted after a kill -9 in its own start-up rebuild waits
    out the dead process's lease (30 s), NOT_SERVING: the log must say what
    it waits for and till when, not stay silent all that time."""
    history = sqlite_history
    dead = history.recovery(owner="server host:1")
    dead.rebuild_uncommitted(dead.plan(dead.assess(), DEFAULT).routes["log"])
    guard = RecoveryGuard(
        history.recovery(owner="server host:2"),
        DEFAULT,
        actor="server host:2",
        check_interval_seconds=5,
        consistency_check_seconds=60,
        snapshot_every_events=0,
    )
    with caplog.at_level(logging.WARNING, logger="ledger.recovery"):
        guard.start()
        guard.start()
    said = [r.getMessage() for r in caplog.records if "server host:1" in r.getMessage()]
    assert len(said) == 1, said
    assert "a rebuild by server host:1 is in progress" in said[0]
    assert "rebuild_lease_seconds" in said[0] and "RECOVERY_REQUIRED" in said[0], said[0]
    assert guard.state == RecoveryGuard.PENDING


def test_a_move_on_a_lane_row_deleted_by_hand_is_refused_for_recovery_not_answered(
    history: History,
) -> None:
    # A lanes row deleted under serving replicas: until a consistency check
    # (every 60 s) saw it, every Reserve on the lane was answered
    # LANE_NOT_FOUND, a final answer the client does not retry (all 8 threads
    # of a load stopped on it within 0.3 s). The log says the lane exists.
    history.sql("DELETE FROM lanes WHERE lane = 'recall'")
    with pytest.raises(RecoveryRequired):
        history.ledger.reserve(ReserveCommand("recall", "after-the-delete", "jev", 1_000, 10))
    with pytest.raises(RecoveryRequired):
        history.ledger.settle(SettleCommand("recall", "r1", Outcome.UNKNOWN))
    # A lane the log never configured is still not found.
    with pytest.raises(LaneNotFound):
        history.ledger.reserve(ReserveCommand("nowhere", "r1", "jev", 1_000, 10))


def test_a_settle_of_a_booking_row_deleted_by_hand_is_refused_for_recovery_not_answered(
    history: History,
) -> None:
    # Likewise a booking's row: its Settle was answered BOOKING_NOT_FOUND.
    history.sql("DELETE FROM bookings WHERE reservation_id = 'r1'")
    with pytest.raises(RecoveryRequired):
        history.ledger.settle(SettleCommand("recall", "r1", Outcome.UNKNOWN))
    with pytest.raises(RecoveryRequired):
        history.ledger.refund(RefundCommand("recall", "r1", 429))
    with pytest.raises(BookingNotFound):
        history.ledger.settle(SettleCommand("recall", "never-reserved", Outcome.UNKNOWN))


def test_a_bogus_snapshot_inserted_by_hand_is_no_anchor_for_the_chain_walk(
    sqlite_history: History,
) -> None:
    # A snapshot row copied by hand to a later position, its digest made up:
    # the assessment walked the chain from its heads (the older snapshot's),
    # found links "broken" that were not, and three replicas refused every
    # move for a rebuild of whole projections; the snapshot taken after it
    # then said "the chain before it did NOT check out", and every later one
    # inherited that.
    history = sqlite_history
    recovery = history.recovery()
    real = recovery.take_snapshot()
    assert real is not None
    for index in range(6):
        history.ledger.reserve(ReserveCommand("recall", f"after-{index}", "jev", 1_000, 10))
    later = int(history.scalar("SELECT MAX(seq) FROM events")) - 1  # type: ignore[call-overload]
    history.sql(
        "INSERT INTO snapshots (id, state, position_seq, taken_at_us, format_version, "
        "lanes_count, bookings_count, digest, chain_heads_json, chain_verified) "
        f"SELECT 100, state, {later}, taken_at_us, format_version, lanes_count, "
        f"bookings_count, '{'ab' * 32}', chain_heads_json, chain_verified FROM snapshots "
        f"WHERE id = {real.snapshot_id}",
        "INSERT INTO snapshot_chunks (snapshot_id, chunk_no, kind, payload) "
        "SELECT 100, chunk_no, kind, payload FROM snapshot_chunks "
        f"WHERE snapshot_id = {real.snapshot_id}",
    )
    assessment = recovery.assess()
    assert assessment.consistent, assessment.findings
    taken = recovery.take_snapshot()
    assert taken is not None and taken.chain_verified


def test_a_read_of_a_row_deleted_by_hand_is_refused_for_recovery_as_a_move_is(
    history: History,
) -> None:
    # GetBalance, GetLane and GetBooking of a lane whose row was deleted were
    # answered LANE_NOT_FOUND, final, while a move on it was already refused
    # for recovery. The log reads still serve the lane: the log has it.
    history.sql("DELETE FROM lanes WHERE lane = 'recall'")
    for read in (
        lambda: history.ledger.balance("recall"),
        lambda: history.ledger.get_lane("recall"),
        lambda: history.ledger.booking("recall", "r1"),
        lambda: Auditor(history.store, history.clock).audit("recall"),
    ):
        with pytest.raises(RecoveryRequired):
            read()
    assert history.ledger.list_events(EventQuery(lane="recall", limit=1))
    history.ledger.check_lane("recall")
    # A lane the log never configured is still not found, by every read.
    for read in (
        lambda: history.ledger.balance("nowhere"),
        lambda: history.ledger.get_lane("nowhere"),
        lambda: history.ledger.booking("nowhere", "r1"),
        lambda: Auditor(history.store, history.clock).audit("nowhere"),
        lambda: history.ledger.list_events(EventQuery(lane="nowhere")),
    ):
        with pytest.raises(LaneNotFound):
            read()


def test_a_read_of_a_booking_row_deleted_by_hand_is_refused_for_recovery(
    history: History,
) -> None:
    history.sql("DELETE FROM bookings WHERE reservation_id = 'r1'")
    with pytest.raises(RecoveryRequired):
        history.ledger.booking("recall", "r1")
    with pytest.raises(BookingNotFound):
        history.ledger.booking("recall", "never-reserved")


def test_verify_sums_a_parent_budget_over_its_lanes_in_the_parents_window(
    sqlite_history: History,
) -> None:
    """A parent's window holds its children's bookings, summed over the
    parent's own window (here twice the child's): verify replays them so."""
    history = sqlite_history
    team = dataclasses.replace(RECALL, lane="team", window_us=2 * RECALL.window_us)
    history.ledger.put_lane(team)
    history.ledger.put_lane(dataclasses.replace(RECALL, lane="team-a", parent="team"))
    history.ledger.reserve(ReserveCommand("team-a", "a1", "jev", 35_000, 1000))
    history.clock.advance_us(RECALL.window_us + 1_000_000)
    history.ledger.reserve(ReserveCommand("team-a", "a2", "jev", 35_000, 1000))
    # a1 is out of the child's window but in the parent's: a parent summed in
    # the child's window would be found 1400 short.
    assert history.ledger.balance("team") != history.ledger.balance("team-a")
    assert _verify(history) == []
