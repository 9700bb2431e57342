"""A rebuild's hash checks in a helper process, and texts made from rows (issue 8).

Each event is checked against its chain from its row (recovery/walk.py), in
a helper process while the rebuild folds. The reference is
chain.canonical_event of the Event that events_from_rows builds, checked by
ChainWalker.check. Bookings' canonical texts for the projection digest are
made from rows too (records.booking_texts_from_rows); the reference is
chain.canonical_json of the Booking. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import pathlib
import random
import time
from typing import Any

import pytest
import sqlalchemy as sa

from ledger_service.domain import chain
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.chain import ChainWalker, canonical_event, canonical_json
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.events import Event, EventKind
from ledger_service.domain.moves import ReserveCommand
from ledger_service.domain.policies import ExpireCharge
from ledger_service.domain.pricing import ModelPrice
from ledger_service.recovery import walk as chain_walk
from ledger_service.recovery.plan import RecoveryPolicy
from ledger_service.recovery.rebuild import FULL_LOG_SOURCE, ChainBroken, Route
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.server import build_recovery, build_store
from ledger_service.settings import Settings
from ledger_service.storage import records
from ledger_service.storage.schema import events
from tests.recovery.conftest import History, policy_lane
from tests.storage.conftest import altered_by_walk

KIND = records.EVENT_COLUMNS.index("kind")
SEQ = records.EVENT_COLUMNS.index("seq")
LANE = records.EVENT_COLUMNS.index("lane")
PREVIOUS = records.EVENT_COLUMNS.index("previous_hash")


def _rows(history: History) -> list[sa.Row[object]]:
    columns = [events.c[name] for name in records.EVENT_COLUMNS]
    with history.engine.connect() as connection:
        return list(connection.execute(sa.select(*columns).order_by(events.c.seq)).all())


def test_texts_from_rows_are_the_events_canonical_texts(history: History) -> None:
    rows = _rows(history)
    built = records.events_from_rows(rows)
    assert {event.kind for event in built} >= {EventKind.LANE_CONFIGURED, EventKind.EXPIRED}
    assert [chain_walk._text(row) for row in rows] == [canonical_event(e) for e in built]
    assert _altered_rows(rows) == []


def test_every_altered_column_is_found(history: History) -> None:
    """Change one value of a sealed event's row, column by column: the check
    from rows finds it exactly when the reference check does."""
    rows = _rows(history)
    reserved = next(row for row in rows if row[KIND] == "reserved")
    changed_any = 0
    for index, column in enumerate(records.EVENT_COLUMNS):
        if column in ("seq", "hash", "previous_hash"):
            continue
        value = reserved[index]
        other: object = (
            "X" if isinstance(value, str) else 7 if value is None or value == 0 else value + 1
        )
        if column in ("kind", "expire_charge", "denial_reason", "outcome"):
            other = {"kind": "denied", "expire_charge": "zero"}.get(column)
            if other == value or (column == "kind" and value != "reserved"):
                continue
        if column == "policy_json":
            other = '{"lane":"x"}'
        row = list(reserved)
        row[index] = other
        event = records.events_from_rows([row])[0]
        expected = ChainWalker({event.lane: event.previous_hash}).check(event) is not None
        assert _altered_rows([row]) == ([event.seq] if expected else []), column
        changed_any += expected
    assert changed_any >= 30


def test_a_value_no_enum_has_fails_as_the_reference_does(history: History) -> None:
    row = list(next(row for row in _rows(history) if row[KIND] == "settled"))
    row[records.EVENT_COLUMNS.index("outcome")] = "maybe"
    with pytest.raises(ValueError, match="maybe"):
        records.events_from_rows([row])
    with pytest.raises(ValueError, match="maybe"):
        _altered_rows([row])


@pytest.mark.parametrize("processes", [0, 2])
def test_ranges_checked_in_processes_find_what_the_thread_finds(
    history: History, processes: int
) -> None:
    seqs = [row[SEQ] for row in _rows(history)]
    altered = seqs[len(seqs) // 2]
    history.tamper_event(altered, 1)
    ends = [seqs[9], altered - 1, altered, seqs[-1]]
    store = SqlRecoveryStore(history.engine)
    with chain_walk.Helpers(store, processes) as helpers:
        found = [altered_by_walk(taken) for taken in helpers.walk({}, 0, ends)]
    assert found == [[], [], [altered], []]


@pytest.mark.parametrize("processes", [0, 2])
def test_a_parallel_rebuild_builds_what_the_live_path_kept(
    history: History, processes: int
) -> None:
    recovery = history.recovery(check_processes=processes, parallel_min_events=0)
    kept = recovery.projection_digest()
    assert recovery.rebuild(Route(FULL_LOG_SOURCE, None)) == kept
    assert recovery.assess().consistent


def _bookings(history: History) -> int:
    count = history.scalar("SELECT COUNT(*) FROM bookings")
    assert isinstance(count, int)
    return count


def test_a_parallel_rebuild_stops_at_an_altered_event(history: History) -> None:
    settled = history.scalar("SELECT MIN(seq) FROM events WHERE kind = 'settled'")
    assert isinstance(settled, int)
    history.tamper_event(settled, 1)
    recovery = history.recovery(check_processes=2, parallel_min_events=0)
    with pytest.raises(ChainBroken) as broken:
        recovery.rebuild(Route(FULL_LOG_SOURCE, None))
    assert broken.value.chain_break.seq == settled
    assert "altered after append" in broken.value.chain_break.reason
    # Nothing at or after the altered event was folded.
    position = recovery.store.position()
    assert position is not None and position.last_seq < settled


def _booking(**changes: object) -> Booking:
    booking = Booking(
        "recall", "r1", "jev", 1, 2, None, None, 3, 4, 5, 6, ModelPrice(7, 8),
        ExpireCharge.HOLD, BookingState.OPEN, 9, 10,
    )  # fmt: skip
    return dataclasses.replace(booking, **changes)  # type: ignore[arg-type]


def test_booking_texts_from_rows_are_their_canonical_json(history: History) -> None:
    with history.recovery().store.view() as view:
        projected = list(view.bookings())
        texts = list(view.booking_texts())
    assert {booking.state for booking in projected} >= {BookingState.SETTLED}
    assert texts == [canonical_json(booking) for booking in projected]
    odd = [
        _booking(lane='la"ne\\', reservation_id="ré\u2028\x00", model="m\n"),
        _booking(estimate_nanos=0, requested_ttl_us=5, billed_nanos=0),
        _booking(state=BookingState.SETTLED_UNKNOWN, outcome=None, ended_seq=11),
        _booking(price=ModelPrice(0, 10**20)),
    ]
    rows = records.booking_rows(odd)
    assert records.booking_texts_from_rows(rows) == [canonical_json(b) for b in odd]
    # A type no template foresees takes the reference path.
    floated = [(*rows[0][:3], 1.5, *rows[0][4:])]
    assert records.booking_texts_from_rows(floated) == [
        canonical_json(records.bookings_from_rows(floated)[0])
    ]
    unknown = [tuple("paused" if value == "open" else value for value in rows[0])]
    with pytest.raises(ValueError, match="paused"):
        records.booking_texts_from_rows(unknown)


def test_an_event_built_from_a_row_hashes_as_its_event() -> None:
    event = Event(kind=EventKind.RESERVED, lane="l", occurred_at_us=1, expire_charge=None)
    assert canonical_event(event).startswith('{"kind":"reserved"')


def test_when_the_checking_process_dies_the_ranges_are_checked_here(history: History) -> None:
    seqs = [row[SEQ] for row in _rows(history)]
    altered = seqs[len(seqs) // 2]
    history.tamper_event(altered, 1)
    store = SqlRecoveryStore(history.engine)
    ends = [seqs[3], altered, seqs[-1]]
    with chain_walk.Helpers(store, 1) as helpers:
        assert helpers._pool is not None
        [process] = helpers._pool._processes.values()
        process.kill()
        process.join(10)
        # Every range is still walked, here.
        found = [altered_by_walk(taken) for taken in helpers.walk({}, 0, ends)]
    assert found == [[], [altered], []]


def test_when_the_pool_cannot_be_made_the_rebuild_works_here(
    history: History, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where spawned processes die at birth (an interpreter its user may not
    read), making the pool fails on the resource tracker's pipe; that used to
    end `ledger rebuild` with exit 1 and no word, the marker `rebuilding`."""

    def unmade(*arguments: Any, **options: Any) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    recovery = history.recovery(check_processes=2, parallel_min_events=0)
    kept = recovery.projection_digest()
    monkeypatch.setattr(chain_walk.concurrent.futures, "ProcessPoolExecutor", unmade)
    assert recovery.rebuild(Route(FULL_LOG_SOURCE, None)) == kept
    assert recovery.assess().consistent


def _check_in_a_daemon(url: str, through_seq: int, results: Any) -> None:
    from ledger_service.storage import database

    engine = database.create(url, database.EngineLimits(pool_size=1))
    store = SqlRecoveryStore(engine)
    with chain_walk.Helpers(store, 1) as helpers:
        found = [list(taken.breaks) for taken in helpers.walk({}, 0, [through_seq])]
        results.put((helpers._pool is None, found))


def test_a_daemonic_process_checks_in_its_own_thread(history: History) -> None:
    """A daemonic process may start no processes: its checks run in it."""
    seqs = [row[SEQ] for row in _rows(history)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    daemon = context.Process(
        target=_check_in_a_daemon, args=(history.url, seqs[-1], results), daemon=True
    )
    daemon.start()
    try:
        assert results.get(timeout=60) == (True, [[]])
    finally:
        daemon.join(10)


def _check_and_wait(url: str, results: Any) -> None:
    from ledger_service.storage import database

    engine = database.create(url, database.EngineLimits(pool_size=1))
    store = SqlRecoveryStore(engine)
    helpers = chain_walk.Helpers(store, 1)
    assert helpers._pool is not None
    [process] = helpers._pool._processes.values()
    results.put([process.pid])
    time.sleep(120)


def test_checking_processes_end_when_their_parent_is_killed(history: History) -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    parent = context.Process(target=_check_and_wait, args=(history.url, results))
    parent.start()
    try:
        [worker] = results.get(timeout=60)
    finally:
        parent.kill()
        parent.join(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and pathlib.Path(f"/proc/{worker}").exists():
        time.sleep(0.1)
    status = pathlib.Path(f"/proc/{worker}/status")
    assert not status.exists() or "zombie" in status.read_text()


def _rewrite_booking_chunks(history: History, rewrite: Any) -> None:
    """Rewrites each booking chunk's (kind, payload) with `rewrite`."""
    with history.engine.begin() as connection:
        chunks = connection.execute(
            sa.text(
                "SELECT snapshot_id, chunk_no, kind, payload FROM snapshot_chunks "
                "WHERE kind != 'lanes'"
            )
        ).all()
        assert chunks
        for snapshot_id, chunk_no, kind, payload in chunks:
            new_kind, new_payload = rewrite(kind, json.loads(payload))
            connection.execute(
                sa.text(
                    "UPDATE snapshot_chunks SET kind = :kind, payload = :payload "
                    "WHERE snapshot_id = :snapshot_id AND chunk_no = :chunk_no"
                ),
                {
                    "kind": new_kind,
                    "payload": json.dumps(new_payload),
                    "snapshot_id": snapshot_id,
                    "chunk_no": chunk_no,
                },
            )


def _as_dicts(kind: str, payload: Any) -> tuple[str, Any]:
    """The format snapshots were written in before: one dict per booking."""
    assert kind == "booking_rows"
    return "bookings", [dict(zip(payload["columns"], row, strict=True)) for row in payload["rows"]]


def _reordered(kind: str, payload: Any) -> tuple[str, Any]:
    order = list(reversed(range(len(payload["columns"]))))
    return kind, {
        "columns": [payload["columns"][i] for i in order],
        "rows": [[row[i] for i in order] for row in payload["rows"]],
    }


def _column_dropped(kind: str, payload: Any) -> tuple[str, Any]:
    return kind, {
        "columns": payload["columns"][1:],
        "rows": [row[1:] for row in payload["rows"]],
    }


def test_a_snapshot_of_rows_restores_what_was_projected(history: History) -> None:
    """A snapshot checks out and restores the same projections, by its
    digest and by the live path's."""
    recovery = history.recovery()
    snapshot = recovery.take_snapshot()
    assert snapshot is not None and snapshot.bookings_count > 0
    assert recovery.check_snapshot(snapshot) == ""
    kept = recovery.projection_digest()
    route = Route(f"snapshot-{snapshot.snapshot_id}", snapshot)
    assert recovery.rebuild(route) == kept
    assert recovery.assess().consistent


@pytest.mark.parametrize("processes", [0, 2])
def test_a_rebuild_prints_the_digest_a_snapshot_at_its_position_printed(
    history: History, processes: int
) -> None:
    """An operator keeps the digest `ledger snapshot` printed; a rebuild of
    the same log, from scratch or from that snapshot, gives that digest back
    (chain heads included), and so does the live path's projection."""
    recovery = history.recovery(check_processes=processes, parallel_min_events=0)
    snapshot = recovery.take_snapshot()
    assert snapshot is not None and snapshot.chain_heads
    assert recovery.projection_digest() == snapshot.digest
    assert recovery.rebuild(Route(FULL_LOG_SOURCE, None)) == snapshot.digest
    route = Route(f"snapshot-{snapshot.snapshot_id}", snapshot)
    assert recovery.rebuild(route) == snapshot.digest
    history.ledger.reserve(ReserveCommand(snapshot_lane(history), "r-after", "jev", 35_000, 1000))
    moved = recovery.rebuild(Route(FULL_LOG_SOURCE, None))
    assert moved != snapshot.digest
    assert recovery.rebuild(route) == moved == recovery.projection_digest()


def test_a_snapshot_in_chunks_smaller_than_its_lanes_restores_to_its_digest(
    history: History,
) -> None:
    """Lanes and bookings are written in chunks of `batch_events` rows, numbered
    in order; a restore reads them back to the digest the snapshot recorded."""
    for number in range(3):
        history.ledger.put_lane(policy_lane(f"x{number}"))
    recovery = history.recovery(batch_events=2)
    snapshot = recovery.take_snapshot()
    assert snapshot is not None and snapshot.lanes_count == 5
    chunks = list(recovery.store.snapshot_chunks(snapshot.snapshot_id))
    assert [len(chunk.lanes) for chunk in chunks[:3]] == [2, 2, 1]
    assert all(len(chunk.booking_rows) <= 2 and not chunk.lanes for chunk in chunks[3:])
    assert sum(chunk.rows for chunk in chunks) == snapshot.rows
    route = Route(f"snapshot-{snapshot.snapshot_id}", snapshot)
    assert recovery.rebuild(route) == snapshot.digest == recovery.projection_digest()


def snapshot_lane(history: History) -> str:
    lane = history.scalar("SELECT lane FROM lanes ORDER BY lane LIMIT 1")
    assert isinstance(lane, str)
    return lane


@pytest.mark.parametrize(
    ("rewrite", "why"),
    [
        (_as_dicts, "a chunk of kind 'bookings', a format this release no longer reads"),
        (_reordered, "its bookings' columns are not this release's (another set or order)"),
        (_column_dropped, "its bookings' columns are not this release's (it lacks lane)"),
    ],
)
@pytest.mark.parametrize("max_risk", [0.3, 1.0])
def test_a_snapshot_of_another_format_is_unreadable_and_the_log_rebuilds(
    history: History, rewrite: Any, why: str, max_risk: float
) -> None:
    """An older release's chunks (one dict per booking, its columns in
    another order or fewer) are no longer read: the planner says why in
    words (it said only 'ValueError'), and rebuilds from the log, also when
    the operator accepts any risk (it used to pick the cheaper snapshot and
    stop on a ValueError's traceback, the projections emptied)."""
    recovery = history.recovery()
    snapshot = recovery.take_snapshot()
    assert snapshot is not None
    _rewrite_booking_chunks(history, rewrite)
    said = f"unreadable: {why} (made by another release, or damaged)"
    assert recovery.check_snapshot(snapshot) == said
    history.sql("DELETE FROM bookings")
    outcome = recovery.recover(RecoveryPolicy(60.0, max_risk, 1), "test")
    assert outcome.ready and outcome.manifest is not None
    assert outcome.manifest.chosen == (FULL_LOG_SOURCE,)
    [source] = [s for s in outcome.manifest.sources if s.source_id != FULL_LOG_SOURCE]
    assert said in source.detail and not source.possible
    assert recovery.assess().consistent


def _walk_log(rng: random.Random) -> list[Event]:
    """Three lanes' chains with every kind of damage a walk reports: unsealed
    events at a lane's start and after sealed ones, a removed event (a broken
    link) and altered contents."""
    heads: dict[str, str] = {}
    log: list[Event] = []
    for seq in range(1, 400):
        lane = rng.choice(["recall", "filter", "dreaming"])
        event = Event(
            kind=EventKind.RESERVED,
            lane=lane,
            occurred_at_us=seq,
            reservation_id=f"r{seq}",
            amount_nanos=rng.randrange(1, 10**6),
            expire_charge=ExpireCharge.HOLD,
            seq=seq,
        )
        if (lane == "dreaming" and seq < 60) or rng.random() < 0.01:
            log.append(event)  # unsealed: no hash
            continue
        event = chain.sealed(event, heads.get(lane, chain.GENESIS_HASH))
        heads[lane] = event.hash
        if rng.random() < 0.02:
            continue  # removed after sealing: the next one's link breaks
        if rng.random() < 0.02:
            event = dataclasses.replace(event, amount_nanos=event.amount_nanos + 1)
        log.append(event)
    return log


def _row(event: Event) -> tuple[Any, ...]:
    values = {**records.event_values(event), "seq": event.seq}
    return tuple(values[name] for name in records.EVENT_COLUMNS)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_ranges_walked_apart_find_what_one_walk_finds(seed: int) -> None:
    """Cut at random and walked range by range from rows (walk_rows), one
    walker carried across: the same breaks, in the same order, the same heads
    and the same count of unsealed events as ChainWalker.check over the whole
    log."""
    rng = random.Random(seed)
    log = _walk_log(rng)
    whole = ChainWalker()
    expected = [found for event in log if (found := whole.check(event)) is not None]
    reasons = {found.reason.split(" ")[0] for found in expected}
    assert {"has", "previous_hash", "its"} <= reasons, reasons
    cuts = sorted(rng.sample(range(1, len(log)), 15))
    walker = ChainWalker()
    found: list[object] = []
    for start, end in itertools.pairwise([0, *cuts, len(log)]):
        found += chain_walk.walk_rows(walker, [_row(event) for event in log[start:end]])
    assert found == expected
    assert (walker.heads, walker.unsealed) == (whole.heads, whole.unsealed)


@pytest.mark.parametrize(("range_events", "expected"), [(0, 25), (7, 7), (60, 60)])
def test_a_replay_folds_ranges_of_replay_range_events(
    sqlite_history: History, range_events: int, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    recovery = sqlite_history.recovery(batch_events=25, replay_range_events=range_events)
    folded: list[tuple[int, int]] = []
    fold = SqlRecoveryStore.fold_events

    def spy(
        self: SqlRecoveryStore, owner: str, lanes: Any, after: int, through: int, *a: Any, **k: Any
    ) -> None:
        folded.append((after, through))
        fold(self, owner, lanes, after, through, *a, **k)

    monkeypatch.setattr(SqlRecoveryStore, "fold_events", spy)
    kept = recovery.projection_digest()
    assert recovery.rebuild(Route(FULL_LOG_SOURCE, None)) == kept
    sizes = [through - after for after, through in folded]
    assert sizes[:-1] == [expected] * (len(sizes) - 1) and 0 < sizes[-1] <= expected
    assert folded[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(folded))


def test_the_server_replays_in_ranges_of_its_setting(tmp_path: pathlib.Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'l.db'}", data_dir=tmp_path)
    store = build_store(dataclasses.replace(settings, recovery_replay_range_events=1234))
    try:
        recovery = build_recovery(
            dataclasses.replace(settings, recovery_replay_range_events=1234), store, "t"
        )
        assert recovery.settings.replay_range_events == 1234
    finally:
        store.close()


def test_the_walk_starts_before_the_old_projections_are_deleted(
    sqlite_history: History, monkeypatch: pytest.MonkeyPatch
) -> None:
    recovery = sqlite_history.recovery(batch_events=10, check_processes=2, parallel_min_events=0)
    steps: list[str] = []
    start = chain_walk.Helpers.__init__
    reset = SqlRecoveryStore.reset_projections

    def started(self: chain_walk.Helpers, *arguments: Any, **options: Any) -> None:
        start(self, *arguments, **options)
        steps.append("walk" if self._pool else "walk here")

    def reset_projections(self: SqlRecoveryStore, *arguments: Any) -> None:
        steps.append("reset")
        reset(self, *arguments)

    monkeypatch.setattr(chain_walk.Helpers, "__init__", started)
    monkeypatch.setattr(SqlRecoveryStore, "reset_projections", reset_projections)
    kept = recovery.projection_digest()
    assert recovery.rebuild(Route(FULL_LOG_SOURCE, None)) == kept
    assert steps == ["walk", "reset"]


@pytest.mark.parametrize("processes", [0, 2])
def test_a_walk_notes_each_positions_heads_as_one_walk_over_the_log_would(
    history: History, processes: int
) -> None:
    """The assessment's walk (and a snapshot's check) runs in ranges too, cut
    at the positions whose heads it notes: mid-range, at a range's end, at
    the log's first and last event and before any."""
    built = records.events_from_rows(_rows(history))
    seqs = [event.seq for event in built]
    positions = [0, seqs[0], seqs[3], seqs[7], seqs[8], seqs[len(seqs) // 2], seqs[-1]]
    recovery = history.recovery(batch_events=7, check_processes=processes, parallel_min_events=0)
    walk = recovery._walk(None, positions)
    expected = {}
    for position in positions:
        walker = ChainWalker()
        for event in built:
            if event.seq <= position:
                walker.check(event)
        expected[position] = dict(walker.heads)
    assert walk.heads_at == expected
    assert walk.break_count == 0


def _altered_rows(rows: list[Any]) -> list[int]:
    """The seqs among `rows` (of EVENT_COLUMNS) whose content no longer gives
    their hash, as a range's walk judges them, from each lane's first
    previous_hash on."""
    heads: dict[str, str] = {}
    for row in rows:
        heads.setdefault(row[LANE], row[PREVIOUS])
    content = chain.altered(0, "").reason
    found = chain_walk.walk_rows(ChainWalker(heads), rows)
    return [broken.seq for broken in found if broken.reason == content]


def test_a_helper_the_database_failed_is_told_as_unavailable(tmp_path: pathlib.Path) -> None:
    # The helper's own database error must reach the walk as StoreUnavailable
    # (a domain error cannot be unpickled on the other side of the pool).
    said = chain_walk._content(f"sqlite:///{tmp_path}/no/such/dir/ledger.db", 0, 1)
    with pytest.raises(StoreUnavailable):
        chain_walk._done(said)
