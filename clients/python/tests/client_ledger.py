"""Helpers for the lane client's end-to-end tests: a real `ledger serve` on port 0
with a test clock, in a temporary data directory; an admin helper that talks to it
with the admin grant the server writes there; test certificates for mutual TLS."""

from __future__ import annotations

import contextlib
import pathlib
import selectors
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import grpc
from google.protobuf import duration_pb2
from ledger_client import ClientSettings, TlsSettings
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb
from ledger_client.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc

START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 15.0
LISTENING = "ledger listening on "
# Generous deadlines for tests on a busy machine; the timing tests set their own.
TEST_SETTINGS = ClientSettings(deadline_seconds=5.0, replay_interval_seconds=None)
# 1 nano per input token and 2 per output token, per million: easy sums.
PRICE = pb.ModelPrice(
    input_nanos_per_million_tokens=1_000_000, output_nanos_per_million_tokens=2_000_000
)


def ledger_executable() -> str:
    return str(pathlib.Path(sys.executable).with_name("ledger"))


@contextlib.contextmanager
def running(
    data_dir: pathlib.Path, extra_arguments: tuple[str, ...] = ()
) -> Iterator[LedgerProcess]:
    """A server of its own in a new `data_dir`, stopped when the block ends."""
    server = LedgerProcess(data_dir, extra_arguments)
    server.data_dir.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


class LedgerProcess:
    """One `ledger serve` process; restartable on the same port and data dir."""

    def __init__(self, data_dir: pathlib.Path, extra_arguments: tuple[str, ...] = ()) -> None:
        self.data_dir = data_dir
        self.extra_arguments = extra_arguments
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_grant(self) -> str:
        return (self.data_dir / "admin.grant").read_text().strip()

    def issue_grant(self, *arguments: str) -> str:
        """`ledger grant issue` against this server's keyring."""
        command = [ledger_executable(), "grant", "issue", "--data-dir", str(self.data_dir),
                   *arguments]  # fmt: skip
        done = subprocess.run(command, capture_output=True, check=True, timeout=60)
        return done.stdout.decode().strip()

    def start(self) -> None:
        assert self._process is None
        self._starts += 1
        log = (self.data_dir / f"server-{self._starts}.log").open("wb")
        command = [
            ledger_executable(),
            "serve",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--data-dir",
            str(self.data_dir),
            "--test-clock",
            *self.extra_arguments,
        ]
        try:
            self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log)
        finally:
            log.close()
        self.port = self._read_port()

    def _read_port(self) -> int:
        process = self._process
        assert process is not None and process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            if not selector.select(START_TIMEOUT_SECONDS):
                self.kill()
                raise AssertionError("the ledger did not start in time")
        line = process.stdout.readline().decode()
        if not line.startswith(LISTENING):
            self.kill()
            raise AssertionError(f"unexpected first line from the ledger: {line!r}")
        return int(line[len(LISTENING) :].strip().rsplit(":", 1)[1])

    def _end(self, signal_number: int) -> int:
        process = self._process
        if process is None:
            return 0
        self._process = None
        if process.poll() is None:
            process.send_signal(signal_number)
        try:
            code = process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        assert process.stdout is not None
        process.stdout.close()
        return code

    def stop(self) -> int:
        return self._end(signal.SIGTERM)

    def kill(self) -> int:
        return self._end(signal.SIGKILL)


class Admin:
    """Lane setup, the test clock and the event log, through the generated stubs."""

    def __init__(self, server: LedgerProcess, tls: TlsSettings | None = None) -> None:
        if tls is None:
            self._channel = grpc.insecure_channel(server.address)
        else:
            self._channel = grpc.secure_channel(server.address, tls.credentials())
        self._metadata = (("authorization", f"Bearer {server.admin_grant}"),)
        self._lanes = pb_grpc.LaneAdminStub(self._channel)
        self._clock = pb_grpc.TestClockStub(self._channel)
        self._ledger = pb_grpc.LedgerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def put_lane(
        self,
        lane: str,
        limit_nanos: int,
        *,
        hold_ttl_seconds: int = 120,
        prices: dict[str, pb.ModelPrice] | None = None,
        parent: str = "",
    ) -> None:
        message = pb.Lane(
            lane=lane,
            limit_nanos=limit_nanos,
            hold_ttl=duration_pb2.Duration(seconds=hold_ttl_seconds),
            prices={"model-a": PRICE} if prices is None else prices,
            parent=parent,
        )
        self._lanes.PutLane(pb.PutLaneRequest(lane=message), metadata=self._metadata, timeout=10)

    def advance(self, seconds: int) -> None:
        self._clock.Advance(duration_pb2.Duration(seconds=seconds), metadata=self._metadata,
                            timeout=10)  # fmt: skip

    def events(self, lane: str) -> list[pb.Event]:
        events: list[pb.Event] = []
        token = ""
        for _ in range(100):
            page = self._ledger.ListEvents(
                pb.ListEventsRequest(lane=lane, page_size=1000, page_token=token),
                metadata=self._metadata,
                timeout=10,
            )
            events.extend(page.events)
            token = page.next_page_token
            if not token:
                return events
        raise AssertionError("more events than a test makes")

    def booking_events(self, lane: str) -> dict[str, list[str]]:
        """Each reservation_id's event kinds, in order."""
        kinds: dict[str, list[str]] = {}
        for event in self.events(lane):
            if event.reservation_id:
                kinds.setdefault(event.reservation_id, []).append(event.kind)
        return kinds


def new_lane_name() -> str:
    return f"lane-{uuid.uuid4().hex[:12]}"


def _openssl(*arguments: str, directory: pathlib.Path) -> None:
    subprocess.run(["openssl", *arguments], cwd=directory, capture_output=True, check=True,
                   timeout=60)  # fmt: skip


def make_certificates(
    directory: pathlib.Path,
    server_names: str = "DNS:localhost,IP:127.0.0.1",
    ca_name: str = "ledger-test-ca",
) -> dict[str, pathlib.Path]:
    """A test CA named `ca_name`, a server certificate for `server_names` (its
    subjectAltName) and a lane's client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", f"/CN={ca_name}", directory=directory)  # fmt: skip
    (directory / "san.ext").write_text(f"subjectAltName={server_names}\n")
    for name, extra in (("server", ("-extfile", "san.ext")), ("client", ())):
        _openssl("req", *curve, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", directory=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *extra,
                 directory=directory)  # fmt: skip
    return {name: directory / name for name in
            ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}  # fmt: skip


def ledger_tls_arguments(files: dict[str, pathlib.Path], *, mutual: bool = True) -> tuple[str, ...]:
    """`ledger serve`'s TLS flags for these certificates; mutual: demand a client
    certificate signed by their CA."""
    arguments = ("--tls-cert", str(files["server.pem"]), "--tls-key", str(files["server.key"]))
    return (*arguments, "--tls-client-ca", str(files["ca.pem"])) if mutual else arguments


def lane_tls(files: dict[str, pathlib.Path], *, client_certificate: bool = True) -> TlsSettings:
    if not client_certificate:
        return TlsSettings(root_certificates=files["ca.pem"].read_bytes())
    return TlsSettings(
        root_certificates=files["ca.pem"].read_bytes(),
        certificate_chain=files["client.pem"].read_bytes(),
        private_key=files["client.key"].read_bytes(),
    )
