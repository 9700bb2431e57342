"""Refused calls are logged, but not without bound: a client with a bad grant in
a tight loop wrote a line per call (1.2 MB in two and a half minutes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ledger_service.api.auth import RefusalLog


def _refuse(refusals: RefusalLog, calls: range) -> None:
    for index in calls:
        refusals.write("refused call %d", index)


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_at_most_so_many_refusals_a_second_are_logged_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    refusals = RefusalLog(per_second=3, monotonic=lambda: now[0])
    with caplog.at_level("INFO", logger="ledger_service.api.auth"):
        _refuse(refusals, range(8))
        assert _said(caplog) == [
            "refused call 0",
            "refused call 1",
            "refused call 2",
        ]
        caplog.clear()
        now[0] = 101.5
        refusals.write("refused call %d", 8)
        assert _said(caplog) == [
            "5 more refusals were not logged (at most 3 a second)",
            "refused call 8",
        ]


def test_the_count_left_out_of_a_burst_that_ends_is_written_a_second_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It waited for the next refusal, which may never come: the last busy
    second's count was lost."""
    now = [100.0]
    scheduled: list[tuple[float, Callable[[], None]]] = []
    refusals = RefusalLog(
        per_second=2,
        monotonic=lambda: now[0],
        later=lambda delay, action: scheduled.append((delay, action)),
    )
    with caplog.at_level("INFO", logger="ledger_service.api.auth"):
        _refuse(refusals, range(6))
        assert [delay for delay, _ in scheduled] == [1.0], "one flush, at the first left out"
        caplog.clear()
        scheduled[0][1]()
        assert _said(caplog) == ["4 more refusals were not logged (at most 2 a second)"]
        caplog.clear()
        now[0] = 101.5
        refusals.write("refused call %d", 6)
        assert _said(caplog) == ["refused call 6"]


def test_a_flush_of_an_earlier_burst_leaves_the_current_second_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A flood that lasts: the first second's flush, due a second after its
    first left out, came in the next second, wrote that second's count so far
    and started another flush: two count lines a second, not one."""
    now = [100.0]
    scheduled: list[Callable[[], None]] = []
    refusals = RefusalLog(
        per_second=2, monotonic=lambda: now[0], later=lambda _, action: scheduled.append(action)
    )
    with caplog.at_level("INFO", logger="ledger_service.api.auth"):
        _refuse(refusals, range(4))
        now[0] = 101.2
        _refuse(refusals, range(4, 8))
        caplog.clear()
        scheduled[0]()  # the first second's flush, late
        _refuse(refusals, range(8, 10))
        assert _said(caplog) == []
        assert len(scheduled) == 2, "one flush a second"
        scheduled[1]()
        assert _said(caplog) == ["4 more refusals were not logged (at most 2 a second)"]


def test_a_burst_across_a_second_boundary_logs_no_more_within_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The limit counted whole seconds of the monotonic clock: a refused Settle
    retried in a loop that crossed one's end logged 10 lines in its last
    milliseconds and 10 more in the next one's first, 20 within 30 ms against
    semantics.md's "at most 10 lines a second"."""
    now = [100.99]
    refusals = RefusalLog(per_second=3, monotonic=lambda: now[0], later=lambda *_: None)
    with caplog.at_level("INFO", logger="ledger_service.api.auth"):
        _refuse(refusals, range(5))
        now[0] = 101.01
        _refuse(refusals, range(5, 10))
        assert _said(caplog) == [
            "refused call 0",
            "refused call 1",
            "refused call 2",
        ]
        caplog.clear()
        now[0] = 101.995
        refusals.write("refused call %d", 10)
        assert _said(caplog) == [
            "7 more refusals were not logged (at most 3 a second)",
            "refused call 10",
        ]
