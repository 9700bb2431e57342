"""The server's clock. Time is never the client's.

Every instant is an integer count of microseconds since the Unix epoch, so that
window arithmetic is exact.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from ledger_service.domain.errors import InvalidArgument

MICROS_PER_SECOND = 1_000_000
# A test clock stays within these instants: from the Unix epoch to a year (the
# longest window) and a week (the longest hold) before the last instant a
# protobuf Timestamp holds (9999-12-31T23:59:59Z), so that every instant the
# ledger answers with (a hold's expires_at, a denial's retry_after) is valid.
TEST_CLOCK_EARLIEST_US = 0
TEST_CLOCK_LATEST_US = (253_402_300_799 - (366 + 7) * 86_400) * MICROS_PER_SECOND
_TEST_CLOCK_RANGE = "must be between 1970-01-01 and 9998-12-23, the range a test clock keeps"


class Clock(Protocol):
    def now_us(self) -> int: ...


class SystemClock:
    def now_us(self) -> int:
        return time.time_ns() // 1000


class SteadyClock:
    """A server's clock over the system's, which NTP or a resumed virtual
    machine may step back: it never reads earlier than it has read before, nor
    than the instant it resumed at (the last recorded event, at start). A clock
    stepped back holds still until it catches up, so no move is dated before
    one the ledger recorded: a booking dated ahead of `now` would fall out of
    the window (reserved_at <= now) and its budget be spent twice."""

    def __init__(self, system: Clock) -> None:
        self._lock = threading.Lock()
        self._system = system
        self._latest_us = 0

    def now_us(self) -> int:
        read = self._system.now_us()
        with self._lock:
            self._latest_us = max(self._latest_us, read)
            return self._latest_us

    def resume_at(self, instant_us: int) -> None:
        """Reads no earlier than `instant_us` from now on."""
        with self._lock:
            self._latest_us = max(self._latest_us, instant_us)


class ManualClock:
    """A clock that stays exactly where it was set until set or advanced again.

    Only a server started with --test-clock has one; it lets a test walk a whole
    window in milliseconds.
    """

    def __init__(self, start_us: int | None = None) -> None:
        self._lock = threading.Lock()
        self._now_us = SystemClock().now_us() if start_us is None else start_us

    def now_us(self) -> int:
        with self._lock:
            return self._now_us

    def set_us(self, instant_us: int, not_before_us: int = 0) -> int:
        """Sets the clock; a ledger's time never runs back past its last
        recorded event (`not_before_us`)."""
        if not TEST_CLOCK_EARLIEST_US <= instant_us <= TEST_CLOCK_LATEST_US:
            raise InvalidArgument("seconds", _TEST_CLOCK_RANGE)
        if instant_us < not_before_us:
            raise InvalidArgument(
                "seconds",
                "must not be before the last recorded event: a ledger's time never runs backwards",
            )
        with self._lock:
            self._now_us = instant_us
            return self._now_us

    def resume_at(self, instant_us: int) -> None:
        """Set to `instant_us` if it is later (a restart behind the last event)."""
        with self._lock:
            self._now_us = max(self._now_us, instant_us)

    def advance_us(self, duration_us: int) -> int:
        if duration_us < 0:
            raise ValueError("a test clock only moves forward by Advance")
        with self._lock:
            if self._now_us + duration_us > TEST_CLOCK_LATEST_US:
                raise InvalidArgument(
                    "seconds", f"would take the clock past 9998-12-23: {_TEST_CLOCK_RANGE}"
                )
            self._now_us += duration_us
            return self._now_us
