"""Connections that open and never send cannot take the server's file
descriptors: past `max_connections` open at once, gRPC closes a new
connection as it arrives (docs/semantics.md, limits). Without the bound,
20,000 silent TCP connections (no byte sent, no grant needed) took every
descriptor of a server whose limit was 20,000, and no new client could
connect while health still answered SERVING to the ones already connected."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable

import pytest

from ledger_service import server as server_module
from ledger_service.server import LedgerServer

# Long enough for any machine: a refused connection is closed as it is accepted.
CLOSE_WAIT_SECONDS = 30.0


def _closed_by_server(sockets: list[socket.socket], wanted: int) -> int:
    """How many of `sockets` the server closed, waiting until `wanted` are
    or CLOSE_WAIT_SECONDS have passed."""
    closed: set[socket.socket] = set()
    until = time.monotonic() + CLOSE_WAIT_SECONDS
    while len(closed) < wanted and time.monotonic() < until:
        open_ones = [s for s in sockets if s not in closed]
        readable, _, _ = select.select(open_ones, [], [], until - time.monotonic())
        for ready in readable:
            try:
                if ready.recv(4096) == b"":
                    closed.add(ready)
            except OSError:
                closed.add(ready)
    return len(closed)


def test_silent_connections_past_the_limit_are_closed_at_once(
    start_ledger_server: Callable[..., LedgerServer],
) -> None:
    server = start_ledger_server(max_connections=4)
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(12)]
    try:
        # Nothing of the test holds a connection to this server: at most 4 of
        # the 12 stay open, and the other 8 are closed as they arrive.
        assert _closed_by_server(silent, wanted=8) >= 8
    finally:
        for each in silent:
            each.close()


def test_the_open_file_limit_is_raised_to_fit_the_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = {"soft": 1024, "hard": 1_048_576}
    monkeypatch.setattr(
        server_module.resource, "getrlimit", lambda _: (limits["soft"], limits["hard"])
    )
    monkeypatch.setattr(
        server_module.resource, "setrlimit", lambda _, pair: limits.update(soft=pair[0])
    )
    assert server_module.connection_bound(4096) == 4096
    assert limits["soft"] == 4096 + server_module.CONNECTION_FD_HEADROOM


def test_a_hard_limit_too_low_lowers_the_bound_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server_module.resource, "getrlimit", lambda _: (1024, 1024))
    monkeypatch.setattr(server_module.resource, "setrlimit", lambda _, pair: None)
    assert server_module.connection_bound(4096) == 1024 - server_module.CONNECTION_FD_HEADROOM
    assert "max_connections (4096): serving at most 768" in caplog.text
