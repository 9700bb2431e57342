"""The deadline of the call being served, for the store to honour.

The edge (api/deadlines.py) sets it from the caller's gRPC deadline; the store
ends its work by the smaller of it and its own request deadline. A contextvar
keeps it out of every signature between the two, and this module knows nothing
of gRPC: a deadline here is an instant of time.monotonic().
"""

from __future__ import annotations

import contextvars
import time
from contextlib import AbstractContextManager

_CALL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "ledger_call_deadline", default=None
)


def call_deadline() -> float | None:
    """The instant (time.monotonic()) the current call must be answered by; None: no bound."""
    return _CALL_DEADLINE.get()


def work_deadline(request_deadline_seconds: float) -> float:
    """The instant (time.monotonic()) work for the current call must end by: the
    request deadline from now, or the caller's own if that comes first."""
    deadline = time.monotonic() + request_deadline_seconds
    caller = _CALL_DEADLINE.get()
    return deadline if caller is None else min(deadline, caller)


def answering_by(deadline: float | None) -> AbstractContextManager[None]:
    """Runs the block with `deadline` as the current call's deadline."""
    return _AnsweringBy(deadline)


class _AnsweringBy:
    # A class, not contextlib's generator: every call passes through it, and
    # the generator's machinery cost several times the contextvar's set and
    # reset (docs/benchmarks.md, "the call path's layers, cut").
    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        self._token = _CALL_DEADLINE.set(self._deadline)

    def __exit__(self, *_exception: object) -> None:
        _CALL_DEADLINE.reset(self._token)
