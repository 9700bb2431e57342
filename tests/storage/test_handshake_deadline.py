"""A new connection's handshake with a server that never answers ends at the
call's deadline, not at psycopg's next wake.

psycopg drives the handshake from Python and looks at it every 0.1 s; the
ledger answers a call `UNAVAILABLE` a tenth of its time before the caller's
deadline (a 1 s call: 0.1 s; a lane's 0.25 s call: 0.025 s). A handshake
stopped only at psycopg's next wake ended up to 0.1 s past its deadline, so
under a frozen PostgreSQL 26 of 110 one-second calls and most 0.25 s calls
caught in a handshake got the caller's own DEADLINE_EXCEEDED instead of
STORE_UNAVAILABLE. The watchdog shuts the handshake's socket at the deadline,
as it does a statement's.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import psycopg
import pytest

from ledger_service.storage import watchdog

# Past a deadline a call may still end by: a scheduler's tick on a busy machine.
LATE_SECONDS = 0.03


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port whose listener takes connections (the kernel completes them) and
    never says a word, as a frozen PostgreSQL does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@pytest.mark.parametrize("budget_seconds", [0.21, 0.33])
def test_a_handshake_with_a_silent_server_ends_at_the_deadline(
    silent_server: int, budget_seconds: float
) -> None:
    dog = watchdog.Watchdog()
    try:
        deadline = time.monotonic() + budget_seconds
        with dog.watch(deadline), pytest.raises(psycopg.OperationalError):
            watchdog.DeadlineConnection.connect(
                f"hostaddr=127.0.0.1 port={silent_server} dbname=ledger user=ledger "
                "connect_timeout=10"
            )
        late = time.monotonic() - deadline
        assert late < LATE_SECONDS, f"the handshake ended {late:.3f} s past its deadline"
    finally:
        dog.close()
