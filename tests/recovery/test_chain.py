"""The hash chain (domain/chain.py): pure, no database."""

from __future__ import annotations

import dataclasses

from ledger_service.domain import chain
from ledger_service.domain.chain import ChainWalker
from ledger_service.domain.events import Event, EventKind
from ledger_service.domain.policies import ExpireCharge


def _events(lane: str, count: int, start_seq: int = 1) -> list[Event]:
    sealed: list[Event] = []
    previous = chain.GENESIS_HASH
    for index in range(count):
        event = Event(
            kind=EventKind.RESERVED,
            lane=lane,
            occurred_at_us=1_000 + index,
            reservation_id=f"r{index}",
            amount_nanos=100 + index,
            hold_nanos=100 + index,
            expire_charge=ExpireCharge.HOLD,
        )
        event = dataclasses.replace(chain.sealed(event, previous), seq=start_seq + index)
        previous = event.hash
        sealed.append(event)
    return sealed


def _walk(events: list[Event]) -> list[chain.ChainBreak]:
    walker = ChainWalker()
    return [found for event in events if (found := walker.check(event)) is not None]


def test_each_event_links_to_its_lanes_previous_one() -> None:
    events = _events("recall", 4)
    assert events[0].previous_hash == ""
    assert [e.previous_hash for e in events[1:]] == [e.hash for e in events[:-1]]
    assert all(len(e.hash) == 64 for e in events)
    assert _walk(events) == []


def test_seq_and_the_hashes_are_not_hashed_but_every_other_field_is() -> None:
    event = _events("recall", 1)[0]
    assert chain.event_hash("", dataclasses.replace(event, seq=99, hash="x")) == event.hash
    for field, value in (("amount_nanos", 1), ("trace_id", "ab"), ("estimate_nanos", 0)):
        assert chain.event_hash("", dataclasses.replace(event, **{field: value})) != event.hash
    # 0 and None are different values.
    assert "estimate_nanos" not in chain.canonical_event(event)
    assert '"estimate_nanos":0' in chain.canonical_event(
        dataclasses.replace(event, estimate_nanos=0)
    )


def test_an_altered_event_is_named_and_the_links_after_it_still_check() -> None:
    events = _events("recall", 5)
    events[2] = dataclasses.replace(events[2], amount_nanos=1)
    breaks = _walk(events)
    assert [(b.seq, "altered" in b.reason) for b in breaks] == [(3, True)]


def test_a_removed_event_breaks_the_next_link() -> None:
    events = _events("recall", 5)
    del events[1]
    breaks = _walk(events)
    assert [b.seq for b in breaks] == [3] and "removed or altered" in breaks[0].reason


def test_chains_are_per_lane_and_a_walk_can_start_from_snapshot_heads() -> None:
    recall, dreaming = _events("recall", 3), _events("dreaming", 3, start_seq=10)
    assert _walk(sorted(recall + dreaming, key=lambda e: e.seq)) == []
    walker = ChainWalker({"recall": recall[0].hash})
    assert [walker.check(e) for e in recall[1:]] == [None, None]
    assert walker.check(recall[0]) is not None  # not the head it was given


def test_events_from_before_the_chain_are_tolerated_only_as_a_lanes_first() -> None:
    unsealed = [dataclasses.replace(e, hash="", previous_hash="") for e in _events("x", 2)]
    first_sealed = dataclasses.replace(chain.sealed(unsealed[0], ""), seq=3)
    walker = ChainWalker()
    assert [walker.check(e) for e in [*unsealed, first_sealed]] == [None, None, None]
    assert walker.unsealed == 2
    assert walker.check(dataclasses.replace(unsealed[0], seq=4)) is not None
