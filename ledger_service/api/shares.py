"""Each grant's share of the server's calls at once, and the calls of all
grants together.

A lane whose client keeps no bound of its own (hundreds of calls in flight,
on one connection or several) took every call slot of the server
(max_concurrent_rpcs) and every thread of its pool, and another lane's Reserve
was refused by gRPC or waited out its deadline. So:

- a grant has at most `share` (max_calls_per_grant) calls running at once;
- grants together have at most `total` running (Settings.grant_calls_total:
  two grants' shares and max_workers more; the pool has a thread for each
  of them beside the streams' and a few for calls of no grant), and the last
  `reserved` of those places go only to a grant running fewer than `calm`
  calls. Floods whose calls never end fill the open `total - reserved`
  places and at most `calm` more each: up to five floods at the defaults
  still leave a calm grant's call a place, one or two floods alone get their
  whole shares, and however many there are, the pool keeps threads
  for streams and health checks, and a call refused is answered at once
  instead of waiting for a thread. (A newcomer is not told from a flood at
  its first calls: more floods, each its own grant, fill the reserve.)

One call more is refused at once with RESOURCE_EXHAUSTED / TOO_MANY_CALLS,
before any store work, and its thread is free again within microseconds: a
call never waits here, as it would hold a thread while it waits.

The check sits inside the grant interceptor, where the call's grant is known,
and costs a call a dict lookup and two counters under a lock, on its way in
and again on its way out. Event streams have a share of their own (the
feed's `max_streams_per_owner`) and are not counted here; health and
reflection need no grant and are never counted. Without grants
(--insecure-no-auth) there is no share, and the server leaves the interceptor
out (server.py): its calls are bounded by max_concurrent_rpcs alone.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from ledger_service.api.auth import current_grant_id, is_open
from ledger_service.api.errors import Behaviour, WrappingInterceptor
from ledger_service.domain.errors import TooManyCalls


class CallShares:
    """How many calls each grant has running, the share none may pass, and
    the places all grants share. It holds one entry per grant with a call
    running (at most `total`)."""

    def __init__(self, share: int, total: int, reserved: int) -> None:
        assert 0 < reserved < total, "the reserve is some of the total's places, not all"
        self.share = share
        self.total = total
        self.reserved = reserved
        # A quarter of the reserve each, so that four calm grants fit in it.
        self.calm = max(1, reserved // 4)
        self._open = total - reserved  # places any grant below its share may take
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._all = 0  # every grant's calls running

    def take(self, owner: str) -> None:
        """Counts one more call of `owner`. Raises TooManyCalls when it
        already has its share running, or when the open places are taken and
        it runs `calm` calls or more, or no place is left."""
        with self._lock:
            running = self._running.get(owner, 0)
            if running >= self.share:
                raise TooManyCalls(running)
            if self._all >= self._open and (running >= self.calm or self._all >= self.total):
                raise TooManyCalls(running, calm=self.calm)
            self._running[owner] = running + 1
            self._all += 1

    def give_back(self, owner: str) -> None:
        """Counts one call of `owner` ended (it was taken)."""
        with self._lock:
            running = self._running[owner] - 1
            self._all -= 1
            if running:
                self._running[owner] = running
            else:
                del self._running[owner]

    def running(self) -> int:
        """Calls counted now, of every grant."""
        with self._lock:
            return self._all


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
