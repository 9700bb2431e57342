"""Snapshot retention: the newest complete snapshots stay, with unfinished ones
young enough to be still in progress; the rest go, and their chunks with them."""

from __future__ import annotations

from ledger_service.recovery.snapshots import ProjectionDigest
from ledger_service.recovery.store import SnapshotChunk, SqlRecoveryStore
from tests.recovery.conftest import History
from tests.storage.conftest import RECALL


def test_pruning_keeps_the_newest_complete_and_the_young_unfinished(history: History) -> None:
    store = SqlRecoveryStore(history.engine)
    made: dict[str, int] = {}
    # name: (position_seq, taken_at_us, complete)
    for name, (position_seq, taken_at_us, complete) in {
        "old": (1, 100, True),
        "middle": (2, 200, True),
        "new": (3, 300, True),
        "abandoned": (4, 50, False),
        "in progress": (5, 1_000, False),
    }.items():
        made[name] = store.begin_snapshot(position_seq, {}, taken_at_us)
        store.write_snapshot_chunk(made[name], 0, SnapshotChunk(lanes=[RECALL]))
        if complete:
            store.complete_snapshot(made[name], ProjectionDigest(position_seq, {}), True)

    def left() -> tuple[list[int], object, object]:
        return (
            [info.snapshot_id for info in store.snapshots()],
            history.scalar("SELECT count(*) FROM snapshots"),
            history.scalar("SELECT count(*) FROM snapshot_chunks"),
        )

    assert store.prune_snapshots(2, 500) == 2
    assert left() == ([made["new"], made["middle"]], 3, 3)
    # At least one complete snapshot stays, whatever `keep` says.
    assert store.prune_snapshots(0, 500) == 1
    assert left() == ([made["new"]], 2, 2)
