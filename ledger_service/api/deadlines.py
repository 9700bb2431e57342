"""Hands the caller's gRPC deadline down to the store (application/deadlines.py).

The store must answer before the caller gives up, or the caller sees
DEADLINE_EXCEEDED instead of the ledger's UNAVAILABLE and its reason. So the
deadline handed down is the caller's less a margin for the answer's way back:
a tenth of the time left, at most ANSWER_MARGIN_SECONDS.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from ledger_service.api.errors import Behaviour, WrappingInterceptor
from ledger_service.application import deadlines

ANSWER_MARGIN_SECONDS = 0.25
PASSED_BEFORE_SERVED = "the call's deadline passed before the ledger could serve it"


def deadline_of(context: grpc.ServicerContext, now: float) -> float | None:
    """The instant (time.monotonic(), `now` its reading) the store must be done
    by; None: the caller set none."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return now + remaining - min(ANSWER_MARGIN_SECONDS, remaining / 10)


class CallDeadlineInterceptor(WrappingInterceptor):
    """Runs every unary-answer handler under its caller's deadline. A stream's
    handler is left alone: each store transaction it runs keeps the store's
    own request deadline, and a long watch outlives any one of them."""

    def wrap_unary(self, behaviour: Behaviour) -> Behaviour:
        return _bounded(behaviour)


def _bounded(behaviour: Behaviour) -> Behaviour:
    def bounded(request: Any, context: grpc.ServicerContext) -> Any:
        now = time.monotonic()  # one reading for the deadline and its check
        deadline = deadline_of(context, now)
        if deadline is not None and deadline <= now:
            # The caller gave up before the call was served: nothing was
            # tried, so it is not the store's UNAVAILABLE.
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, PASSED_BEFORE_SERVED)
        with deadlines.answering_by(deadline):
            return behaviour(request, context)

    return bounded
