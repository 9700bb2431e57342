"""The recovery gate: no move while the projections are not whole.

While the projections are being recovered (or a recovery was refused), every
method of the Ledger and LaneAdmin services fails with UNAVAILABLE and the
constant reason RECOVERY_REQUIRED, except those that read the event log alone
(ListEvents, WatchEvents): the log is the authority and stays auditable. When
a move finds the projections not current (the position marker refused its
append), the gate closes at once.

It sits inside the ErrorInterceptor (which turns RecoveryRequired into the
status and its trailing metadata) and after authentication, so that an
unauthenticated caller learns nothing about the ledger's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from ledger_service.api.errors import Behaviour, WrappingInterceptor
from ledger_service.domain.errors import RecoveryRequired

GATED_SERVICES = ("/ledger.v1.Ledger/", "/ledger.v1.LaneAdmin/")
LOG_READS = frozenset({"/ledger.v1.Ledger/ListEvents", "/ledger.v1.Ledger/WatchEvents"})


def is_gated(method: str) -> bool:
    return method.startswith(GATED_SERVICES) and method not in LOG_READS


class RecoveryGateInterceptor(WrappingInterceptor):
    def __init__(self, is_ready: Callable[[], bool], on_required: Callable[[], None]) -> None:
        self._is_ready = is_ready
        self._on_required = on_required

    def skips(self, method: str) -> bool:
        return not is_gated(method)

    def wrap_stream(self, behaviour: Behaviour) -> Behaviour:
        return self.wrap_unary(behaviour)

    def wrap_unary(self, behaviour: Behaviour) -> Behaviour:
        def gated(request: Any, context: grpc.ServicerContext) -> Any:
            if not self._is_ready():
                raise RecoveryRequired()
            try:
                return behaviour(request, context)
            except RecoveryRequired:
                self._on_required()
                raise

        return gated
