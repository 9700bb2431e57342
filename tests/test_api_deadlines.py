"""A call whose deadline has passed when it reaches its handler is told
DEADLINE_EXCEEDED and nothing is tried: it is not the store's UNAVAILABLE."""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest

from ledger_service.api import deadlines
from ledger_service.application.deadlines import call_deadline


class Aborted(Exception):
    pass


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def time_remaining(self) -> float | None:
        return self.remaining

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted


def test_a_call_past_its_deadline_is_deadline_exceeded_and_not_served() -> None:
    served: list[Any] = []
    handler = deadlines._bounded(lambda request, context: served.append(request))
    context = Context(remaining=0.0)
    with pytest.raises(Aborted):
        handler("request", cast(grpc.ServicerContext, context))
    assert context.aborted == (grpc.StatusCode.DEADLINE_EXCEEDED, deadlines.PASSED_BEFORE_SERVED)
    assert served == []


@pytest.mark.parametrize("remaining", [None, 0.001, 5.0])
def test_a_call_with_time_left_is_served_under_its_deadline(remaining: float | None) -> None:
    seen: list[float | None] = []
    handler = deadlines._bounded(lambda request, context: seen.append(call_deadline()))
    context = Context(remaining)
    handler("request", cast(grpc.ServicerContext, context))
    assert context.aborted is None
    assert len(seen) == 1 and (seen[0] is None) == (remaining is None)
