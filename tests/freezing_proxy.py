"""A TCP proxy that can freeze: the database frozen, as an operator's SIGSTOP
freezes it, without stopping the PostgreSQL cluster other tests share.

While frozen it forwards no byte in either direction but keeps every socket
open, and still accepts new connections, so the kernel goes on ACKing what the
ledger sends: to the ledger the database looks alive and never answers, which
neither statement_timeout nor TCP keepalives can notice. Thawed, everything
held back flows on, in order.
"""

from __future__ import annotations

import contextlib
import socket
import threading

CHUNK_BYTES = 65536


class FreezingProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._thawed = threading.Event()
        self._thawed.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._acceptor.start()

    def freeze(self) -> None:
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._thawed.set()
        self._listener.close()
        with self._lock:
            for held in self._sockets:
                with contextlib.suppress(OSError):
                    held.close()
        self._acceptor.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            # Like a frozen server's listen backlog: accepted, not served until thawed.
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self._thawed.wait()
        try:
            server = socket.create_connection(self._upstream, timeout=10)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        with self._lock:
            if self._closed:  # close() ran meanwhile: it will not close these
                client.close()
                server.close()
                return
            self._sockets += [client, server]
        for source, target in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        while True:
            try:
                data = source.recv(CHUNK_BYTES)
            except OSError:
                data = b""
            # Frozen: hold what came (and the news of a close) until thawed.
            self._thawed.wait()
            try:
                if not data:
                    target.shutdown(socket.SHUT_WR)
                    return
                target.sendall(data)
            except OSError:
                return
