"""A rotated or retired key takes effect in running servers without a restart:
two replicas on one database and one keyring file, as docs/security.md runs
them, see `ledger grant rotate-key` and `retire-key` within a few seconds."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable

import grpc

from ledger_service.domain.clock import SystemClock
from ledger_service.domain.grants import Keyring, Scope
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.storage import keyring
from tests.conftest import ledger_settings

HOUR_US = 3_600_000_000
# The servers look at the keyring file at every health check.
TAKES_EFFECT_SECONDS = 5.0


def _grant(keys: Keyring) -> str:
    now_us = SystemClock().now_us()
    return keys.issue(["*"], [Scope.READ], issued_at_us=now_us, expires_at_us=now_us + HOUR_US)


def _code(server: LedgerServer, grant: str) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        try:
            pb_grpc.LedgerStub(channel).ListEvents(
                pb.ListEventsRequest(), metadata=(("authorization", f"Bearer {grant}"),), timeout=5
            )
        except grpc.RpcError as error:
            assert isinstance(error, grpc.Call)
            return error.code()
    return grpc.StatusCode.OK


def _becomes(servers: list[LedgerServer], grant: str, code: grpc.StatusCode) -> bool:
    give_up = time.monotonic() + TAKES_EFFECT_SECONDS
    while time.monotonic() < give_up:
        if all(_code(server, grant) is code for server in servers):
            return True
        time.sleep(0.1)
    return False


def test_rotation_and_retirement_reach_every_replica_without_a_restart(
    start_ledger_server: Callable[..., LedgerServer], tmp_path: pathlib.Path
) -> None:
    # Two replicas on one data directory: one database, one keyring file.
    replicas = [start_ledger_server(health_check_interval_seconds=0.2)]
    second = LedgerServer(ledger_settings(tmp_path, health_check_interval_seconds=0.2))
    second.start()
    replicas.append(second)
    try:
        _rotate_and_retire(tmp_path, replicas)
    finally:
        second.stop(0)


def _rotate_and_retire(tmp_path: pathlib.Path, replicas: list[LedgerServer]) -> None:
    old = keyring.load(tmp_path)
    before = _grant(old)
    assert _becomes(replicas, before, grpc.StatusCode.OK)

    rotated = keyring.rotate(tmp_path)
    after = _grant(rotated)
    assert _becomes(replicas, after, grpc.StatusCode.OK)
    assert _becomes(replicas, before, grpc.StatusCode.OK)  # the old key still verifies

    keyring.retire(tmp_path, old.signing_key_id)
    # Refused, though each replica had verified (and kept) it before.
    assert _becomes(replicas, before, grpc.StatusCode.UNAUTHENTICATED)
    assert _becomes(replicas, after, grpc.StatusCode.OK)
    # The local admin grant follows the signing key, so the CLI keeps working.
    admin = keyring.admin_grant_path(tmp_path).read_text().strip()
    assert admin.split(".")[1] == rotated.signing_key_id
    assert _becomes(replicas, admin, grpc.StatusCode.OK)


def test_an_open_event_stream_ends_once_its_key_is_retired(
    start_ledger_server: Callable[..., LedgerServer], tmp_path: pathlib.Path
) -> None:
    """A leaked key's grants are refused once it is retired: a WatchEvents
    stream it opened before gets no event recorded after that."""
    server = start_ledger_server(health_check_interval_seconds=0.2)
    old = keyring.load(tmp_path)
    leaked = _grant(old)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stream = pb_grpc.LedgerStub(channel).WatchEvents(
            pb.WatchEventsRequest(), metadata=(("authorization", f"Bearer {leaked}"),), timeout=30
        )
        keyring.rotate(tmp_path)
        keyring.retire(tmp_path, old.signing_key_id)
        assert _becomes([server], leaked, grpc.StatusCode.UNAUTHENTICATED)
        admin = pb_grpc.LaneAdminStub(channel)
        lane = pb.Lane(lane="after-retirement", limit_nanos=1_000_000)
        lane.window.seconds = 86_400
        lane.hold_ttl.seconds = 60
        lane.prices["m"].input_nanos_per_million_tokens = 1
        grant = keyring.admin_grant_path(tmp_path).read_text().strip()
        admin.PutLane(
            pb.PutLaneRequest(lane=lane),
            metadata=(("authorization", f"Bearer {grant}"),),
            timeout=5,
        )
        try:
            event = next(stream)
        except grpc.RpcError as error:
            assert isinstance(error, grpc.Call)
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED
        else:
            raise AssertionError(f"the stream went on after its key was retired: {event.kind}")
