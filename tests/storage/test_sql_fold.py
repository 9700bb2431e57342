"""The database's fold of bookings is the domain's fold (issue 8).

A rebuild asks the store to fold each batch of the log into bookings
(`SqlRecoveryStore.fold_events`: one INSERT ... SELECT ... ON CONFLICT). The
domain's fold, `bookings.apply` through `replay.Projection`, is the reference:
over random logs of every event kind, cut into random batches, the bookings
table must hold exactly what the reference gives, on SQLite and PostgreSQL.
The fold never checks the hash chain (the rebuild does that before it), so the
events here are not sealed.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome, evolve
from ledger_service.domain.policies import ExpireCharge
from ledger_service.domain.replay import replay
from ledger_service.recovery.store import RebuildFailed, SqlRecoveryStore
from ledger_service.storage import database, migrate, records
from ledger_service.storage.schema import bookings, events

OWNER = "test-fold"
ENDINGS = (EventKind.SETTLED, EventKind.REFUNDED, EventKind.EXPIRED, EventKind.RECONCILED)


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = database.create(database_url, database.EngineLimits(pool_size=2))
    migrate.upgrade(engine)
    try:
        yield engine
    finally:
        engine.dispose()


def _opening(rng: random.Random, lane: str, rid: str, at_us: int) -> Event:
    admitted = rng.random() < 0.8
    hold = rng.randrange(1, 10**9)
    return Event(
        kind=EventKind.RESERVED if admitted else EventKind.DENIED,
        lane=lane,
        occurred_at_us=at_us,
        reservation_id=rid,
        amount_nanos=hold if admitted else 0,
        model=rng.choice(["jev", "mini"]),
        request_bytes=rng.randrange(1, 10**6),
        max_output_tokens=rng.randrange(0, 4000),
        estimate_nanos=rng.choice([None, 0, rng.randrange(1, 10**9)]),
        requested_ttl_us=rng.choice([None, rng.randrange(1, 10**8)]),
        hold_nanos=hold,
        cap_nanos=hold + rng.randrange(0, 10**6),
        reserved_at_us=at_us,
        expires_at_us=at_us + rng.randrange(1, 10**8),
        retry_after_us=None if admitted else rng.randrange(1, 10**6),
        denial_reason=None if admitted else DenialReason.BUDGET_EXHAUSTED,
        input_nanos_per_million_tokens=rng.randrange(0, 10**7),
        output_nanos_per_million_tokens=rng.randrange(0, 10**7),
        expire_charge=rng.choice(list(ExpireCharge)),
    )


def _ending(rng: random.Random, opening: Event, at_us: int) -> Event:
    kind = rng.choice(ENDINGS)
    outcome = rng.choice(list(Outcome)) if kind is EventKind.SETTLED else None
    if kind is EventKind.RECONCILED:
        outcome = rng.choice([None, Outcome.SUCCEEDED])
    return Event(
        kind=kind,
        lane=opening.lane,
        occurred_at_us=at_us,
        reservation_id=opening.reservation_id,
        amount_nanos=0 if kind is EventKind.REFUNDED else rng.randrange(0, 10**9),
        outcome=outcome,
        input_tokens=rng.randrange(0, 10**5),
        output_tokens=rng.randrange(0, 10**5),
        billed_nanos=rng.choice([None, rng.randrange(0, 10**9)]),
        http_status=rng.choice([0, 200, 429]),
    )


def random_log(rng: random.Random, bookings_count: int) -> list[Event]:
    """Openings and zero to three endings each, interleaved across bookings
    and two lanes; every ending after its own opening."""
    pending: list[list[Event]] = []
    for index in range(bookings_count):
        opening = _opening(rng, rng.choice(["recall", "filter"]), f"r{index}", 1_000 + index)
        pending.append(
            [opening, *(_ending(rng, opening, 2_000 + index) for _ in range(rng.randrange(4)))]
        )
    log: list[Event] = []
    while pending:
        queue = rng.choice(pending)
        log.append(queue.pop(0))
        if not queue:
            pending.remove(queue)
    return [evolve(event, seq=seq) for seq, event in enumerate(log, start=1)]


def _append(engine: sa.Engine, log: list[Event]) -> None:
    with engine.begin() as connection:
        connection.execute(
            sa.insert(events), [{"seq": e.seq, **records.event_values(e)} for e in log]
        )


def _fold(store: SqlRecoveryStore, cuts: list[int], head: int) -> None:
    assert store.claim_rebuild(OWNER, 1, 10**9)
    store.reset_projections(OWNER, 0, 1)
    after = 0
    for through in [*cuts, head]:
        store.fold_events(OWNER, [], after, through, 1)
        after = through


def _projected(engine: sa.Engine) -> list[object]:
    columns = [bookings.c[name] for name in records.BOOKING_COLUMNS]
    with engine.connect() as connection:
        rows = connection.execute(
            sa.select(*columns).order_by(bookings.c.lane, bookings.c.reservation_id)
        ).all()
    return list(records.bookings_from_rows(rows))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_database_folds_what_the_domain_folds(engine: sa.Engine, seed: int) -> None:
    rng = random.Random(seed)
    log = random_log(rng, 120)
    assert {event.kind for event in log} == {*ENDINGS, EventKind.RESERVED, EventKind.DENIED}
    _append(engine, log)
    cuts = sorted(rng.sample(range(1, len(log)), 12))
    _fold(SqlRecoveryStore(engine), cuts, len(log))
    expected = sorted(replay(log).bookings.items())
    assert _projected(engine) == [booking for _, booking in expected]


def test_batches_of_one_event_fold_what_one_batch_folds(engine: sa.Engine) -> None:
    log = random_log(random.Random(7), 30)
    _append(engine, log)
    _fold(SqlRecoveryStore(engine), list(range(1, len(log))), len(log))
    assert _projected(engine) == [b for _, b in sorted(replay(log).bookings.items())]


def test_an_ending_without_its_reserve_is_refused_and_nothing_is_written(
    engine: sa.Engine,
) -> None:
    log = random_log(random.Random(3), 10)
    orphan = Event(
        kind=EventKind.SETTLED,
        lane="recall",
        occurred_at_us=5_000,
        reservation_id="nobody",
        amount_nanos=5,
        outcome=Outcome.SUCCEEDED,
        seq=len(log) + 1,
    )
    _append(engine, [*log, orphan])
    store = SqlRecoveryStore(engine)
    assert store.claim_rebuild(OWNER, 1, 10**9)
    store.reset_projections(OWNER, 0, 1)
    with pytest.raises(RebuildFailed, match=f"event {orphan.seq} cannot be applied"):
        store.fold_events(OWNER, [], 0, orphan.seq, 1)
    assert _projected(engine) == []
    position = store.position()
    assert position is not None and position.last_seq == 0


def _refusals() -> dict[str, tuple[list[Event], int, int]]:
    """Logs the fold must refuse: (events, the range's end, the seq it names)."""
    rng = random.Random(5)
    opening = dataclasses.replace(_opening(rng, "recall", "r1", 1_000), seq=1)
    if opening.kind is not EventKind.RESERVED:
        opening = dataclasses.replace(opening, kind=EventKind.RESERVED, denial_reason=None)
    ending = dataclasses.replace(_ending(rng, opening, 2_000), seq=2)
    later = dataclasses.replace(opening, seq=3)
    other = dataclasses.replace(_opening(rng, "recall", "r2", 1_500), seq=3)
    uncharged = dataclasses.replace(other, expire_charge=None)
    return {
        "its reserve comes after it, in the range": ([ending, later], 3, 2),
        "its reserve comes after the range": ([ending, later], 2, 2),
        "a reserve without its expiry charge": (
            [dataclasses.replace(opening, expire_charge=None), other],
            3,
            1,
        ),
        "an unknown kind": ([opening, ending, other], 3, 3),
        "the first of two refusals": (
            [ending, uncharged, dataclasses.replace(later, seq=4)],
            4,
            2,
        ),
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_every_refusal_names_its_first_event_and_writes_nothing(
    engine: sa.Engine, case: str
) -> None:
    log, through, named = _refusals()[case]
    rows = [{"seq": e.seq, **records.event_values(e)} for e in log]
    if case == "an unknown kind":
        rows[-1]["kind"] = "paused"
    with engine.begin() as connection:
        connection.execute(sa.insert(events), rows)
    store = SqlRecoveryStore(engine)
    assert store.claim_rebuild(OWNER, 1, 10**9)
    store.reset_projections(OWNER, 0, 1)
    with pytest.raises(RebuildFailed, match=f"event {named} cannot be applied"):
        store.fold_events(OWNER, [], 0, through, 1)
    assert _projected(engine) == []
    position = store.position()
    assert position is not None and position.last_seq == 0
