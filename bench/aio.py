"""The other server model, for `python -m bench --only server-model`: grpc.aio.

Two servers, each beside its grpc.server twin in the same run:

- the echo on grpc.aio: the same method, options and limits as bench/echo.py,
  with an async handler. What the asyncio transport costs alone.
- the ledger on grpc.aio: `transport()` builds a grpc.aio server where
  LedgerServer would build grpc.server, with the same thread pool as
  grpc.aio's pool for sync handlers and the same interceptors (adapted below).
  Every handler, interceptor and the store run unchanged in that pool; only
  the transport and its hand-off differ.

The ledger with async Reserve and Settle and one writer thread, and the same
writer thread behind the sync servicers, are the other two models: prototypes
in bench/aio_writer.py.

    python -m bench.aio --listen 127.0.0.1:0   # the echo on grpc.aio
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import grpc
import grpc.aio

from bench.echo import METHOD, SERVICE, echo_settings
from ledger_service.settings import grpc_server_options

T = TypeVar("T")
if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]


class _SyncInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """A grpc.server interceptor on grpc.aio: the servicer's handler is looked
    up first (aio's continuation is a coroutine), then handed to it."""

    def __init__(self, interceptor: grpc.ServerInterceptor) -> None:  # type: ignore[type-arg]
        self._interceptor = interceptor

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        composed = self._interceptor.intercept_service(
            lambda _details: handler, handler_call_details
        )
        return cast("Handler", composed)  # None when no servicer has the method, as for grpc.server


class _Stopping:
    def __init__(self, future: futures.Future[None]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        self._future.result(timeout)
        return True


class AioServer:
    """A grpc.aio server behind grpc.Server's synchronous methods, on an event
    loop of its own thread: what LedgerServer calls of its server."""

    interceptor_class: type[_SyncInterceptor] = _SyncInterceptor

    def __init__(
        self,
        thread_pool: futures.ThreadPoolExecutor,
        interceptors: Sequence[grpc.ServerInterceptor],  # type: ignore[type-arg]
        maximum_concurrent_rpcs: int | None,
        options: Sequence[tuple[str, Any]],
    ) -> None:
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="aio-loop", daemon=True).start()

        async def build() -> grpc.aio.Server:
            return grpc.aio.server(
                migration_thread_pool=thread_pool,
                interceptors=[self.interceptor_class(interceptor) for interceptor in interceptors],
                maximum_concurrent_rpcs=maximum_concurrent_rpcs,
                options=options,
            )

        self._server = self._run(build())

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def add_generic_rpc_handlers(
        self, handlers: Sequence[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        self._server.add_registered_method_handlers(service, handlers)  # type: ignore[attr-defined]

    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self._server.add_secure_port(address, credentials)

    def start(self) -> None:
        self._run(self._server.start())

    def stop(self, grace: float | None) -> _Stopping:
        return _Stopping(asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop))

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._run(self._server.wait_for_termination(timeout))


def transport_of(server_class: type[AioServer]) -> Callable[..., Any]:
    """A function with grpc.server's signature, as LedgerServer calls it, that
    builds a `server_class`."""

    def transport(
        thread_pool: futures.ThreadPoolExecutor,
        *,
        interceptors: Sequence[grpc.ServerInterceptor] = (),  # type: ignore[type-arg]
        maximum_concurrent_rpcs: int | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> Any:
        return server_class(thread_pool, interceptors, maximum_concurrent_rpcs, options)

    return transport


transport = transport_of(AioServer)


async def _echo(request: bytes, _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def _serve_echo(listen: str) -> int:
    settings = echo_settings(listen)
    server = grpc.aio.server(
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        options=grpc_server_options(settings),
    )
    handlers = {METHOD: grpc.unary_unary_rpc_method_handler(_echo)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]
    port = server.add_insecure_port(settings.listen)
    if port == 0:
        print(f"echo: could not listen on {settings.listen}", file=sys.stderr)
        return 2
    await server.start()
    print(f"echo listening on {settings.listen.rsplit(':', 1)[0]}:{port}", flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, done.set)
    await done.wait()
    await server.stop(settings.grace_period_seconds)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aio")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks one)")
    return asyncio.run(_serve_echo(parser.parse_args(argv).listen))


if __name__ == "__main__":
    sys.exit(main())
