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
from typing import TYPE_CHECKING, Any

import grpc

from ledger_service.api.errors import Behaviour, wrap_handler
from ledger_service.domain.errors import RecoveryRequired

if TYPE_CHECKING:
    from ledger_service.api.pipeline import Continuation, Handler

GATED_SERVICES = ("/ledger.v1.Ledger/", "/ledger.v1.LaneAdmin/")
LOG_READS = frozenset({"/ledger.v1.Ledger/ListEvents", "/ledger.v1.Ledger/WatchEvents"})


def is_gated(method: str) -> bool:
    return method.startswith(GATED_SERVICES) and method not in LOG_READS


class RecoveryGateInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, is_ready: Callable[[], bool], on_required: Callable[[], None]) -> None:
        self._is_ready = is_ready
        self._on_required = on_required

    def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        return wrap_handler(
            continuation,
            handler_call_details,
            unary=self._gated,
            stream=self._gated,
            skip=lambda method: not is_gated(method),
        )

    def _gated(self, behaviour: Behaviour) -> Behaviour:
        def gated(request: Any, context: grpc.ServicerContext) -> Any:
            if not self._is_ready():
                raise RecoveryRequired()
            try:
                return behaviour(request, context)
            except RecoveryRequired:
                self._on_required()
                raise

        return gated
