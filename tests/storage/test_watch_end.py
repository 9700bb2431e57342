"""A watch's end, as the interrupter sees it (storage/watchdog.py): a watch
disarmed while its statement is being cancelled leaves its connection alone;
one still armed at its deadline has its socket shut down. The frozen database
itself is tests/storage/test_frozen_database.py's; here a stand-in connection."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ledger_service.storage import watchdog


class _Connection:
    """Records the interrupter's cancel; disarms the watch during it when told."""

    def __init__(self, disarm_during_cancel: watchdog.Watch | None = None) -> None:
        self.cancels = 0
        self._disarm = disarm_during_cancel

    def cancel_safe(self, timeout: float) -> None:
        self.cancels += 1
        if self._disarm is not None:
            threading.Thread(target=self._disarm.disarm).start()


@pytest.fixture
def shut(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    found: list[Any] = []
    monkeypatch.setattr(watchdog, "shut_down", found.append)
    return found


def test_a_watch_disarmed_during_the_cancel_leaves_its_connection(shut: list[Any]) -> None:
    watch = watchdog.Watch(time.monotonic() + 5.0, 0.0)
    watch.attach(_Connection(disarm_during_cancel=watch))
    watchdog.interrupt(watch)
    assert shut == []
    assert watch.disarm()  # interrupted: the store drops the connection


def test_a_watch_still_armed_at_its_deadline_has_its_socket_shut(shut: list[Any]) -> None:
    watch = watchdog.Watch(time.monotonic() + 0.2, 0.0)
    connection = _Connection()
    watch.attach(connection)
    watchdog.interrupt(watch)
    assert connection.cancels == 1
    assert shut == [connection]


def test_a_watch_disarmed_before_it_fires_is_left_alone(shut: list[Any]) -> None:
    watch = watchdog.Watch(time.monotonic() + 5.0, 0.0)
    connection = _Connection()
    watch.attach(connection)
    assert not watch.disarm()
    assert not watch.disarm()  # a second disarm (the store's, then the block's) is harmless
    watchdog.interrupt(watch)
    assert connection.cancels == 0
    assert shut == []
