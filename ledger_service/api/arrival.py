"""A bound on how long a call may take to deliver its request message.

grpcio's synchronous server gives a call one of the pool's threads as soon as
its headers arrive, and for a method with one request message that thread
waits, without end, for the message. A peer that sends headers and part of a
message, then nothing (a slow loris), held a thread per stream: 100 such
streams on one connection held every thread, and every other client waited
until its deadline. So every method with one request message is served here
as a request stream whose first message is awaited at most
`request_arrival_seconds`; a call still waiting then is cancelled, and its
thread is free. While more than `max_waiting` calls wait at once and every
thread of the pool is taken (a peer opening such streams faster than the
bound ends them), the oldest past PRESSED_ARRIVAL_SECONDS are cancelled too,
so that the threads go to calls whose messages have come. With threads to
spare nobody is kept waiting, so a message still on its way over a slow link
(1 MiB at a 0.2 s round trip takes longer than 0.2 s) is not cut off. A
call whose request ended without a whole message gets INVALID_ARGUMENT
(UNDECODABLE_REQUEST), as bytes that do not decode do, rather than grpcio's
UNIMPLEMENTED.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from ledger_service.api.errors import refuse_undecodable

if TYPE_CHECKING:
    from ledger_service.api.pipeline import Continuation, Handler

# How often, at most, the watchman looks for calls that waited too long: a
# call is cancelled between request_arrival_seconds and this much later.
LOOK_EVERY_SECONDS = 0.1
# While more calls wait than the watch's max_waiting and no thread is free, a
# call waiting this long is cancelled.
PRESSED_ARRIVAL_SECONDS = 0.2
ARRIVAL_MESSAGE = "the request did not arrive in time"


class ArrivalWatch:
    """The calls waiting for their request message, and one thread that
    cancels those waiting past the bound. It holds at most one entry per
    call waiting (bounded by max_concurrent_rpcs) and sleeps while none waits.
    `threads` is the pool's size: the calls it serves (from first_request to
    served()) are counted, and the pressure rule applies only while they take
    every thread."""

    def __init__(self, arrival_seconds: float, max_waiting: int, threads: int) -> None:
        self._arrival_seconds = arrival_seconds
        self._max_waiting = max_waiting
        self._threads = threads
        # The calls' paths take the lock itself: the condition's own `with`
        # costs a Python call more, on every call (docs/benchmarks.md).
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        # The calls holding one of the pool's threads, under the lock.
        self._serving = 0
        # By arrival (the numbers increase): when each started, and its context.
        self._waiting: dict[int, tuple[float, grpc.ServicerContext]] = {}
        self._numbers = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        # The watchman sleeps without a timeout while no call waits: only then
        # does a new call wake it (waking it for every call would cost a thread
        # switch a call).
        self._idle = False

    def first_request(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """The first message of `requests`. Ends the call (raises) when it was
        cancelled before the message came, or the request ended without one.
        The call counts as holding a thread from its start here: its caller
        calls served() once it ends, whatever happens here (one lock taken
        for the count and the wait, not two)."""
        number = next(self._numbers)
        with self._lock:
            self._serving += 1
            self._waiting[number] = (time.monotonic(), context)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._watch, name="request-arrival", daemon=True
                )
                self._thread.start()
            elif self._idle:
                self._idle = False
                self._changed.notify()
        try:
            return next(requests)
        except StopIteration:
            refuse_undecodable(context)
        except grpc.RpcError:
            # Cancelled, here or by its caller's deadline: no status reaches the
            # caller any more, but aborting keeps grpcio from serializing an
            # answer of None (an ERROR and a traceback in the log).
            context.abort(grpc.StatusCode.CANCELLED, ARRIVAL_MESSAGE)
        finally:
            with self._lock:  # gone already if the watch cancelled it
                self._waiting.pop(number, None)

    def served(self) -> None:
        """Counts a call that first_request counted as ended."""
        with self._lock:
            self._serving -= 1

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                if not self._waiting:
                    self._idle = True
                    self._changed.wait()
                    self._idle = False
                    continue
                for number in self._late(time.monotonic()):
                    self._waiting.pop(number)[1].cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leave it untyped
                self._changed.wait(LOOK_EVERY_SECONDS)

    def _late(self, now: float) -> list[int]:
        """The calls to cancel: those past the bound, and while too many
        wait while no thread is free, the oldest past PRESSED_ARRIVAL_SECONDS."""
        pressed = self._serving >= self._threads
        over = len(self._waiting) - self._max_waiting if pressed else 0
        late = []
        for number, (started, _) in self._waiting.items():
            waited = now - started
            if waited >= self._arrival_seconds or (over > 0 and waited >= PRESSED_ARRIVAL_SECONDS):
                late.append(number)
                over -= 1
            elif over <= 0:
                break  # the rest came later still
        return late


class RequestArrivalInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Serves each method with one request message as a request stream whose
    message is awaited under the watch's bound. Only the tracing interceptor,
    which keeps a handler's shape, may be outside it: grpcio must see the
    streaming shape. It only passes the request's bytes on, and never raises."""

    def __init__(self, watch: ArrivalWatch) -> None:
        self._watch = watch

    def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if getattr(handler.unary_unary or handler.unary_stream, "experimental_non_blocking", False):
            return handler
        first, served = self._watch.first_request, self._watch.served
        decode, encode = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary is not None:
            answer = handler.unary_unary

            def unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                try:
                    return answer(first(requests, context), context)
                finally:
                    served()

            return grpc.stream_unary_rpc_method_handler(unary, decode, encode)
        stream = handler.unary_stream
        assert stream is not None, "a handler with one request message is unary or streams"

        def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from stream(first(requests, context), context)
            finally:
                served()

        return grpc.stream_stream_rpc_method_handler(streaming, decode, encode)
