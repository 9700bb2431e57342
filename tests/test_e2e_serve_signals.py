"""The listening line is what a supervisor (or docs/postgresql.md's walk-through,
`until grep -q listening a.out`) waits for before it may stop the server. It was
written before the SIGTERM and SIGINT handlers were installed, so a SIGTERM sent
on reading it could meet the default action: the process died (status -15)
with no drain and no clean stop, 10 of 60 times on a loaded machine."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time
from types import FrameType
from typing import Any

import pytest

from ledger_service import server as server_module
from ledger_service.settings import Settings, default_database_url

Handler = Any  # what signal.getsignal returns


def test_the_signal_handlers_are_in_place_when_the_line_is_written(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at_the_line: list[Handler] = []

    def stop_once_handled() -> None:
        # Only once serve() handles SIGTERM: before that it would end pytest.
        deadline = time.monotonic() + 60
        while signal.getsignal(signal.SIGTERM) is leave_alone and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    def announce(_line: str) -> None:
        at_the_line.append(signal.getsignal(signal.SIGTERM))
        threading.Thread(target=stop_once_handled, daemon=True).start()

    def leave_alone(_signum: int, _frame: FrameType | None) -> None:
        return None

    monkeypatch.setattr(server_module, "_announce", announce)
    saved = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    saved_hup = signal.getsignal(signal.SIGHUP)
    # A SIGTERM handler of the test's own, so that the serve's is told from it.
    signal.signal(signal.SIGTERM, leave_alone)
    try:
        settings = Settings(
            database_url=default_database_url(tmp_path),
            data_dir=tmp_path,
            listen="127.0.0.1:0",
            grace_period_seconds=1.0,
        )
        assert server_module.serve(settings) == 0
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
        signal.signal(signal.SIGHUP, saved_hup)
    assert at_the_line and at_the_line[0] is not leave_alone, at_the_line
