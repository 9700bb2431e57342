"""A lane's own mistakes are never an outage: a TLS setting that does not
match the ledger, or a request past the ledger's limits, fails the same way on
every retry, so it raises an error naming what to fix instead of sending the
lane into its outage mode (docs/semantics.md: a client's mistake is never an
UNAVAILABLE that fails the same way on every retry)."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest
from client_ledger import (
    TEST_SETTINGS,
    LedgerProcess,
    lane_tls,
    ledger_tls_arguments,
    make_certificates,
    running,
)
from ledger_client import ClientSettings, LaneClient, ModelPrice, OutagePolicy, errors
from ledger_client.channels import TlsSettings, client_probe_context, refuses_client_certificate

PRICES = {"model-a": ModelPrice(1_000_000, 2_000_000)}


def _allowance(tmp_path: pathlib.Path) -> OutagePolicy:
    return OutagePolicy.allowance(
        max_nanos=10**6, max_calls=10, journal_path=tmp_path / "journal.jsonl", prices=PRICES
    )


def _tls_mismatch(address: str, lane: str, grant: str, tls: TlsSettings,
                  tmp_path: pathlib.Path) -> errors.TlsMismatch:  # fmt: skip
    """The TlsMismatch a Balance is refused with: not retryable, and not the
    outage mode either (a model_call gets it too, and nothing is journaled)."""
    with LaneClient(address, lane, grant=grant, tls=tls, outage=_allowance(tmp_path),
                    settings=TEST_SETTINGS) as client:  # fmt: skip
        with pytest.raises(errors.TlsMismatch) as raised:
            client.balance()
        with pytest.raises(errors.TlsMismatch), client.model_call("model-a", b"x" * 3500, 500):
            pass
    assert not errors.is_retryable(raised.value)
    journal = tmp_path / "journal.jsonl"
    assert not journal.exists() or not journal.read_text()
    return raised.value


def test_tls_to_a_plaintext_ledger_names_the_tls_setting(
    ledger_server: LedgerProcess, lane: str, lane_grant: str,
    certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path,
) -> None:  # fmt: skip
    mismatch = _tls_mismatch(
        ledger_server.address, lane, lane_grant, lane_tls(certificates), tmp_path
    )
    assert "does not speak TLS" in mismatch.message and "tls" in mismatch.message


def test_tls_to_nobody_listening_is_still_an_outage(
    certificates: dict[str, pathlib.Path],
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    settings = ClientSettings(replay_interval_seconds=None)
    tls = lane_tls(certificates)
    with (
        LaneClient(address, "lane", tls=tls, settings=settings) as client,
        pytest.raises(errors.LedgerUnavailable),
    ):
        client.balance()


@pytest.fixture
def small_server(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LedgerProcess]:
    """A ledger taking messages of 200 bytes at most, less than this client's limit."""
    monkeypatch.setenv("LEDGER_MAX_MESSAGE_BYTES", "200")
    with running(tmp_path / "ledger") as server:
        yield server


def test_the_servers_message_limit_is_not_an_overload(small_server: LedgerProcess) -> None:
    # The request is refused for its size before its lane is looked up.
    with (
        LaneClient(small_server.address, "a-lane", grant=small_server.admin_grant,
                   settings=TEST_SETTINGS) as client,
        pytest.raises(errors.RequestTooLarge) as raised,
    ):  # fmt: skip
        client.reserve("m" * 200, 1000, 100)
    assert "200" in raised.value.message and "max_message_bytes" in raised.value.message
    assert raised.value.field == "request"
    assert not errors.is_retryable(raised.value)
    assert not isinstance(raised.value, errors.LedgerUnavailable)


def test_plaintext_to_a_tls_ledger_names_the_tls_setting(
    fresh_server: LedgerProcess, tmp_path: pathlib.Path
) -> None:
    # gRPC says only "Socket closed", as for a restarting server; one TLS
    # handshake the client tries itself tells the two apart.
    with LaneClient(fresh_server.address, "a-lane", grant=fresh_server.admin_grant,
                    outage=_allowance(tmp_path), settings=TEST_SETTINGS) as client:  # fmt: skip
        with pytest.raises(errors.TlsMismatch) as raised:
            client.balance()
        with pytest.raises(errors.TlsMismatch), client.model_call("model-a", b"x" * 3500, 500):
            pass
    assert "serves TLS" in raised.value.message and "tls=" in raised.value.message
    journal = tmp_path / "journal.jsonl"
    assert not journal.exists() or not journal.read_text()


def test_tls_without_a_client_certificate_to_a_mutual_tls_ledger_names_it(
    fresh_server: LedgerProcess, certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    # gRPC says only "Socket closed" here too, as for a restarting server: the
    # ledger completes the handshake and hangs up before a byte of HTTP/2.
    tls = lane_tls(certificates, client_certificate=False)
    mismatch = _tls_mismatch(
        fresh_server.address, "a-lane", fresh_server.admin_grant, tls, tmp_path
    )
    assert "client certificate" in mismatch.message
    assert "certificate_chain" in mismatch.message and "private_key" in mismatch.message


def _probe(tls: TlsSettings) -> ssl.SSLContext:
    context = client_probe_context(tls)
    assert context is not None
    return context


def _other_ca(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Certificates of a second CA, which the test ledgers do not know."""
    return make_certificates(tmp_path / "other-ca", ca_name="another-ca")


def _untrusted_client(certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> TlsSettings:
    """The lane's TLS with a client certificate of the other CA."""
    stranger = _other_ca(tmp_path)
    return dataclasses.replace(
        lane_tls(certificates),
        certificate_chain=stranger["client.pem"].read_bytes(),
        private_key=stranger["client.key"].read_bytes(),
    )


# One TlsSettings file of another CA, and the words its TlsMismatch must hold:
# root_certificates, gRPC's own handshake text (CERTIFICATE_VERIFY_FAILED),
# which no outage says; private_key, "Failed to create security handshaker":
# the pair never loads, so every retry would fail the same way.
OTHER_CA_FILES = [
    ("root_certificates", "ca.pem",
     ("the ledger's certificate", "root_certificates", "CERTIFICATE_VERIFY_FAILED")),
    ("private_key", "client.key", ("private_key", "certificate_chain")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("field", "file", "named"), OTHER_CA_FILES, ids=[f[0] for f in OTHER_CA_FILES]
)
def test_a_tls_file_of_another_ca_names_its_setting(
    fresh_server: LedgerProcess, certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path,
    field: str, file: str, named: tuple[str, ...],
) -> None:  # fmt: skip
    other = _other_ca(tmp_path)[file].read_bytes()
    tls = dataclasses.replace(lane_tls(certificates), **{field: other})
    mismatch = _tls_mismatch(fresh_server.address, "a-lane", fresh_server.admin_grant, tls,
                             tmp_path)  # fmt: skip
    for words in named:
        assert words in mismatch.message


def test_a_server_name_the_certificate_does_not_carry_names_it(
    fresh_server: LedgerProcess, certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    tls = dataclasses.replace(lane_tls(certificates), server_name="ledger.example")
    mismatch = _tls_mismatch(fresh_server.address, "a-lane", fresh_server.admin_grant, tls,
                             tmp_path)  # fmt: skip
    assert "'ledger.example'" in mismatch.message and "server_name" in mismatch.message


def test_an_address_the_certificate_does_not_carry_names_it(tmp_path: pathlib.Path) -> None:
    # The ledger's certificate names only ledger.example; the lane dials its IP address.
    files = make_certificates(tmp_path / "certificates", server_names="DNS:ledger.example")
    with running(tmp_path / "ledger", ledger_tls_arguments(files)) as server:
        mismatch = _tls_mismatch(server.address, "a-lane", server.admin_grant, lane_tls(files),
                                 tmp_path)  # fmt: skip
    assert "'127.0.0.1'" in mismatch.message and "server_name" in mismatch.message


def test_a_client_certificate_the_ledger_does_not_trust_names_it(
    fresh_server: LedgerProcess, certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    # gRPC says only "Socket closed", as for a restarting server: the ledger
    # completes the handshake and hangs up before a byte of HTTP/2.
    tls = _untrusted_client(certificates, tmp_path)
    mismatch = _tls_mismatch(fresh_server.address, "a-lane", fresh_server.admin_grant, tls,
                             tmp_path)  # fmt: skip
    assert "client certificate" in mismatch.message and "certificate_chain" in mismatch.message
    assert "does not trust" in mismatch.message


def _accepted(listener: socket.socket) -> Iterator[socket.socket]:
    """Each connection the listener accepts, until it is closed."""
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:
            return
        yield connection


class _Proxy:
    """A plain TCP proxy (no TLS of its own) to one port: each connection it
    accepts goes to the upstream, or is closed at once when nothing listens there."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        for client in _accepted(self._listener):
            try:
                upstream = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()  # the ledger is down: accepted, then closed
                continue
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                self._threads.append(threading.Thread(target=self._pump, args=(source, sink)))
                self._threads[-1].start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self._threads[0].join()
        for held in self._sockets:
            with contextlib.suppress(OSError):
                held.shutdown(socket.SHUT_RDWR)  # wakes the pumps' recv()
        for thread in self._threads[1:]:
            thread.join()
        for held in self._sockets:
            held.close()


def test_a_mutual_tls_ledger_down_behind_a_tcp_proxy_is_an_outage(
    fresh_server: LedgerProcess, certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    # The proxy accepts and then closes, as a ledger refusing a client's
    # certificate would seem to; only a TLS answer counts as that refusal.
    proxy = _Proxy(fresh_server.port)
    lanes = {
        "no certificate": lane_tls(certificates, client_certificate=False),
        "an untrusted certificate": _untrusted_client(certificates, tmp_path),
    }
    settings = TEST_SETTINGS  # a deadline that leaves the probe time on a busy machine
    try:
        for tls in lanes.values():  # through the proxy, the ledger's refusal is seen
            with LaneClient(proxy.address, "lane", tls=tls, settings=settings) as client, \
                    pytest.raises(errors.TlsMismatch):  # fmt: skip
                client.balance()
        fresh_server.stop()
        for name, tls in lanes.items():
            with LaneClient(proxy.address, "lane", tls=tls, settings=settings) as client:
                with pytest.raises(errors.LedgerError) as raised:
                    client.balance()
                assert type(raised.value) is errors.LedgerUnavailable, name
    finally:
        proxy.close()


def test_tls_without_a_client_certificate_to_a_tls_ledger_restarting_is_an_outage(
    certificates: dict[str, pathlib.Path],
) -> None:
    # A TLS listener that hangs up before the handshake (a ledger going away)
    # is not a demand for a client certificate.
    with socket.create_server(("127.0.0.1", 0)) as hanging_up:
        address = f"127.0.0.1:{hanging_up.getsockname()[1]}"
        stop = threading.Event()

        def serve() -> None:
            hanging_up.settimeout(0.1)
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    connection, _ = hanging_up.accept()
                    connection.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        settings = ClientSettings(deadline_seconds=2.0, replay_interval_seconds=None)
        tls = lane_tls(certificates, client_certificate=False)
        try:
            with LaneClient(address, "lane", tls=tls, settings=settings) as client, \
                    pytest.raises(errors.LedgerUnavailable):  # fmt: skip
                client.balance()
        finally:
            stop.set()
            thread.join()


def test_a_tls_ledger_taking_clients_without_certificates_is_not_taken_for_mutual_tls(
    tmp_path: pathlib.Path, certificates: dict[str, pathlib.Path]
) -> None:
    # The probe behind the test above must not see a demand for a certificate
    # where there is none: a "Socket closed" then stays an outage.
    with running(tmp_path / "ledger", ledger_tls_arguments(certificates, mutual=False)) as server:
        deadline = time.monotonic() + 5
        # Without ALPN h2 in the probe, gRPC would hang up on it here too.
        assert (
            refuses_client_certificate(
                server.address, deadline, _probe(lane_tls(certificates, client_certificate=False))
            )
            is False
        )


def test_an_alert_refusing_the_client_certificate_is_a_refusal(
    certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    # Another TLS stack in front of the ledger (Python's own here) refuses an
    # untrusted certificate with an alert (unknown_ca), not a silent hang-up.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificates["server.pem"], certificates["server.key"])
    context.load_verify_locations(certificates["ca.pem"])
    context.verify_mode = ssl.CERT_REQUIRED
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"

        def refuse_one() -> None:
            connection, _ = listener.accept()
            with connection, contextlib.suppress(OSError):
                context.wrap_socket(connection, server_side=True).close()

        thread = threading.Thread(target=refuse_one, daemon=True)
        thread.start()
        untrusted = _untrusted_client(certificates, tmp_path)
        assert refuses_client_certificate(address, time.monotonic() + 5, _probe(untrusted))
        thread.join()


class _Listener:
    """A listener on one port that either completes a TLS handshake (a ledger
    serving TLS) or hangs up at once (a plaintext ledger restarting, or a proxy
    whose backend is gone), switched while the lane's client keeps its channel."""

    def __init__(self, certificates: dict[str, pathlib.Path]) -> None:
        self.serves_tls = True
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certificates["server.pem"], certificates["server.key"])
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._socket.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        for connection in _accepted(self._socket):
            with connection:
                connection.settimeout(5)
                if self.serves_tls:
                    self._handshake(connection)

    def _handshake(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if connection.recv(1, socket.MSG_PEEK) == b"\x16":  # a TLS ClientHello
                self._context.wrap_socket(connection, server_side=True).close()
                return
            # A plaintext client's bytes: hang up as a TLS ledger does, after
            # reading them, so the client sees the socket closed, not reset.
            connection.shutdown(socket.SHUT_WR)
            while connection.recv(4096):
                pass

    def close(self) -> None:
        self._socket.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._socket.close()
        self._thread.join()


def test_a_tls_ledger_replaced_by_a_plaintext_one_is_an_outage_again(
    certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    # The operator fixed the mismatch on the server's side; while the plaintext
    # ledger restarts, "Socket closed" is a real outage, not the old TLS ledger.
    listener = _Listener(certificates)
    settings = TEST_SETTINGS  # a deadline that leaves the probe time on a busy machine
    try:
        with LaneClient(listener.address, "lane", settings=settings) as client:
            with pytest.raises(errors.TlsMismatch):
                client.balance()
            listener.serves_tls = False
            with pytest.raises(errors.LedgerUnavailable):
                client.balance()
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("address", "names"),
    [
        ("http://127.0.0.1:50051", "http://"),
        ("https://ledger.internal:50051", "https://"),
        ("grpc://127.0.0.1:50051", "grpc://"),
        ("127.0.0.1:99999", "65535"),
        ("127.0.0.1:0", "65535"),
        ("127.0.0.1:50051/", "port"),
        ("[::1]:70000", "65535"),
        (" 127.0.0.1:50051", "space"),
    ],
)
def test_an_address_grpc_can_never_reach_is_refused_at_construction(
    address: str, names: str, tmp_path: pathlib.Path
) -> None:
    # gRPC takes each of these and fails every call as UNAVAILABLE ("Misformatted
    # domain name"), or wraps the port (99999 reaches port 34463): the lane would
    # run on its outage allowance for good. Nothing is made, no journal opened.
    with pytest.raises(ValueError, match=names) as caught:
        LaneClient(address, "lane", outage=_allowance(tmp_path))
    assert str(caught.value).startswith("address: ")
    assert not (tmp_path / "journal.jsonl").exists()


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:50051",
        "localhost:50051",
        "ledger.internal",
        "[::1]:50051",
        "ipv4:10.0.0.11:50051,10.0.0.12:50051",
        "dns:///ledger.internal:50051",
        "unix:/tmp/ledger.sock",
        "unix:///tmp/ledger.sock",
        "xds:///ledger.internal",
    ],
)
def test_the_addresses_grpc_takes_are_taken(address: str) -> None:
    LaneClient(address, "lane").close()


@pytest.mark.parametrize(
    "roots",
    [b"not a certificate", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"],
)
def test_root_certificates_that_do_not_load_name_the_setting(
    fresh_server: LedgerProcess, certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path,
    roots: bytes,
) -> None:  # fmt: skip
    # gRPC says only "Failed to create security handshaker", on every call:
    # no outage, and no retry will load them.
    tls = dataclasses.replace(lane_tls(certificates), root_certificates=roots)
    mismatch = _tls_mismatch(fresh_server.address, "a-lane", fresh_server.admin_grant, tls,
                             tmp_path)  # fmt: skip
    assert "root_certificates" in mismatch.message and "PEM" in mismatch.message


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("outage", "deny"),
        ("tls", True),
        ("settings", {"deadline_seconds": 1.0}),
        ("grant", 12345),
        ("grant", b"token"),
    ],
)
def test_a_keyword_of_the_wrong_type_is_refused_naming_it(keyword: str, value: object) -> None:
    # Each failed deep inside (AttributeError: 'str' object has no attribute
    # 'journal_path', "object of type 'int' has no len()"), naming nothing.
    with pytest.raises(TypeError, match=f"^{keyword}: "):
        LaneClient("127.0.0.1:9", "lane", **{keyword: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("ending", ["refund", None, {"settlement": "refund"}])
def test_an_end_that_is_no_ending_is_refused_naming_it(ending: object) -> None:
    # A word or a dict for the Ending failed as an AttributeError naming neither.
    with LaneClient("127.0.0.1:1", "lane") as ledger, pytest.raises(TypeError, match=r"^ending: "):
        ledger.end("r-1", ending)  # type: ignore[arg-type]
