"""The random walk of tests/test_state_machine.py, on PostgreSQL with two replicas.

The production deployment is several stateless replicas on one database. Here
two real gRPC servers share one PostgreSQL schema and one manual test clock,
and the walk's model (LedgerMachine, not a copy) holds them to the contract
after every step. Every call goes to a replica drawn at random; a quarter of
the moves are then sent again to the other replica, which must give the same
answer (or fail with the same code): a repeat returns the first answer from
either replica. Reads (balances, events) also go to either replica, so a
PutLane or a move made through one is checked as the other sees it.

LEDGER_STATE_MACHINE_EXAMPLES and LEDGER_STATE_MACHINE_STEPS raise the number
and length of the walks for a longer local search (CI keeps the defaults, about
25 s).
"""

from __future__ import annotations

import os
import pathlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from ledger_service.domain.clock import ManualClock
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer
from tests.conftest import START_US, LedgerHarness, ledger_settings
from tests.test_state_machine import MACHINE_SETTINGS, LedgerMachine

pytestmark = pytest.mark.postgres

EXAMPLES = int(os.environ.get("LEDGER_STATE_MACHINE_EXAMPLES", "25"))
STEPS = int(os.environ.get("LEDGER_STATE_MACHINE_STEPS", MACHINE_SETTINGS.stateful_step_count))
# A move sent again to the other replica this often.
REPEAT_ELSEWHERE = 0.25


class ReplicaPair:
    """The harness interface of LedgerMachine, each call to a replica drawn at random."""

    START_US = START_US

    def __init__(self, replicas: tuple[LedgerHarness, LedgerHarness]) -> None:
        self.replicas = replicas
        self.rng = random.Random(0)

    def _any(self) -> LedgerHarness:
        return self.rng.choice(self.replicas)

    def _move(self, call: Callable[[LedgerHarness], Any]) -> Any:
        first, other = self.replicas if self.rng.random() < 0.5 else self.replicas[::-1]
        answer, error = _outcome(lambda: call(first))
        if self.rng.random() < REPEAT_ELSEWHERE:
            again, again_error = _outcome(lambda: call(other))
            assert _code(again_error) == _code(error), (error, again_error)
            if isinstance(again, pb.ReserveResponse):
                assert again.already_reserved, again  # a repeat says so
                again.already_reserved = answer.already_reserved
            assert again == answer, "the other replica answered a repeat differently"
        if error is not None:
            raise error
        return answer

    # Time: one clock, so either replica moves it.

    def set_time_us(self, instant_us: int) -> int:
        return self._any().set_time_us(instant_us)

    def advance_us(self, length_us: int) -> int:
        return self._any().advance_us(length_us)

    def now_us(self) -> int:
        return self._any().now_us()

    # Moves.

    def make_lane(self, lane: str, **fields: Any) -> Any:
        return self._any().make_lane(lane, **fields)

    def reserve(self, reservation_id: str, **arguments: Any) -> Any:
        return self._move(lambda replica: replica.reserve(reservation_id, **arguments))

    def settle(self, reservation_id: str, outcome: int, **arguments: Any) -> Any:
        return self._move(lambda replica: replica.settle(reservation_id, outcome, **arguments))

    def refund(self, reservation_id: str, http_status: int, **arguments: Any) -> Any:
        return self._move(lambda replica: replica.refund(reservation_id, http_status, **arguments))

    # Reads.

    def balance(self, lane: str) -> Any:
        return self._any().balance(lane)

    def events(self, lane: str, **filters: Any) -> Any:
        return self._any().events(lane, **filters)

    fails = staticmethod(LedgerHarness.fails)


def _outcome(call: Callable[[], Any]) -> tuple[Any, grpc.RpcError | None]:
    try:
        return call(), None
    except grpc.RpcError as error:
        return None, error


def _code(error: grpc.RpcError | None) -> grpc.StatusCode:
    if error is None:
        return grpc.StatusCode.OK
    assert isinstance(error, grpc.Call)
    return error.code()


class ReplicatedLedgerMachine(LedgerMachine):
    @initialize(seed=st.integers(0, 2**32 - 1))
    def fresh_lane(self, seed: int) -> None:
        """The replicas each call goes to are drawn from `seed`, so a failing walk
        replays (and shrinks) with the same choices."""
        self.harness.rng = random.Random(seed)
        super().fresh_lane()


@pytest.fixture
def replica_pair(
    postgres_schema_url: str,
    tmp_path: pathlib.Path,
    harness_for: Callable[[LedgerServer], LedgerHarness],
) -> Iterator[ReplicaPair]:
    """Two servers on one PostgreSQL schema and one manual clock."""
    clock = ManualClock(START_US)
    servers: list[LedgerServer] = []
    try:
        for name in ("a", "b"):
            data_dir = tmp_path / name
            data_dir.mkdir()
            server = LedgerServer(
                ledger_settings(data_dir, database_url=postgres_schema_url), clock=clock
            )
            servers.append(server)
            server.start()
        yield ReplicaPair((harness_for(servers[0]), harness_for(servers[1])))
    finally:
        for server in reversed(servers):
            server.stop(0)


def test_two_replicas_on_postgresql_keep_the_contract(replica_pair: ReplicaPair) -> None:
    machine = type("BoundReplicatedMachine", (ReplicatedLedgerMachine,), {"harness": replica_pair})
    run_state_machine_as_test(
        machine,
        settings=settings(MACHINE_SETTINGS, max_examples=EXAMPLES, stateful_step_count=STEPS),
    )
