"""Each grant's share of the server's calls at once.

A lane whose client keeps no bound of its own (hundreds of calls in flight,
on one connection or several) took every call slot of the server
(max_concurrent_rpcs) and every thread of its pool, and another lane's Reserve
was refused by gRPC or waited out its deadline. So a grant may have at most
`max_calls_per_grant` calls running in the server at once; one more is
refused at once with RESOURCE_EXHAUSTED / TOO_MANY_CALLS, before any store
work, and its thread is free again within microseconds. The server's pool has
threads beyond one grant's share (server.py), so a flooding lane leaves them
to the others.

The check sits inside the grant interceptor, where the call's grant is known,
and costs a call a dict lookup and a counter under a lock, on its way in and
again on its way out. Event
streams have a share of their own (the feed's `max_streams_per_owner`) and are
not counted here; health and reflection need no grant and are never counted.
Without grants (--insecure-no-auth) there is no share: only the total.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from ledger_service.api.auth import current_grant_id, is_open
from ledger_service.api.errors import Behaviour, WrappingInterceptor
from ledger_service.domain.errors import TooManyCalls


class CallShares:
    """How many calls each grant has running, and the share none may pass.
    It holds one entry per grant with a call running (bounded by the calls
    the server takes at once)."""

    def __init__(self, share: int) -> None:
        self.share = share
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}

    def take(self, owner: str) -> None:
        """Counts one more call of `owner`. Raises TooManyCalls when it
        already has its share running."""
        with self._lock:
            running = self._running.get(owner, 0)
            if running >= self.share:
                raise TooManyCalls(self.share)
            self._running[owner] = running + 1

    def give_back(self, owner: str) -> None:
        """Counts one call of `owner` ended (it was taken)."""
        with self._lock:
            running = self._running[owner] - 1
            if running:
                self._running[owner] = running
            else:
                del self._running[owner]

    def running(self) -> int:
        """Calls counted now, of every grant."""
        with self._lock:
            return sum(self._running.values())


class GrantShareInterceptor(WrappingInterceptor):
    """Holds every call with one answer to its grant's share. Inside the grant
    interceptor (which makes the grant current) and the error table (which
    answers TooManyCalls); outside the recovery gate and the servicers."""

    def __init__(self, shares: CallShares) -> None:
        self._shares = shares

    def skips(self, method: str) -> bool:
        return is_open(method)

    # Streams keep the inherited wrap_stream, which leaves them as they are:
    # the feed has a share of its own.
    def wrap_unary(self, behaviour: Behaviour) -> Behaviour:
        take, give_back = self._shares.take, self._shares.give_back

        def shared(request: Any, context: grpc.ServicerContext) -> Any:
            owner = current_grant_id()
            if not owner:  # no grants on this server: the total alone
                return behaviour(request, context)
            take(owner)
            try:
                return behaviour(request, context)
            finally:
                give_back(owner)

        return shared
