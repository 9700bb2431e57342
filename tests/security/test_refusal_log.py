"""Refused calls are logged, but not without bound: a client with a bad grant in
a tight loop wrote a line per call (1.2 MB in two and a half minutes)."""

from __future__ import annotations

import pytest

from ledger_service.api.auth import RefusalLog


def test_at_most_so_many_refusals_a_second_are_logged_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    refusals = RefusalLog(per_second=3, monotonic=lambda: now[0])
    with caplog.at_level("INFO", logger="ledger_service.api.auth"):
        for index in range(8):
            refusals.write("refused call %d", index)
        assert [record.getMessage() for record in caplog.records] == [
            "refused call 0",
            "refused call 1",
            "refused call 2",
        ]
        caplog.clear()
        now[0] = 101.5
        refusals.write("refused call %d", 8)
        assert [record.getMessage() for record in caplog.records] == [
            "5 more refusals were not logged (at most 3 a second)",
            "refused call 8",
        ]
