"""A client's odd but valid query is answered on both databases, through a real
server: never an UNAVAILABLE that fails the same way on every retry."""

from __future__ import annotations

from typing import Any


def test_a_kind_repeated_past_postgresqls_parameter_limit_is_one_filter(harness: Any) -> None:
    """65,540 repeats of a kind fit the message limit; PostgreSQL takes at most
    65,535 parameters a statement."""
    harness.make_lane()
    harness.reserve("r1")
    harness.refund("r1")
    found = harness.events("recall", kinds=["reserved"] * 65_540 + ["refunded"])
    assert [event.kind for event in found] == ["reserved", "refunded"]
