"""The last verified point: a start walks the chain on from it, not from genesis.

A clean walk records where it ended and the lanes' heads there; the next walk
starts from that point, so a restart costs the log's tail, not its length.
What came before the point is taken on the point's word: `ledger verify`
walks every link from the start whatever the point says (docs/recovery.md).
"""

from __future__ import annotations

from ledger_service.domain.moves import ReserveCommand
from ledger_service.recovery.rebuild import FULL_LOG_SOURCE, Route
from ledger_service.recovery.snapshots import ChainPoint
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.recovery.verify import Verifier
from tests.recovery.conftest import History


def _point(history: History) -> ChainPoint | None:
    return SqlRecoveryStore(history.engine).checkpoint()


def _head(history: History) -> int:
    return int(history.scalar("SELECT max(seq) FROM events"))  # type: ignore[arg-type]


def _broken_links(history: History) -> list[str]:
    report = Verifier(SqlRecoveryStore(history.engine), 25).verify(history.clock.now_us())
    return report.broken_links


def _reserve(history: History, *rids: str) -> None:
    for rid in rids:
        history.ledger.reserve(ReserveCommand("recall", rid, "jev", 1_000, 10))


def test_a_clean_walk_sets_the_point_and_the_next_walk_moves_it(history: History) -> None:
    assert _point(history) is None
    assert history.recovery().assess().consistent
    point = _point(history)
    assert point is not None and point.position_seq == _head(history)
    with SqlRecoveryStore(history.engine).view() as view:
        assert dict(point.chain_heads) == dict(view.chain_heads(point.position_seq))

    _reserve(history, "later-1", "later-2")
    assert history.recovery().assess().consistent
    moved = _point(history)
    assert moved is not None and moved.position_seq == _head(history) > point.position_seq
    assert moved.chain_heads["recall"] != point.chain_heads["recall"]


def test_links_before_the_point_are_left_to_ledger_verify(history: History) -> None:
    assert history.recovery().assess().consistent
    history.tamper_event(3, 1)
    # The start trusts the point; the full walk does not.
    assert history.recovery().assess().consistent
    assert any("event 3 " in found for found in _broken_links(history))


def test_a_break_after_the_point_is_found_and_the_point_stays(history: History) -> None:
    assert history.recovery().assess().consistent
    point = _point(history)
    assert point is not None
    _reserve(history, "later-1", "later-2")
    history.tamper_event(_head(history), 1)
    assessment = history.recovery().assess()
    assert not assessment.consistent
    assert any("hash chain is broken" in found for found in assessment.findings)
    assert _point(history) == point


def test_a_point_that_no_longer_matches_the_log_is_not_trusted(history: History) -> None:
    assert history.recovery().assess().consistent
    history.tamper_event(3, 1)
    # As if another log had been restored under the same point: the event it
    # names has another hash, so the walk starts from genesis again.
    history.sql("UPDATE chain_checkpoints SET event_hash = 'another log'")
    assert _point(history) is None
    assessment = history.recovery().assess()
    assert any("hash chain is broken" in found for found in assessment.findings)


def test_a_point_beyond_the_log_is_not_trusted(history: History) -> None:
    assert history.recovery().assess().consistent
    history.tamper_event(3, 1)
    head = _head(history)
    history.sql(f"UPDATE chain_checkpoints SET through_seq = {head + 100}")
    assessment = history.recovery().assess()
    assert any("hash chain is broken" in found for found in assessment.findings)


def test_a_rebuild_that_walked_every_link_sets_the_point(history: History) -> None:
    # The rebuild checks each link it folds: the snapshot taken after it, and
    # the next start, walk on from its end instead of from genesis again.
    assert _point(history) is None
    history.recovery().rebuild(Route(FULL_LOG_SOURCE, None))
    point = _point(history)
    assert point is not None and point.position_seq == _head(history)
    with SqlRecoveryStore(history.engine).view() as view:
        assert dict(point.chain_heads) == dict(view.chain_heads(point.position_seq))


def test_a_rebuild_past_a_tolerated_break_leaves_the_point(history: History) -> None:
    history.tamper_event(3, 1)
    recovery = history.recovery()
    breaks = tuple(recovery._walk(None, ()).breaks)
    assert breaks
    recovery.rebuild(Route(FULL_LOG_SOURCE, None, tolerated=breaks))
    assert _point(history) is None
    info = recovery.snapshot_after_rebuild()
    assert info is not None and not info.chain_verified
