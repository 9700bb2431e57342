"""The baseline: a bare gRPC echo service with the ledger server's own settings.

It runs in a process of its own, with the same `grpc.server` construction as
`LedgerServer._build_grpc_server` (thread pool size, maximum concurrent RPCs,
channel options, registered method handlers) and no interceptors, no database
and no work: what it sustains is what the transport sustains on this machine.
The channel options come from `settings.grpc_server_options`, as the server's do.

    python -m bench.echo --listen 127.0.0.1:0
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from types import FrameType

import grpc

from ledger_service.settings import Settings, grpc_server_options

SERVICE = "ledger.bench.v1.Echo"
METHOD = "Echo"
FULL_METHOD = f"/{SERVICE}/{METHOD}"
# The echo never opens a database; Settings only needs a value here.
UNUSED_DATABASE_URL = "sqlite:///unused-by-the-echo.db"


def echo(request: bytes, _context: grpc.ServicerContext) -> bytes:
    return request


def build_server(settings: Settings) -> grpc.Server:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="rpc"),
        interceptors=[],
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        options=grpc_server_options(settings),
    )
    # Bytes in, bytes out: no (de)serializer, as cheap as a method can be.
    handlers = {METHOD: grpc.unary_unary_rpc_method_handler(echo)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    # Registered like the generated ledger stubs register theirs (grpc >= 1.63).
    server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]
    return server


def echo_settings(listen: str) -> Settings:
    return Settings(database_url=UNUSED_DATABASE_URL, listen=listen, auth_enabled=False)


def serve(listen: str) -> int:
    settings = echo_settings(listen)
    server = build_server(settings)
    port = server.add_insecure_port(settings.listen)
    if port == 0:
        print(f"echo: could not listen on {settings.listen}", file=sys.stderr)
        return 2
    server.start()
    print(f"echo listening on {settings.listen.rsplit(':', 1)[0]}:{port}", flush=True)
    done = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    server.stop(settings.grace_period_seconds).wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.echo")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks one)")
    return serve(parser.parse_args(argv).listen)


if __name__ == "__main__":
    sys.exit(main())
