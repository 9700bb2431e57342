"""A prototype of the other server model issue 25 names: grpc.aio with async
Reserve and Settle handlers and one writer thread, measured beside today's
grpc.server (`python -m bench --only server-model`, model "aio-writer").

What stays the same as the real server: the Ledger's own moves (validation,
pricing, windows, the hash chain), SQLite's writer memory, one transaction and
one durable commit per batch, nothing answered before its commit, the error
table. What differs:

- Reserve and Settle are coroutines on the event loop: no thread per call.
  They hand the move to one writer thread and await its future.
- The writer thread takes every move queued since its last commit (at most
  `group_commit_batch`) and runs them in one group commit, as one unit of the
  committer (so the sweeper's and the recovery's writes still queue with it).
  A move refused inside the batch is answered with its refusal and the batch
  goes on; a batch the database fails answers every move with that failure.
- The two methods skip the sync interceptors (tracing, drain, deadlines, the
  recovery gate, the message observer); their cost is the storeless ledger's
  share of the API layer. Every other method runs as on `--aio`.

Never used outside the benchmark: `replica --aio-writer` only.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from bench.aio import AioServer, _SyncInterceptor, transport_of
from ledger_service.api import convert
from ledger_service.api import errors as api_errors
from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import StoreTransaction
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer
from ledger_service.storage import sql
from ledger_service.storage.sql import SqlStore

SERVICE = "ledger.v1.Ledger"
ASYNC_METHODS = ("Reserve", "Settle")
_PATHS = frozenset(f"/{SERVICE}/{name}" for name in ASYNC_METHODS)

if TYPE_CHECKING:
    from bench.aio import Handler

Move = tuple[Callable[[StoreTransaction], Any], "futures.Future[Any]"]


class WriterThread:
    """Runs queued moves in batches, each batch one group commit."""

    def __init__(self, store: SqlStore, max_batch: int, deadline_seconds: float) -> None:
        self._store = store
        self._max_batch = max_batch
        self._deadline_seconds = deadline_seconds
        self._queue: collections.deque[Move] = collections.deque()
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="writer", daemon=True).start()

    def submit(self, work: Callable[[StoreTransaction], Any]) -> futures.Future[Any]:
        future: futures.Future[Any] = futures.Future()
        with self._ready:
            self._queue.append((work, future))
            self._ready.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                count = min(self._max_batch, len(self._queue))
                batch = [self._queue.popleft() for _ in range(count)]
            self._commit(batch)

    def _commit(self, batch: list[Move]) -> None:
        writer = self._store._writer

        def moves(connection: Any) -> list[tuple[Any, BaseException | None]]:
            outcomes: list[tuple[Any, BaseException | None]] = []
            for work, _future in batch:
                try:
                    result = writer.run(connection, work, sql._sqlite_transaction)
                    outcomes.append((result, None))
                except Exception as error:  # a refusal: its move wrote nothing to memory
                    outcomes.append((None, error))
            return outcomes

        committer = self._store._committer
        assert committer is not None, "SQLite only"
        deadline = time.monotonic() + self._deadline_seconds
        try:
            outcomes = committer.submit(moves, deadline)
        except BaseException as error:
            for _work, future in batch:
                future.set_exception(error)
            return
        for (_work, future), (result, refusal) in zip(batch, outcomes, strict=True):
            if refusal is not None:
                future.set_exception(refusal)
            else:
                future.set_result(result)


class _FutureStore:
    """The store as the prototype's Ledger sees it: a write returns the future
    of its batch's commit; a read runs as always."""

    def __init__(self, store: SqlStore, writer: WriterThread) -> None:
        self._store = store
        self._writer = writer

    def run(self, work: Callable[[StoreTransaction], Any], **options: Any) -> Any:
        if options.get("write", True):
            return self._writer.submit(work)
        return self._store.run(work, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _RefusalContext:
    """What api/errors.py's table needs of a context, for an aio call."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._context = context

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self._context.set_trailing_metadata(tuple(metadata))

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Refused(code, message)


class Prototype:
    def __init__(self, server: LedgerServer) -> None:
        settings = server.settings
        writer = WriterThread(
            server.store, settings.group_commit_batch, settings.request_deadline_seconds
        )
        self.ledger = Ledger(_FutureStore(server.store, writer), server.clock)

    async def reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReserveResponse:
        result = await self._moved(
            context, lambda: self.ledger.reserve(convert.reserve_command(request))
        )
        return convert.reserve_response(result.event, result.balance, result.already_reserved)

    async def settle(
        self, request: pb.SettleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SettleResponse:
        result = await self._moved(
            context, lambda: self.ledger.settle(convert.settle_command(request))
        )
        return convert.settle_response(result)

    @staticmethod
    async def _moved(context: grpc.aio.ServicerContext[Any, Any], move: Callable[[], Any]) -> Any:
        try:
            return await asyncio.wrap_future(move())
        except Exception as error:
            try:
                api_errors._abort(_RefusalContext(context), error)  # type: ignore[arg-type]
            except _Refused as refused:
                await context.abort(refused.code, refused.message)
            raise


def _async_handler(server: AioWriterServer, name: str, template: Handler) -> Handler:
    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        assert server.prototype is not None, "install() it before the server starts"
        method: Callable[..., Awaitable[Any]] = getattr(server.prototype, name.lower())
        return await method(request, context)

    return grpc.unary_unary_rpc_method_handler(
        handle,
        request_deserializer=template.request_deserializer,
        response_serializer=template.response_serializer,
    )


class _Bypass(_SyncInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        if handler_call_details.method in _PATHS:
            return await continuation(handler_call_details)
        return await super().intercept_service(continuation, handler_call_details)


class AioWriterServer(AioServer):
    """AioServer with Reserve and Settle as coroutines, past the interceptors."""

    interceptor_class = _Bypass
    prototype: Prototype | None = None

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        if service == SERVICE:
            handlers = dict(handlers)
            for name in ASYNC_METHODS:
                handlers[name] = _async_handler(self, name, handlers[name])
        super().add_registered_method_handlers(service, handlers)


transport = transport_of(AioWriterServer)


def install_sync(server: LedgerServer) -> None:
    """`prepare` for `server.serve` on grpc.server: the same writer thread behind
    the sync servicers (every interceptor runs), each call's worker thread
    waiting for its move's future. It tells the writer thread's share of the
    aio-writer model's figures from the event loop's."""
    ledger = Prototype(server).ledger

    def reserve(command: Any, trace_id: str = "") -> Any:
        return ledger.reserve(command, trace_id).result()  # type: ignore[attr-defined]

    def settle(command: Any, trace_id: str = "") -> Any:
        return ledger.settle(command, trace_id).result()  # type: ignore[attr-defined]

    server.ledger.reserve = reserve  # type: ignore[method-assign]
    server.ledger.settle = settle  # type: ignore[method-assign]


def install(server: LedgerServer) -> None:
    """`prepare` for `server.serve`: the prototype's ledger, on the server's store."""
    transport_server = server._server
    assert isinstance(transport_server, AioWriterServer), "built with transport() above"
    transport_server.prototype = Prototype(server)
