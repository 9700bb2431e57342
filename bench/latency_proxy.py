"""A TCP proxy that holds every chunk it forwards for a fixed delay, each way.

Put between a client and its database, it makes every round trip the client
makes slower by twice the delay, so that the time a move takes through it,
less the time it takes with no delay, divided by the added round trip, is
how many round trips the move made (docs/benchmarks.md, "Round trips a
move"). The proxy also counts them directly: a *turn* is a chunk from the
client that follows the server's answer (or opens the connection), which is
one round trip the client waited for, however the bytes were chunked.

Each direction of each connection has a reader and a writer: the reader
stamps each chunk with the instant it may leave (arrival + delay) and queues
it, the writer sends the chunks in order, each no sooner than its instant.
So chunks keep their order and a burst is delayed once, not once per chunk.
The proxy runs an asyncio loop in a thread of its own; the delay can be
changed while it runs (a server migrates its schema with no delay, then is
measured with one).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import threading
import time
from collections.abc import Iterator

CHUNK_BYTES = 65536
# Chunks queued in one direction of one connection before its reader waits.
MAX_QUEUED_CHUNKS = 1024
START_TIMEOUT_SECONDS = 10.0
STOP_TIMEOUT_SECONDS = 10.0
LISTEN_BACKLOG = 64


class LatencyProxy:
    """Listens on `listen_host`, port 0, and forwards to `upstream_host:upstream_port`.
    Use it as a context manager, or call start() and stop()."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        delay_seconds: float = 0.0,
        listen_host: str = "127.0.0.1",
    ) -> None:
        if delay_seconds < 0:
            raise ValueError("the delay cannot be negative")
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.listen_host = listen_host
        # Read by the loop's thread at each chunk; a float assignment is atomic.
        self.delay_seconds = delay_seconds
        self.port = 0
        # Round trips the clients waited for, and connections accepted, so far.
        self.turns = 0
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        return self.listen_host, self.port

    def __enter__(self) -> LatencyProxy:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="latency-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_SECONDS):
            raise TimeoutError("the latency proxy did not start")
        if self._failure is not None:
            raise RuntimeError(f"the latency proxy failed to start: {self._failure}")

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended
            loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT_SECONDS)
        self._loop = self._thread = None

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._accepted, self.listen_host, 0, backlog=LISTEN_BACKLOG)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError as error:
            self._failure = error
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            pending = set(self._tasks)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    async def _accepted(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        # A task of our own, so that stopping cancels it without the stream
        # server's callback reporting the cancellation as an error.
        task = asyncio.get_running_loop().create_task(self._forward(client_reader, client_writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError:
            client_writer.close()
            return
        for writer in (client_writer, upstream_writer):
            _no_delay(writer)
        # Who sent the last chunk on this connection: a client chunk after the
        # server's is a new round trip.
        last = ["server"]
        await asyncio.gather(
            self._direction(client_reader, upstream_writer, last, "client"),
            self._direction(upstream_reader, client_writer, last, "server"),
            return_exceptions=True,
        )

    async def _direction(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        last: list[str],
        side: str,
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED_CHUNKS)

        async def read() -> None:
            while chunk := await reader.read(CHUNK_BYTES):
                if side == "client" and last[0] == "server":
                    self.turns += 1
                last[0] = side
                await queue.put((loop.time() + self.delay_seconds, chunk))
            await queue.put((loop.time() + self.delay_seconds, b""))

        async def write() -> None:
            while True:
                due, chunk = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
            with contextlib.suppress(OSError):
                if writer.can_write_eof():
                    writer.write_eof()

        try:
            await asyncio.gather(read(), write())
        finally:
            writer.close()


def _no_delay(writer: asyncio.StreamWriter) -> None:
    """Nagle's algorithm would hold small chunks back for the peer's ACK."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# Measuring the proxy itself ----------------------------------------------------------


@contextlib.contextmanager
def tcp_echo() -> Iterator[tuple[str, int]]:
    """A TCP echo on 127.0.0.1 (a thread per connection), for measuring the proxy."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def serve(connection: socket.socket) -> None:
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := connection.recv(CHUNK_BYTES):
                connection.sendall(data)

    def accept() -> None:
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    acceptor = threading.Thread(target=accept, name="tcp-echo", daemon=True)
    acceptor.start()
    try:
        yield listener.getsockname()[:2]
    finally:
        done.set()
        acceptor.join(STOP_TIMEOUT_SECONDS)
        listener.close()


def ping_seconds(address: tuple[str, int], pings: int, payload: bytes = b"x" * 64) -> list[float]:
    """The time of each of `pings` sequential round trips of `payload` to an echo."""
    taken = []
    with socket.create_connection(address, timeout=STOP_TIMEOUT_SECONDS) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(pings):
            started = time.perf_counter()
            connection.sendall(payload)
            received = 0
            while received < len(payload):
                chunk = connection.recv(CHUNK_BYTES)
                if not chunk:
                    raise ConnectionError("the echo closed the connection")
                received += len(chunk)
            taken.append(time.perf_counter() - started)
    return taken


def added_round_trip_seconds(delay_seconds: float, pings: int) -> dict[str, float]:
    """What the proxy at `delay_seconds` really adds to one round trip on this
    machine: the mean round trip to a TCP echo through it, less the mean
    through the same proxy with no delay (at least 2 x delay; the loop's
    timers add a little)."""
    with tcp_echo() as echo_address, LatencyProxy(*echo_address) as proxy:
        ping_seconds(proxy.address, max(1, pings // 4))  # connect and warm up
        direct = statistics.fmean(ping_seconds(proxy.address, pings))
        proxy.delay_seconds = delay_seconds
        delayed = statistics.fmean(ping_seconds(proxy.address, pings))
    return {
        "delay_seconds": delay_seconds,
        "pings": pings,
        "no_delay_round_trip_seconds": direct,
        "delayed_round_trip_seconds": delayed,
        "added_round_trip_seconds": delayed - direct,
    }
