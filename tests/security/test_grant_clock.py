"""A grant's expiry is read on a clock that never runs back: a system clock
stepped back (NTP, a resumed virtual machine) must not revive a grant that had
expired."""

from __future__ import annotations

import pathlib

import grpc
import pytest

from ledger_service import server as server_module
from ledger_service.domain.clock import SystemClock
from ledger_service.domain.grants import Scope
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from tests.conftest import ledger_settings

SECOND_US = 1_000_000


class _SteppedClock:
    """The system's clock, plus a step the test sets."""

    step_us = 0

    def now_us(self) -> int:
        return SystemClock().now_us() + _SteppedClock.step_us


def test_a_clock_stepped_back_does_not_revive_an_expired_grant(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "SystemClock", _SteppedClock)
    monkeypatch.setattr(_SteppedClock, "step_us", 0)
    server = LedgerServer(ledger_settings(tmp_path))
    server.start()
    try:
        now_us = SystemClock().now_us()
        grant = server.keyring.issue(
            ["*"], [Scope.READ], issued_at_us=now_us, expires_at_us=now_us + 60 * SECOND_US
        )

        def code() -> grpc.StatusCode:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                try:
                    pb_grpc.LedgerStub(channel).ListEvents(
                        pb.ListEventsRequest(),
                        metadata=(("authorization", f"Bearer {grant}"),),
                        timeout=5,
                    )
                except grpc.RpcError as error:
                    assert isinstance(error, grpc.Call)
                    return error.code()
            return grpc.StatusCode.OK

        assert code() is grpc.StatusCode.OK
        _SteppedClock.step_us = 120 * SECOND_US  # the clock steps past the expiry
        assert code() is grpc.StatusCode.UNAUTHENTICATED
        _SteppedClock.step_us = 0  # and back again
        assert code() is grpc.StatusCode.UNAUTHENTICATED, "the expired grant came back"
    finally:
        server.stop(0)
