"""The benchmark's storeless ledger: Reserve and Settle answered without the store.

It splits a ledger call's cost in two. Everything a real call passes through
still runs: gRPC, the interceptors (tracing, the error table, the recovery
gate, the message observer), decoding, the request's validation and the
conversion of the answer. Only the move is left out: the first Reserve and
the first Settle go to the real ledger, so that the answers have their real
shape and size, and every later one, once validated, gets that first answer.
Beside the echo it shows what the API layer costs; beside the real ledger,
what the move itself does (docs/benchmarks.md).

Never used outside the benchmark: `replica --storeless` only.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from ledger_service.application.ledger import Ledger, ReserveResult, SettleResult
from ledger_service.domain.moves import ReserveCommand, SettleCommand
from ledger_service.server import LedgerServer


class _FirstAnswers:
    """A ledger's Reserve and Settle, each answered for real once, then with
    that answer. The real Settle is of the booking the real Reserve made,
    whichever booking it names: the later Reserves booked nothing."""

    def __init__(self, ledger: Ledger) -> None:
        # Bound now: the ledger's own methods are about to be replaced by these.
        self._reserve, self._settle = ledger.reserve, ledger.settle
        self._lock = threading.Lock()
        self._reserved: tuple[ReserveCommand, ReserveResult] | None = None
        self._settled: SettleResult | None = None

    def reserve(self, command: ReserveCommand, trace_id: str = "") -> ReserveResult:
        command.validate()
        if self._reserved is None:
            with self._lock:
                if self._reserved is None:
                    self._reserved = (command, self._reserve(command, trace_id))
        return self._reserved[1]

    def settle(self, command: SettleCommand, trace_id: str = "") -> SettleResult:
        command.validate()
        if self._settled is None:
            with self._lock:
                if self._settled is None:
                    if self._reserved is not None:
                        booked = self._reserved[0]
                        command = dataclasses.replace(
                            command, lane=booked.lane, reservation_id=booked.reservation_id
                        )
                    self._settled = self._settle(command, trace_id)
        return self._settled


def storeless(server: LedgerServer) -> None:
    """Makes the server's Reserve and Settle storeless (before it starts)."""
    answers = _FirstAnswers(server.ledger)
    ledger: Any = server.ledger  # the servicers hold this object: its methods are replaced
    ledger.reserve, ledger.settle = answers.reserve, answers.settle
