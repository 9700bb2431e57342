"""A snapshot beside a move still in flight on PostgreSQL.

Lanes commit independently there, so a seq may be committed while a lower one
is still in flight (storage/horizon.py). A snapshot records "the projections
at event N": it must hold every move below N, or a rebuild from it would
never apply the one in flight. Found by tests/recovery/test_kills.py, where a
snapshot taken under load missed a move, and the next assessment, walking on
from the snapshot, refused every move over a chain break that was not there.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.moves import ReserveCommand
from ledger_service.recovery import store as store_module
from ledger_service.storage import translate
from tests.recovery.conftest import History, open_history
from tests.storage.test_independent_lanes import HeldCommits

pytestmark = pytest.mark.postgres

HELD_THREAD = "held-move"
TIMEOUT_SECONDS = 10.0


@pytest.fixture
def history(postgres_schema_url: str) -> Iterator[History]:
    yield from open_history(postgres_schema_url, bookings=8)


def _reserve(history: History, lane: str, rid: str) -> Any:
    return history.ledger.reserve(ReserveCommand(lane, rid, "jev", 1_000, 10))


def _lock_waiters(history: History) -> int:
    """Sessions waiting for an advisory lock."""
    with history.engine.connect() as connection:
        return int(
            connection.execute(
                sa.text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
            ).scalar_one()
        )


def test_a_snapshot_beside_a_move_in_flight_holds_that_move(
    history: History, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCommits(monkeypatch, HELD_THREAD)
    recovery = history.recovery()
    with (
        concurrent.futures.ThreadPoolExecutor(1, HELD_THREAD) as mover,
        concurrent.futures.ThreadPoolExecutor(1, "snapshot") as snapshotter,
    ):
        holding = mover.submit(_reserve, history, "dreaming", "held")
        assert held.reached.wait(TIMEOUT_SECONDS)
        _reserve(history, "recall", "after-the-held-one")  # a higher seq, committed
        taking = snapshotter.submit(recovery.take_snapshot)
        # The snapshot either waits for the move in flight or ends without it.
        give_up = time.monotonic() + TIMEOUT_SECONDS
        while not taking.done() and not _lock_waiters(history):
            assert time.monotonic() < give_up, "the snapshot neither ended nor waited"
            time.sleep(0.01)
        held.release.set()
        held_seq = holding.result(timeout=TIMEOUT_SECONDS).event.seq
        snapshot = taking.result(timeout=TIMEOUT_SECONDS)
    assert snapshot is not None and snapshot.chain_verified
    assert snapshot.position_seq > held_seq
    # The snapshot holds the held move: its lane's next event links to it, and
    # an assessment that starts from the snapshot finds every link whole.
    _reserve(history, "dreaming", "next")
    assessment = history.recovery().assess()
    assert assessment.consistent, assessment.findings


def test_a_snapshot_gives_up_on_a_move_that_stays_in_flight(
    history: History, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wait is bounded (SETTLE_WAIT_MS): the snapshot is tried again later,
    # and the moves it held back go on.
    monkeypatch.setattr(store_module, "SETTLE_WAIT_MS", 50)
    held = HeldCommits(monkeypatch, HELD_THREAD)
    with concurrent.futures.ThreadPoolExecutor(1, HELD_THREAD) as mover:
        holding = mover.submit(_reserve, history, "dreaming", "held")
        assert held.reached.wait(TIMEOUT_SECONDS)
        with pytest.raises(StoreUnavailable) as refused:
            history.recovery().take_snapshot()
        # Its own bound, not a deadline of the store's: lock_not_available.
        assert refused.value.__cause__ is not None
        assert translate.driver_code(refused.value.__cause__) == "55P03"
        assert _reserve(history, "recall", "after-the-refused-snapshot").admitted
        held.release.set()
        assert holding.result(timeout=TIMEOUT_SECONDS).admitted
    assert history.recovery().take_snapshot() is not None
